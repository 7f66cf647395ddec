"""Stage capacities of the served system: what engines of one kind sustain with `p_slo`
of the requests within their own deadlines.

SARA's stage models (`prefill.py`, `decode.py`) size for one first-token and one
per-token target, the mean request's, and leave out what the engines do beyond the
paper's roofline: the per-step overhead, the batching of prompts, the prefix cache and
the scheduler's caps. Sized from them, pools came out 2-8x too large in prefill and up
to 1.5x too small in decode, and only measured capacity factors made them usable.
These models describe the engines the router serves on instead:
- **Each request's own budget.** Traffic is a sample of requests (prompt, cached
  prefix, output, deadline). A stage is given, per request, its solo time on the
  reference GPU plus a share of that request's slack (deadline minus solo time), so a
  long prompt or a long answer may wait as long as its own deadline allows.
- **Prefill** is a FCFS M/G/n queue of prompts whose service is each prompt's share of a
  full chunked-prefill iteration: its uncached tokens at the batched per-token cost plus
  its attention over the cached context (`app.hardware.specs`). A request meets its prefill
  budget b_i when W <= b_i - S_i, S_i its prefill alone on the engine, W the queue's wait
  (`MgkQueue`, refined method); the attainment is the mean over the sample.
- **The prefix cache evicts.** An agent step finds its session's context cached only if
  the engine's LRU kept it over the step's idle gap (the previous step's decode and the
  tool wait). By Che's approximation a context survives when its gap is shorter than
  the cache's characteristic time T, where the contexts touched within T fill the cache:
  r E[prompt x min(idle after, T)] = KV capacity, r the engine's step rate. A step whose
  context was evicted prefills all but the shared prefix. On chat-agent sessions an
  H800 prefill engine keeps a context 27 s at 2 steps/s and 14 s at 3 (the median gap
  is 12 s): without this the model promised three times the rate the engine carries.
- **Decode** is continuous batching: n requests share each step, whose time t(n) is the
  engine's iteration time for n sequences at the slots' time-averaged context (weights,
  KV reads that grow with the context, all-reduce and per-step overhead). A request
  finds n others running (arrivals see time averages) and decodes beside them, so
  Little's law gives the occupancy, n = lambda E[N - 1] t(1 + n); the engine is
  saturated when n would pass its `max_num_seqs` or its KV cache (less the KV that
  sessions keep parked between steps). A request meets its decode budget when
  (N_i - 1) t(1 + n) fits it, and the KV holds its whole context beside the contexts
  of the others (a compound Poisson sum, normal in its first two moments): long
  contexts overflow a small KV well before the mean occupancy fills it, and an engine
  that overflows preempts. (With t(n), a slow engine at a fraction of a request in
  flight looked unloaded: the A40 on chat sessions at 0.26 of the model's rate; without
  the overflow, coding sessions on two V100s decoded 1.7x what they carry.)
- **Unified** engines run both in one iteration (chunked prefill): each step carries
  the prompts' tokens that arrived during the previous one besides the decode tokens,
  so t solves t = T(n decodes, lambda E[u] t prompt tokens); a request meets its
  deadline when its prompt waits one step, runs in ceil(u / budget) more, then decodes.
Every input is the engine's own (iteration model, scheduler caps, KV capacity) or the
traffic's; nothing is fitted to a measurement (`app.experiments.calibrate` checks).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import cached_property

import numpy as np
from scipy import special

from app.engines.config import SchedulerConfig
from app.hardware.specs import BatchShape, InstanceSpec, PrefillChunk, make_instance
from app.planning.allocator import LengthMoments
from app.planning.distributions import LengthDist
from app.planning.queues import Method, MgkQueue
from app.planning.search import max_feasible_rate
from app.planning.split import EngineKind
from app.workloads.sessions import SessionTimeline
from app.workloads.workload import Workload, WorkloadRequest

PREFILL, DECODE, UNIFIED = "prefill", "decode", "unified"
GRID_POINTS = 24  # quantiles per length in a sample built from moments (24 x 24 requests)
FIXED_POINT_STEPS = 60
MIN_CV = 0.05


@dataclass(frozen=True)
class TrafficSample:
    """Requests standing for the traffic: lengths and end-to-end deadlines.

    `cached_tokens`: prompt tokens the serving engine already holds (an agent step's
    context, a shared prefix). `held_kv_tokens`: context that sessions keep parked on a
    decoding engine between their steps (tool waits), per engine."""

    prompt_tokens: np.ndarray
    cached_tokens: np.ndarray
    output_tokens: np.ndarray
    deadline_s: np.ndarray
    held_kv_tokens: float = 0.0
    reuse: ContextReuse | None = None  # sessions: which cached context each step reuses

    def __post_init__(self) -> None:
        n = len(self.prompt_tokens)
        if n == 0:
            raise ValueError("a traffic sample needs at least one request")
        for name in ("cached_tokens", "output_tokens", "deadline_s"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"{name} has {len(getattr(self, name))} entries, want {n}")
        if np.any(self.prompt_tokens < 1) or np.any(self.output_tokens < 1):
            raise ValueError("prompts and outputs need at least one token")
        if np.any(self.cached_tokens < 0) or np.any(self.cached_tokens >= self.prompt_tokens):
            raise ValueError("cached tokens must be in [0, prompt tokens)")
        if self.held_kv_tokens < 0:
            raise ValueError(f"held KV must be >= 0 tokens, got {self.held_kv_tokens}")
        if self.reuse is not None and len(self.reuse.parent) != n:
            raise ValueError(f"reuse covers {len(self.reuse.parent)} requests, want {n}")

    @property
    def uncached_tokens(self) -> np.ndarray:
        return self.prompt_tokens - self.cached_tokens

    @classmethod
    def from_lengths(cls, prompt: np.ndarray, cached: np.ndarray, output: np.ndarray,
                     reference: InstanceSpec, slo_scale: float,
                     held_kv_tokens: float = 0.0) -> TrafficSample:
        """Deadlines as the experiments set them: `slo_scale` x solo time on `reference`
        (the cached prefix counted as cached, as `app.workloads.slo` does)."""
        prompt, cached, output = (np.asarray(a, dtype=np.int64) for a in (prompt, cached, output))
        solo = SoloPhases.of(reference, prompt, cached, output)
        return cls(prompt, cached, output, slo_scale * solo.total_s, held_kv_tokens)

    @classmethod
    def from_workload(cls, workload: Workload, reference: InstanceSpec, slo_scale: float,
                      held_kv_tokens: float = 0.0) -> TrafficSample:
        """The requests themselves, their cached prefix what one engine serving them in
        order would hold (`prefix_hits`); deadlines `slo_scale` x solo time. For agent
        sessions, which context each step reuses and after what wait, each step served
        alone on `reference` (`ContextReuse.of`), so the engine's cache may have evicted
        it."""
        requests = workload.requests
        prompt = np.array([r.num_prompt_tokens for r in requests])
        sample = cls.from_lengths(prompt, np.array(prefix_hits(requests)),
                                  np.array([r.num_output_tokens for r in requests]),
                                  reference, slo_scale, held_kv_tokens)
        if workload.graph is None:
            return sample
        solo = SoloPhases.of(reference, sample.prompt_tokens, sample.cached_tokens,
                             sample.output_tokens)
        return replace(sample, reuse=ContextReuse.of(workload, sample.cached_tokens,
                                                     solo.total_s))

    @classmethod
    def from_moments(cls, workload: LengthMoments, reference: InstanceSpec, slo_scale: float,
                     held_kv_tokens: float = 0.0, points: int = GRID_POINTS) -> TrafficSample:
        """A quantile grid of the moments a controller measures: prompts from the input
        distribution, outputs exponential with the observed mean (SARA's assumption),
        independent; each prompt's cached share is the traffic's mean one."""
        probs = (np.arange(points) + 0.5) / points
        prompts = np.maximum(1, np.round(workload.input_len.quantile(probs)))
        outputs = np.maximum(1, np.round(
            LengthDist.exponential(workload.mean_output_len).quantile(probs)))
        cached_share = 1.0 - min(1.0, workload.prefill_len.mean / workload.input_len.mean)
        prompt = np.repeat(prompts, points)
        output = np.tile(outputs, points)
        cached = np.minimum(np.floor(prompt * cached_share), prompt - 1)
        return cls.from_lengths(prompt, cached, output, reference, slo_scale, held_kv_tokens)


def prefix_hits(requests: Sequence[WorkloadRequest]) -> list[int]:
    """Prompt tokens each request finds cached on one engine that served all before it
    with a cache that evicts nothing: the longest prefix of its hash blocks seen before
    (as the engines match it, at most the prompt less one token). Engines cache prompts:
    an agent step's previous output is computed again. Without block hashes, an agent
    step finds the context it extends."""
    seen: set[int] = set()  # chained block hashes: equal hash, equal prefix
    hits = []
    for r in requests:
        matched = 0
        for block in r.block_hashes:
            if block not in seen:
                break
            matched += 1
        seen.update(r.block_hashes)
        context = (0 if r.num_appended_tokens is None or r.block_hashes
                   else r.num_prompt_tokens - r.num_appended_tokens)
        hits.append(min(max(matched * r.hash_block_size, context), r.num_prompt_tokens - 1))
    return hits


@dataclass(frozen=True)
class ContextReuse:
    """How agent steps reuse their session's cached context: per request, the step whose
    prompt it extends (`parent`, -1: none), the wait between its last parent's end and
    its arrival, and the prompt tokens it still finds cached when the engine evicted
    that context (the prefix it shares with other sessions)."""

    parent: np.ndarray
    wait_s: np.ndarray  # its tool wait, or longer where its own arrival comes later
    shared_tokens: np.ndarray

    @classmethod
    def of(cls, workload: Workload, cached_tokens: np.ndarray,
           step_s: np.ndarray) -> ContextReuse:
        """From a session workload's graph, each step taking `step_s` (`SessionTimeline`):
        a step extends its first parent's prompt; its shared prefix is what blocks of
        other sessions cover (`prefix_hits` over the requests with its own session's
        earlier blocks left out)."""
        assert workload.graph is not None
        parent = np.array([p[0] if p else -1 for p in workload.graph.parents])
        shared = np.array(_shared_prefix_hits(workload.requests))
        return cls(parent, SessionTimeline.of(workload, step_s).wait_s,
                   np.minimum(shared, cached_tokens))

    def idle_gaps_s(self, busy_s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(before, after): per request, how long the context it reuses sat untouched
        before it arrived (nan: it reuses none), and how long its own prompt waits for the
        session's next step (inf: none comes). `busy_s`: per request, the time after its
        prompt was last touched on the engine until it ends (a prefill engine: the
        decode elsewhere; a unified one: none, it touches the prompt at the end)."""
        has_parent = self.parent >= 0
        before = np.full(len(self.parent), np.nan)
        before[has_parent] = busy_s[self.parent[has_parent]] + self.wait_s[has_parent]
        after = np.full(len(self.parent), np.inf)
        np.fmin.at(after, self.parent[has_parent], before[has_parent])
        return before, after


def cache_time_s(prompt_tokens: np.ndarray, idle_after_s: np.ndarray, steps_per_s: float,
                 capacity_tokens: float) -> float:
    """Che's characteristic time of an LRU cache: the T for which the prompts touched
    within the last T fill it, steps_per_s E[prompt x min(idle after, T)] = capacity
    (inf: the cache holds every prompt until its session's next step)."""
    if steps_per_s <= 0:
        return math.inf
    def held(t: float) -> float:
        return steps_per_s * float(np.mean(prompt_tokens * np.minimum(idle_after_s, t)))
    finite = idle_after_s[np.isfinite(idle_after_s)]
    top = float(finite.max()) if len(finite) else 0.0
    if held(top) <= capacity_tokens and np.all(np.isfinite(idle_after_s)):
        return math.inf
    lo, hi = 0.0, max(top, 1.0)
    while held(hi) < capacity_tokens:
        hi *= 2
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if held(mid) < capacity_tokens else (lo, mid)
    return hi


def _shared_prefix_hits(requests: Sequence[WorkloadRequest]) -> list[int]:
    """Like `prefix_hits`, counting only blocks that another session cached first."""
    owner: dict[int, str | None] = {}
    hits = []
    for r in requests:
        matched = 0
        for block in r.block_hashes:
            if owner.get(block, r.session_id) == r.session_id:
                break
            matched += 1
        for block in r.block_hashes:
            owner.setdefault(block, r.session_id)
        hits.append(min(matched * r.hash_block_size, r.num_prompt_tokens - 1))
    return hits


@dataclass(frozen=True)
class SoloPhases:
    """Each request alone on one instance: time to first token, mean time per later one."""

    ttft_s: np.ndarray
    tpot_s: np.ndarray
    output_tokens: np.ndarray

    @property
    def decode_s(self) -> np.ndarray:
        return np.maximum(self.output_tokens - 1, 0) * self.tpot_s

    @property
    def total_s(self) -> np.ndarray:
        return self.ttft_s + self.decode_s

    @classmethod
    def of(cls, instance: InstanceSpec, prompt: np.ndarray, cached: np.ndarray,
           output: np.ndarray) -> SoloPhases:
        memo: dict[tuple[int, int, int], tuple[float, float]] = {}
        ttft, tpot = np.empty(len(prompt)), np.empty(len(prompt))
        for i, key in enumerate(zip(prompt.tolist(), cached.tolist(), output.tolist(),
                                    strict=True)):
            if key not in memo:
                memo[key] = instance.solo_phases_s(key[0], key[2], num_cached_tokens=key[1])
            ttft[i], tpot[i] = memo[key]
        return cls(ttft, tpot, output)


@dataclass(frozen=True)
class StageBudgets:
    """What each request may spend in one stage: its solo time there on the reference
    GPU plus `share` of its slack (prefill; decode gets the rest of the slack). A share
    of None splits each request's slack in proportion to its own solo phases (first
    token within scale x its solo prefill, the rest within scale x its solo decode)."""

    prefill_s: np.ndarray
    decode_s: np.ndarray
    total_s: np.ndarray  # the whole deadline: a unified engine runs both stages
    solo_decode_s: np.ndarray  # the decode alone on the reference GPU

    @classmethod
    def split(cls, sample: TrafficSample, reference: InstanceSpec,
              prefill_share: float | None) -> StageBudgets:
        if prefill_share is not None and not 0 <= prefill_share <= 1:
            raise ValueError(f"prefill share must be in [0, 1], got {prefill_share}")
        solo = SoloPhases.of(reference, sample.prompt_tokens, sample.cached_tokens,
                             sample.output_tokens)
        slack = np.maximum(sample.deadline_s - solo.total_s, 0.0)
        share = (solo.ttft_s / solo.total_s if prefill_share is None
                 else np.full(len(slack), prefill_share))
        return cls(solo.ttft_s + share * slack, solo.decode_s + (1 - share) * slack,
                   sample.deadline_s, solo.decode_s)


class EngineModel:
    """One engine kind's stage capacities for a traffic sample and stage budgets."""

    def __init__(self, instance: InstanceSpec, sample: TrafficSample, budgets: StageBudgets,
                 scheduler: SchedulerConfig | None = None, p_slo: float = 0.9,
                 method: Method = Method.REFINED) -> None:
        if not 0 < p_slo < 1:
            raise ValueError(f"p_slo must be in (0, 1), got {p_slo}")
        self.instance, self.sample, self.budgets = instance, sample, budgets
        self.scheduler = scheduler or SchedulerConfig()
        self.p_slo, self.method = p_slo, method
        self._costs: dict[bytes, tuple[np.ndarray, np.ndarray]] = {}  # cached -> prefill costs

    @classmethod
    def for_kind(cls, kind: EngineKind, model: str, sample: TrafficSample,
                 budgets: StageBudgets, p_slo: float = 0.9) -> EngineModel:
        return cls(make_instance(kind.gpu, model, kind.tp), sample, budgets, kind.scheduler(),
                   p_slo)

    def rate(self, role: str, engines: int = 1) -> float:
        """Largest arrival rate `engines` engines of this kind carry in `role` with p_slo
        of the requests within their budgets (0 if none)."""
        if engines < 1:
            return 0.0
        if role == PREFILL:
            return self._prefill_rate(engines)
        if role == DECODE:
            return engines * self._largest(self.decode_attainment, self._decode_ceiling())
        if role == UNIFIED:  # prompts only lengthen the steps: decode's ceiling fails too
            return engines * self._largest(self.unified_attainment, self._decode_ceiling())
        raise ValueError(f"unknown role {role!r}")

    def _largest(self, attainment: Callable[[float], float], ceiling: float) -> float:
        if not ceiling > 0:
            return 0.0
        return max_feasible_rate(lambda r: attainment(r) >= self.p_slo, ceiling)

    # ---- prefill -----------------------------------------------------------
    def _cached_at(self, steps_per_s: float, busy_s: np.ndarray) -> np.ndarray:
        """Prompt tokens each request finds cached on an engine taking `steps_per_s`: a
        step whose session context outlived its idle gap in the LRU (`cache_time_s`)
        finds it, the others only their shared prefix. `busy_s`: per request, how long
        after its prompt's last touch on this engine it ends (`ContextReuse.idle_gaps_s`)."""
        s = self.sample
        if s.reuse is None:
            return s.cached_tokens
        before, after = s.reuse.idle_gaps_s(busy_s)
        horizon = cache_time_s(s.prompt_tokens, after, steps_per_s,
                               self.instance.kv_capacity_tokens)
        evicted = before >= horizon  # nan (no session context) compares False
        return np.where(evicted, s.reuse.shared_tokens, s.cached_tokens)

    @property
    def _remote_decode_s(self) -> np.ndarray:
        """A prefill engine's idle time per request: its decode, on another engine (of
        whatever kind: taken alone on the reference GPU)."""
        return self.budgets.solo_decode_s

    def _prefill_costs(self, cached: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(work, solo) per request with `cached` tokens cached: its share of a full
        chunked-prefill iteration (uncached tokens at the batched per-token cost plus its
        attention over the cached context), and its prefill alone on the engine."""
        key = cached.tobytes()
        if key not in self._costs:
            full = self.scheduler.max_num_batched_tokens
            parts = self.instance.iteration_breakdown(BatchShape.build([PrefillChunk(full, 0)]))
            per_token = (parts.linear_s + parts.allreduce_s + parts.overhead_s) / full
            s = self.sample
            uncached = s.prompt_tokens - cached
            memo: dict[tuple[int, int], float] = {}
            attention = np.empty(len(uncached))
            for i, pair in enumerate(zip(uncached.tolist(), cached.tolist(), strict=True)):
                if pair not in memo:
                    memo[pair] = self.instance.iteration_breakdown(
                        BatchShape.build([PrefillChunk(*pair)])).attention_s
                attention[i] = memo[pair]
            solo = SoloPhases.of(self.instance, s.prompt_tokens, cached,
                                 np.ones_like(s.output_tokens)).ttft_s
            self._costs[key] = (uncached * per_token + attention, solo)
        return self._costs[key]

    def _prefill_at(self, steps_per_s: float, busy_s: np.ndarray
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(cached, work, solo) per request on an engine taking `steps_per_s`: the tokens
        its cache still holds for each step (`_cached_at`) and the step's prefill costs
        with them."""
        s = self.sample
        cached = self._cached_at(steps_per_s, busy_s)
        work, solo = self._prefill_costs(s.cached_tokens)
        if s.reuse is not None and not np.array_equal(cached, s.cached_tokens):
            evicted = cached != s.cached_tokens
            work_miss, solo_miss = self._prefill_costs(
                np.where(s.reuse.parent >= 0, s.reuse.shared_tokens, s.cached_tokens))
            work, solo = np.where(evicted, work_miss, work), np.where(evicted, solo_miss, solo)
        return cached, work, solo

    def prefill_attainment(self, rate: float, engines: int = 1) -> float:
        """Share of requests whose first token comes within their prefill budget."""
        _, work, solo = self._prefill_at(rate / engines, self._remote_decode_s)
        if rate <= 0:
            return float(np.mean(solo <= self.budgets.prefill_s))
        if rate * work.mean() >= engines:
            return 0.0
        service = LengthDist.from_moments(float(work.mean()), max(float(work.std() / work.mean()),
                                                                  MIN_CV))
        queue = MgkQueue(rate, engines, service)
        allowed = self.budgets.prefill_s - solo
        return float(np.mean(queue.wait_cdf_many(allowed, self.method)))

    def _prefill_rate(self, engines: int) -> float:
        work = self._prefill_costs(self.sample.cached_tokens)[0]
        return self._largest(lambda r: self.prefill_attainment(r, engines),
                             engines / float(work.mean()))

    # ---- decode ------------------------------------------------------------
    @cached_property
    def _decode_steps(self) -> np.ndarray:
        """Steps each request spends in a decode batch (the first token comes with the
        prompt's last prefill iteration)."""
        return np.maximum(self.sample.output_tokens - 1, 0)

    @cached_property
    def _slot_context(self) -> float:
        """Context length of a batch slot, averaged over time: each request counts for
        the steps it stays, at its mean context while it decodes."""
        return self._over_slots(self._decoding_context)

    @cached_property
    def _slot_context_sq(self) -> float:
        """The slots' squared context, averaged over time as `_slot_context`."""
        return self._over_slots(self._decoding_context**2)

    @cached_property
    def _decoding_context(self) -> np.ndarray:
        """Each request's mean context while it decodes."""
        return self.sample.prompt_tokens + self.sample.output_tokens / 2

    def _over_slots(self, values: np.ndarray) -> float:
        """Per-request `values` averaged over time in a batch slot: each request counts
        for the steps it stays."""
        steps = self._decode_steps
        return float(np.sum(steps * values) / max(np.sum(steps), 1))

    def _kv_room(self, others: float) -> np.ndarray:
        """Per request, the chance the KV holds its whole context beside the others it
        finds running: their contexts a compound Poisson sum (n of them on average, each
        from the slots' time-averaged distribution), normal in its first two moments.
        Past it the engine preempts, and the preempted request computes its context
        again. Long contexts on a small KV (coding sessions on two V100s hold four
        average ones) overflow well before the mean occupancy fills it."""
        s = self.sample
        free = self.instance.kv_capacity_tokens - s.held_kv_tokens
        own = s.prompt_tokens + s.output_tokens
        if others <= 0:
            return (own <= free).astype(float)
        mean, spread = others * self._slot_context, math.sqrt(others * self._slot_context_sq)
        return special.ndtr((free - own - mean) / spread)

    @cached_property
    def _slots(self) -> int:
        """Requests a step can hold: the scheduler's cap, and the KV cache less what
        parked sessions keep."""
        free = self.instance.kv_capacity_tokens - self.sample.held_kv_tokens
        return int(max(0, min(self.scheduler.max_num_seqs, free // max(self._slot_context, 1))))

    def step_s(self, num_decoding: float, num_prefill_tokens: float = 0.0,
               cached_context: float = 0.0) -> float:
        """One iteration with `num_decoding` sequences (fractional: linear between the
        neighbouring integers) and `num_prefill_tokens` of prompts over `cached_context`
        tokens of cached context."""
        lo = math.floor(num_decoding)
        t_lo = self._iteration(lo, num_prefill_tokens, cached_context)
        if lo == num_decoding:
            return t_lo
        t_hi = self._iteration(lo + 1, num_prefill_tokens, cached_context)
        return t_lo + (num_decoding - lo) * (t_hi - t_lo)

    def _iteration(self, num_decoding: int, num_prefill_tokens: float,
                   cached_context: float) -> float:
        chunks = []
        if num_prefill_tokens >= 1:
            chunks = [PrefillChunk(round(num_prefill_tokens), round(cached_context))]
        batch = replace(BatchShape.build(chunks), num_decode_seqs=num_decoding,
                        decode_context_tokens=round(num_decoding * self._slot_context))
        return self.instance.iteration_time_s(batch)

    def _occupancy(self, rate: float, prefill_tokens_per_s: float = 0.0,
                   cached_context: float = 0.0) -> tuple[float, float] | None:
        """(sequences per step, step time) at `rate` by Little's law, n = rate E[N-1] t,
        t = t(1 + n) the step a request shares with the n it finds,
        with the prompts' tokens that arrive during a step (over `cached_context` tokens
        of cached context) carried by the next; None when the engine saturates (n past
        its slots, or prompts past a step's budget)."""
        steps = float(np.mean(self._decode_steps)) * rate
        n, t = 1.0, self.step_s(1.0)
        for _ in range(FIXED_POINT_STEPS):
            t = self.step_s(1.0 + n, prefill_tokens_per_s * t, cached_context)
            new = steps * t
            budget = self.scheduler.max_num_batched_tokens
            if new > self._slots or prefill_tokens_per_s * t > budget:
                return None
            if abs(new - n) <= 1e-6 * max(n, 1.0):
                return new, t
            n = new
        return None  # not converging: the step grows faster than it serves

    def decode_attainment(self, rate: float) -> float:
        """Share of requests whose decode fits their decode budget, with room in the KV
        for them (`_kv_room`)."""
        state = self._occupancy(rate)
        if state is None:
            return 0.0
        fits = self._decode_steps * state[1] <= self.budgets.decode_s
        return float(np.mean(fits * self._kv_room(state[0])))

    def _decode_ceiling(self) -> float:
        """A rate the decode cannot carry: its slots full at the full step time."""
        if self._slots < 1 or not np.any(self._decode_steps):
            return 0.0
        return self._slots / (float(np.mean(self._decode_steps)) * self.step_s(self._slots))

    # ---- unified -----------------------------------------------------------
    def unified_attainment(self, rate: float) -> float:
        """Share of requests within their whole deadline on a unified engine: the prompt
        waits for the step running at its arrival (half of one on average; one counted),
        is computed over ceil(u / budget) steps, then decodes at the loaded step. A
        unified engine touches a step's prompt at its end: the context idles over the
        tool wait alone."""
        cached, _, solo = self._prefill_at(rate, np.zeros(len(self.sample.prompt_tokens)))
        uncached = self.sample.prompt_tokens - cached
        state = self._occupancy(rate, rate * float(np.mean(uncached)), float(np.mean(cached)))
        if state is None:
            return 0.0
        step = state[1]
        chunks = np.ceil(uncached / self.scheduler.max_num_batched_tokens)
        finish = step + np.maximum(chunks * step, solo) + self._decode_steps * step
        return float(np.mean((finish <= self.budgets.total_s) * self._kv_room(state[0])))


class ServedCapacity:
    """The served models of every engine kind for one traffic sample: what the inventory
    sizer asks in place of SARA's stage models (`InventorySizer(served=...)`)."""

    def __init__(self, model: str, sample: TrafficSample, reference: InstanceSpec,
                 p_slo: float = 0.9, prefill_share: float | None = None) -> None:
        self.model, self.sample, self.p_slo = model, sample, p_slo
        self.budgets = StageBudgets.split(sample, reference, prefill_share)
        self._engines: dict[EngineKind, EngineModel] = {}
        self._rates: dict[tuple[str, EngineKind, int], float] = {}

    @classmethod
    def from_moments(cls, model: str, workload: LengthMoments, reference: InstanceSpec,
                     slo_scale: float, p_slo: float = 0.9, held_kv_tokens: float = 0.0,
                     prefill_share: float | None = None) -> ServedCapacity:
        sample = TrafficSample.from_moments(workload, reference, slo_scale, held_kv_tokens)
        return cls(model, sample, reference, p_slo, prefill_share)

    def rate(self, role: str, kind: EngineKind, engines: int) -> float:
        key = (role, kind, engines)
        if key not in self._rates:
            if kind not in self._engines:
                self._engines[kind] = EngineModel.for_kind(kind, self.model, self.sample,
                                                           self.budgets, self.p_slo)
            self._rates[key] = self._engines[kind].rate(role, engines)
        return self._rates[key]
