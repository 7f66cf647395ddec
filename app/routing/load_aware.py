"""Load-aware baselines: LiteLLM `lowest-tpm` and a Llumnix-style router.

Llumnix places a request on the instance with the most free KV memory after
accounting for the queue (its "virtual usage"), and can move requests between
instances to balance load; that migration uses the same watchdog hook and the
same token-ID resume as GoodServe's, but ignores deadlines.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence

from app.routing.base import ActiveRequest, RouteDecision, Watchdog
from app.routing.baselines import SeededPolicy, no_fit
from app.routing.instance_view import InstanceId, InstanceView
from app.routing.view import ClusterView, FinishReport, RouteRequest

TPM_WINDOW_S = 60.0


class LowestTpmPolicy(SeededPolicy):
    """LiteLLM lowest-tpm: the instance that used the fewest tokens in the last minute.

    Prompt tokens count when routed, output tokens when the request finishes.
    """

    def __init__(self, seed: int = 0, window_s: float = TPM_WINDOW_S) -> None:
        super().__init__(seed)
        self.window_s = window_s
        self._usage: dict[InstanceId, deque[tuple[float, int]]] = {}  # id -> (time, tokens)
        self._totals: dict[InstanceId, int] = {}

    def _add(self, instance_id: InstanceId, tokens: int, now: float) -> None:
        self._usage.setdefault(instance_id, deque()).append((now, tokens))
        self._totals[instance_id] = self._totals.get(instance_id, 0) + tokens

    def tokens_per_window(self, instance_id: InstanceId, now: float) -> int:
        usage = self._usage.get(instance_id)
        while usage and usage[0][0] < now - self.window_s:
            self._totals[instance_id] -= usage.popleft()[1]
        return self._totals.get(instance_id, 0)

    def choose(self, request: RouteRequest, view: ClusterView, now: float) -> RouteDecision:
        candidates = view.holding(request)
        if not candidates:
            return no_fit(request)
        usage = {v.instance_id: self.tokens_per_window(v.instance_id, now) for v in candidates}
        lowest = min(usage.values())
        chosen = self.rng.choice([v for v in candidates if usage[v.instance_id] == lowest])
        self._add(chosen.instance_id, request.num_context_tokens, now)
        return chosen.instance_id

    def on_finish(self, report: FinishReport, now: float) -> None:
        self._add(report.instance_id, report.num_output_tokens, now)


def virtual_free_blocks(inst: InstanceView) -> float:
    """Free KV blocks minus what queued requests will claim (Llumnix's virtual usage),
    approximating each waiting request by the average running one."""
    used = inst.num_kv_blocks - inst.num_kv_blocks_free
    per_request = used / inst.num_running if inst.num_running else 0.0
    return inst.num_kv_blocks_free - inst.num_waiting * per_request


class LlumnixPolicy(SeededPolicy):
    """Llumnix-style dispatch: the most free (virtual) KV memory, as a fraction."""

    def choose(self, request: RouteRequest, view: ClusterView, now: float) -> RouteDecision:
        candidates = view.holding(request)
        if not candidates:
            return no_fit(request)
        return max(
            candidates,
            key=lambda v: (virtual_free_blocks(v) / v.num_kv_blocks, -v.num_outstanding,
                           v.instance_id),
        ).instance_id


class LlumnixBalancer(Watchdog):
    """Load-balancing migration: from an instance much fuller than the emptiest one,
    move its shortest-so-far running request there (cheapest re-prefill)."""

    def __init__(self, tau_iterations: int = 50, imbalance_threshold: float = 0.3) -> None:
        super().__init__(tau_iterations)
        self.imbalance_threshold = imbalance_threshold

    def check(
        self,
        instance_id: InstanceId,
        active: Sequence[ActiveRequest],
        view: ClusterView,
        now: float,
    ) -> Mapping[str, InstanceId]:
        source = view.get(instance_id)
        target = max(view.instances, key=lambda v: virtual_free_blocks(v) / v.num_kv_blocks)
        gap = (virtual_free_blocks(target) / target.num_kv_blocks
               - virtual_free_blocks(source) / source.num_kv_blocks)
        running = [a for a in active if a.is_running]
        if target is source or gap < self.imbalance_threshold or len(running) < 2:
            return {}
        victim = min(running, key=lambda a: (a.request.num_prompt_tokens + a.num_generated_tokens,
                                             a.request.request_id))
        if not target.can_hold(victim.request.num_prompt_tokens + victim.num_generated_tokens):
            return {}
        return {victim.request.request_id: target.instance_id}
