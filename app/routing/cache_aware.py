"""Prefix-cache-aware baselines: AIBrix `prefix-cache` and Preble's E2 scheduler.

Both read prefix hits from the view's lookup (block hashes), as the live router
does from engines' digests; neither knows deadlines.
"""

from __future__ import annotations

import statistics
from collections import Counter, deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from app.routing.base import RouteDecision
from app.routing.baselines import SeededPolicy, no_fit
from app.routing.instance_view import InstanceId, InstanceView
from app.routing.view import ClusterView, FinishReport, RouteRequest

# Preble's defaults (WukLab/preble, preble/global_scheduler_with_time.py)
PREBLE_LOAD_WINDOW_S = 180.0  # SlidingWindowHistogram(window_duration=timedelta(minutes=3))
PREBLE_HIGH_LOAD_RATIO = 1.5  # HIGH_LOAD_THRESHOLD: rebalance when heaviest >= 1.5 x lightest
PREBLE_MIN_ROUTED_PER_INSTANCE = 50  # no rebalancing before 50 x num_gpus requests were routed
PREBLE_MAX_CHAIN_STEPS = 3  # REBALANCING_CHAIN_LENGTH: longer chains are left alone
PREBLE_DEFAULT_OUTPUT_TOKENS = 45  # decode length when the request sets no max_tokens
PREBLE_NUM_TPOT_SAMPLES = 200  # avg_topt_per_gpu = deque(maxlen=200), read as a median

GroupKey = Hashable  # a prefix group: the block hash ending the group's shared prefix


def hit_tokens_by_instance(
    request: RouteRequest, candidates: Sequence[InstanceView], view: ClusterView
) -> dict[str, int]:
    return {v.instance_id: view.prefix_hit_tokens(v.instance_id, request) for v in candidates}


def longest_hit_holders(
    candidates: Sequence[InstanceView], hits: dict[str, int]
) -> list[InstanceView]:
    """The candidates sharing the longest cached prefix."""
    best = max(hits.values())
    return [v for v in candidates if hits[v.instance_id] == best]


class PrefixCachePolicy(SeededPolicy):
    """AIBrix prefix-cache: the longest prefix hit, unless load is too uneven.

    If the spread of outstanding requests exceeds `imbalance_threshold`, or no
    instance has a hit covering `min_hit_ratio` of the prompt, fall back to the
    least-loaded instance (AIBrix's load-imbalance guard).
    """

    def __init__(self, seed: int = 0, min_hit_ratio: float = 0.5, imbalance_threshold: int = 8):
        super().__init__(seed)
        self.min_hit_ratio = min_hit_ratio
        self.imbalance_threshold = imbalance_threshold

    def choose(self, request: RouteRequest, view: ClusterView, now: float) -> RouteDecision:
        candidates = view.holding(request)
        if not candidates:
            return no_fit(request)
        loads = [v.num_outstanding for v in candidates]
        if max(loads) - min(loads) > self.imbalance_threshold:
            return self.least_outstanding(candidates).instance_id
        hits = hit_tokens_by_instance(request, candidates, view)
        best = max(hits.values())
        if best < self.min_hit_ratio * request.num_prompt_tokens:
            return self.least_outstanding(candidates).instance_id
        return self.least_outstanding(longest_hit_holders(candidates, hits)).instance_id


@dataclass(frozen=True)
class PrebleRouted:
    """One routed request, as Preble's load window remembers it."""

    time_s: float
    group: GroupKey
    prefill_s: float  # seconds to prefill its uncached tokens where it was sent


class PrebleLoad:
    """Preble's per-instance load over a sliding window (its `SlidingWindowHistogram`).

    A prefix group's prefill cost is the prefill seconds of its requests routed in
    the last `window_s`, split evenly over the instances the group is allocated to.
    An instance's decode cost is the output tokens of the requests still running
    there, times the instance's median TPOT. Rebalancing changes a group's
    allocation, and its prefill cost moves with it at once, as in Preble.
    """

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._window: deque[PrebleRouted] = deque()
        self.num_in_window: Counter[GroupKey] = Counter()  # group -> requests in the window
        self.allocation: dict[GroupKey, frozenset[InstanceId]] = {}  # group -> its instances
        self._group_prefill_s: dict[GroupKey, float] = {}
        self._prefill_share_s: dict[InstanceId, float] = {}  # sum of prefill_s / |allocation|
        # request id -> (instance, group, output tokens) for requests still running
        self._in_flight: dict[str, tuple[InstanceId, GroupKey, int]] = {}
        self._decode_tokens: Counter[tuple[GroupKey, InstanceId]] = Counter()
        self._decode_tokens_on: Counter[InstanceId] = Counter()
        self._tpots_s: dict[InstanceId, deque[float]] = {}
        self._tpot_median_s: dict[InstanceId, float] = {}

    def _set_group(self, group: GroupKey, prefill_s: float,
                   allocation: frozenset[InstanceId]) -> None:
        """The one place a group's prefill cost or allocation changes."""
        old = self.allocation.get(group, frozenset())
        for instance_id in old:
            self._prefill_share_s[instance_id] -= self._group_prefill_s[group] / len(old)
        for instance_id in allocation:
            share = self._prefill_share_s.get(instance_id, 0.0) + prefill_s / len(allocation)
            self._prefill_share_s[instance_id] = share
        if allocation:
            self.allocation[group], self._group_prefill_s[group] = allocation, prefill_s
        else:
            self.allocation.pop(group, None)
            self._group_prefill_s.pop(group, None)

    def add(self, request_id: str, routed: PrebleRouted, instance_id: InstanceId,
            num_output_tokens: int) -> None:
        self.release(request_id)  # a re-routed request leaves its previous instance
        group = routed.group
        self._window.append(routed)
        self.num_in_window[group] += 1
        self._set_group(group, self._group_prefill_s.get(group, 0.0) + routed.prefill_s,
                        self.allocation.get(group, frozenset()) | {instance_id})
        self._in_flight[request_id] = (instance_id, group, num_output_tokens)
        self._decode_tokens[group, instance_id] += num_output_tokens
        self._decode_tokens_on[instance_id] += num_output_tokens

    def expire(self, now: float) -> list[GroupKey]:
        """Drop requests older than the window; return the groups that left it (their
        allocation is forgotten, as Preble resets it)."""
        gone = []
        while self._window and self._window[0].time_s < now - self.window_s:
            old = self._window.popleft()
            self.num_in_window[old.group] -= 1
            if self.num_in_window[old.group]:
                self._set_group(old.group, self._group_prefill_s[old.group] - old.prefill_s,
                                self.allocation[old.group])
                continue
            del self.num_in_window[old.group]
            self._set_group(old.group, 0.0, frozenset())
            gone.append(old.group)
        return gone

    def reallocate(self, group: GroupKey, allocation: frozenset[InstanceId]) -> None:
        self._set_group(group, self._group_prefill_s[group], allocation)

    def release(self, request_id: str) -> tuple[InstanceId, GroupKey] | None:
        """Forget a request that stopped running; return where it ran and its group."""
        placed = self._in_flight.pop(request_id, None)
        if placed is None:
            return None
        instance_id, group, num_tokens = placed
        self._decode_tokens[group, instance_id] -= num_tokens
        if not self._decode_tokens[group, instance_id]:
            del self._decode_tokens[group, instance_id]
        self._decode_tokens_on[instance_id] -= num_tokens
        return instance_id, group

    def record_tpot(self, instance_id: InstanceId, tpot_s: float) -> None:
        tpots = self._tpots_s.setdefault(instance_id, deque(maxlen=PREBLE_NUM_TPOT_SAMPLES))
        tpots.append(tpot_s)
        self._tpot_median_s[instance_id] = statistics.median(tpots)

    def tpot_s(self, inst: InstanceView) -> float:
        """Median observed TPOT; the spec's unloaded figure until one is observed."""
        return self._tpot_median_s.get(inst.instance_id, inst.spec.unloaded_decode_s_per_token)

    def load_s(self, inst: InstanceView) -> float:
        """L: the windowed prefill seconds allocated here plus the running decode seconds."""
        return (self._prefill_share_s.get(inst.instance_id, 0.0)
                + self._decode_tokens_on[inst.instance_id] * self.tpot_s(inst))

    def group_cost_s(self, group: GroupKey, inst: InstanceView) -> float:
        """A group's share of `load_s` on one of its instances (Preble's node cost)."""
        prefill_s = self._group_prefill_s[group] / len(self.allocation[group])
        return prefill_s + self._decode_tokens[group, inst.instance_id] * self.tpot_s(inst)

    def shared_groups_on(self, instance_id: InstanceId) -> list[GroupKey]:
        """Groups allocated to the instance that have at least two requests in the window
        (only these count for, and move in, rebalancing)."""
        return [g for g, n in self.num_in_window.items()
                if n >= 2 and instance_id in self.allocation[g]]

    def shared_loads_s(self, instances: Sequence[InstanceView]) -> dict[InstanceId, float]:
        return {v.instance_id: sum(self.group_cost_s(g, v)
                                   for g in self.shared_groups_on(v.instance_id))
                for v in instances}


class TtftTrend:
    """Preble's `TTFTWindowedOverloadedDetector`. A group is overloaded on an instance
    when its mean TTFT over the newer half of the window is at least twice its mean
    over the older half."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        # group -> instance -> (finish time, TTFT) samples
        self._samples: dict[GroupKey, dict[InstanceId, deque[tuple[float, float]]]] = {}

    def add(self, group: GroupKey, instance_id: InstanceId, ttft_s: float, now: float) -> None:
        samples = self._samples.setdefault(group, {}).setdefault(instance_id, deque())
        samples.append((now, ttft_s))
        while samples[0][0] < now - self.window_s:
            samples.popleft()

    def is_rising(self, group: GroupKey, instance_id: InstanceId, now: float) -> bool:
        samples = self._samples.get(group, {}).get(instance_id, ())
        cutoff_s = now - self.window_s / 2
        older = [ttft for t, ttft in samples if now - self.window_s <= t < cutoff_s]
        newer = [ttft for t, ttft in samples if t >= cutoff_s]
        return bool(older and newer) and statistics.mean(newer) >= 2 * statistics.mean(older)

    def forget(self, group: GroupKey, instance_id: InstanceId | None = None) -> None:
        if instance_id is None:
            self._samples.pop(group, None)
        else:
            self._samples.get(group, {}).pop(instance_id, None)


class PreblePolicy(SeededPolicy):
    """Preble's E2 scheduler with its load rebalancing (WukLab/preble,
    `GlobalSchedulerWithTime`, which its server runs with eviction costs on).

    - Exploit: if the longest cached prefix covers more of the prompt than it
      misses, the request joins that prefix's group. It goes to the group's
      instances, the cheapest of them.
    - Explore: otherwise the request starts a group of its own. It goes to the
      instance with the least cost = load L + eviction M + its own missed prefill P,
      all in seconds. L is the windowed load (`PrebleLoad`). P is the uncached
      tokens at the instance's prefill speed. M is the re-prefill of cached tokens
      that the missed tokens would displace.
    - Rebalance: runs after each decision once 50 requests per instance have been
      routed, and only for chains shorter than 3 steps. Loads count only groups with
      at least two requests in the window. While the heaviest instance's load is at
      least 1.5x the lightest's, its cheapest groups move to the lightest until the
      two loads would cross. Then the next heaviest is compared. A lone hot group is
      copied to the lightest instead of moved, and only when its TTFT doubled across
      the window.

    Deviations, because the view is not Preble's global radix tree:
    - Hits and groups come from block hashes and the instances' own caches. A
      request's group is the deepest group already in the window along its matched
      prefix, else that prefix itself. Preble takes the deepest tree node whose own
      tokens outnumber its ancestors'.
    - M counts only the missed tokens that exceed the instance's free KV. Preble
      runs an LRU simulation of each GPU's cache.
    - TPOT starts from the spec's unloaded figure, not Preble's 0.15 s prior.
    - Equal costs are broken at random, not to the first GPU.
    - The chain length is the request's `step_index`, not its depth in the tree.

    Decode length: as the scheduler Preble serves with (`get_node_cost` in
    WukLab/preble `preble/global_scheduler_with_time.py`, whose feed of finished
    lengths is commented out), a running request's decode load is its max_tokens, else
    45. Preble's own benchmarks send each request's true output length as max_tokens;
    clients here send none. The variant that prices a group's running requests at the
    median output of its finished ones (`global_scheduler_with_time_perf.py`) met less
    on chat sessions (capacity at 90% on paper-4gpu, 300-s windows, seeds 0 and 1: at
    SLO scale 3, 0.58 and 0.32 sessions/s against 0.87 and 0.78), so the served rule
    stays.

    Not modelled: Preble's local scheduler on each GPU (`fcfs-mpq`,
    `get_new_fill_batch_v2` in `python/sglang/srt/managers/router/model_rpc.py`). It
    sorts the waiting requests into ten queues by prefix-hit ratio and serves the
    queues in turn, so requests with long cached prefixes are admitted first. That is
    the engine's own queue order, which a router cannot set.
    """

    def __init__(
        self,
        seed: int = 0,
        load_window_s: float = PREBLE_LOAD_WINDOW_S,
        high_load_ratio: float = PREBLE_HIGH_LOAD_RATIO,
        min_routed_per_instance: int = PREBLE_MIN_ROUTED_PER_INSTANCE,
        max_chain_steps: int = PREBLE_MAX_CHAIN_STEPS,
        default_output_tokens: int = PREBLE_DEFAULT_OUTPUT_TOKENS,
    ) -> None:
        super().__init__(seed)
        self.high_load_ratio = high_load_ratio
        self.min_routed_per_instance = min_routed_per_instance
        self.max_chain_steps = max_chain_steps
        self.default_output_tokens = default_output_tokens
        self.load = PrebleLoad(load_window_s)
        self.ttft_trend = TtftTrend(load_window_s)
        self.num_routed = 0

    def choose(self, request: RouteRequest, view: ClusterView, now: float) -> RouteDecision:
        candidates = view.holding(request)
        if not candidates:
            return no_fit(request)
        for group in self.load.expire(now):
            self.ttft_trend.forget(group)
        ids = [v.instance_id for v in candidates]
        hits = {i: int(h) for i, h in zip(ids, view.prefix_hits_of(request, ids), strict=True)}
        group, targets = self.place(request, candidates, hits)
        costs = [self.cost_s(v, request, hits[v.instance_id]) for v in targets]
        lowest = min(costs)
        chosen = self.rng.choice([v for v, c in zip(targets, costs, strict=True) if c == lowest])
        self._record(request, chosen, group, hits[chosen.instance_id], now)
        if (request.step_index < self.max_chain_steps
                and self.num_routed >= self.min_routed_per_instance * len(view.instances)):
            self.rebalance(view, now)
        return chosen.instance_id

    def place(self, request: RouteRequest, candidates: Sequence[InstanceView],
              hits: dict[str, int]) -> tuple[GroupKey, Sequence[InstanceView]]:
        """The request's group and the instances it may go to (exploit or explore)."""
        best = max(hits.values())
        if best <= request.num_prompt_tokens - best:
            own = request.block_hashes[-1] if request.block_hashes else request.request_id
            return own, candidates
        group = self.group_of_prefix(request, best)
        allocated = self.load.allocation.get(group, frozenset())
        return group, ([v for v in candidates if v.instance_id in allocated]
                       or longest_hit_holders(candidates, hits))

    def group_of_prefix(self, request: RouteRequest, hit_tokens: int) -> GroupKey:
        """The deepest group in the window along the cached prefix, else the prefix."""
        num_blocks = min(len(request.block_hashes), -(-hit_tokens // request.hash_block_size))
        matched = request.block_hashes[:num_blocks]
        return next((b for b in reversed(matched) if b in self.load.num_in_window), matched[-1])

    def cost_s(self, inst: InstanceView, request: RouteRequest, hit_tokens: int) -> float:
        """L + M + P on `inst`, in seconds."""
        missed = request.num_context_tokens - hit_tokens
        evicted = max(0, missed - inst.kv_free_tokens)
        return self.load.load_s(inst) + (evicted + missed) * inst.spec.unloaded_prefill_s_per_token

    def _record(self, request: RouteRequest, chosen: InstanceView, group: GroupKey,
                hit_tokens: int, now: float) -> None:
        missed = request.num_context_tokens - hit_tokens
        prefill_s = missed * chosen.spec.unloaded_prefill_s_per_token
        num_output_tokens = request.max_output_tokens or self.default_output_tokens
        self.load.add(request.request_id, PrebleRouted(now, group, prefill_s),
                      chosen.instance_id, num_output_tokens)
        self.num_routed += 1

    def rebalance(self, view: ClusterView, now: float) -> None:
        """Shift groups from the heaviest instance to the lightest. Repeat with the next
        heaviest until one is below 1.5x the lightest."""
        loads = self.load.shared_loads_s(view.instances)
        order = sorted(loads, key=lambda i: -loads[i])
        while len(order) > 1:
            heavy, light = order[0], order[-1]
            if loads[heavy] < self.high_load_ratio * loads[light]:
                return
            self._shift(view.get(heavy), light, loads, now)
            order = order[1:]

    def _shift(self, heavy: InstanceView, light: InstanceId, loads: dict[InstanceId, float],
               now: float) -> None:
        src = heavy.instance_id
        movable = sorted(((self.load.group_cost_s(g, heavy), g)
                          for g in self.load.shared_groups_on(src)), key=lambda m: m[0])
        if len(movable) == 1:  # one hot group: copy it to the light instance if it is overloaded
            cost_s, group = movable[0]
            allocation = self.load.allocation[group]
            if light not in allocation and self.ttft_trend.is_rising(group, src, now):
                loads[src] -= cost_s / 2
                loads[light] += cost_s / 2
                self.load.reallocate(group, allocation | {light})
                self.ttft_trend.forget(group, src)
            return
        for cost_s, group in movable:  # cheapest first, until the two loads would cross
            if loads[src] - cost_s < loads[light] + cost_s:
                break
            loads[src] -= cost_s
            loads[light] += cost_s
            self.load.reallocate(group, frozenset({light}))
            if loads[src] < self.high_load_ratio * loads[light]:
                break

    def on_finish(self, report: FinishReport, now: float) -> None:
        placed = self.load.release(report.request.request_id)
        if placed is None or report.first_token_s is None:
            return
        instance_id, group = placed
        self.ttft_trend.add(group, instance_id, report.first_token_s - report.request.arrival_s,
                            now)
        if report.num_output_tokens > 1 and report.finish_s > report.first_token_s:
            tpot_s = (report.finish_s - report.first_token_s) / (report.num_output_tokens - 1)
            self.load.record_tpot(instance_id, tpot_s)

    def on_drop(self, request: RouteRequest, now: float) -> None:
        self.load.release(request.request_id)
