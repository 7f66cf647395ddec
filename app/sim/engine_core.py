"""Continuous-batching engine model: the one scheduler both sim substrates run.

The engine actor's sim backend drives it in (scaled) real time and the
discrete-event simulator drives it in virtual time. Each iteration is two calls:
`begin_step(now)` picks the batch and says how long it takes (from the hardware
model); `complete_step(step, end)` applies it and returns the tokens produced.
Everything is length-based (no token lists), so a 512-instance simulation of
long-context traces stays cheap; token ids are a deterministic function of the
request's seed and position, so a token-ID resume on another engine continues
exactly where the first one stopped.

The two scheduling policies are vLLM 0.32's (`vllm/v1/core/sched/scheduler.py`,
`Scheduler.schedule`; `request_queue.py`):
- the waiting queue: fcfs keeps arrival order and puts a preempted request back at
  its front (`FCFSRequestQueue`); priority is a heap on (priority, arrival, request
  id), a preempted request re-entering by that key (`PriorityRequestQueue`,
  `Request.__lt__`); arrival is when the request reached this engine;
- preemption happens only while the running requests are scheduled, when one cannot
  grow its KV: fcfs preempts the last of the running list, priority the running
  request of the largest (priority, arrival), the first such in running order (`max`
  over `self.running`), which may be one already scheduled this iteration (its
  tokens go back to the budget) or the request itself (it stops the pass);
- waiting requests are admitted from the head of the queue until one does not fit
  (sequence slots, token budget, KV); a waiting request never preempts a running
  one, whatever its priority;
- priority mode admits no waiting request in an iteration that preempted (vLLM's
  `if not preempted_reqs`); when such an iteration has nothing to run (the request
  that could not grow was itself the victim), it is vLLM's empty iteration, taken at
  no cost: the next one is scheduled at once. fcfs mode admits after a preemption
  too, as this model always has, so its runs stay comparable.
The KV blocks and the prefix cache are vLLM's too (`app/sim/block_cache.py`): cached
prefixes live in the pool the running requests draw from, a request admitted on a
cached prefix shares its blocks, and a free cached block is evicted, least recently
used first, only when new blocks need it.
Not modelled: vLLM skips blocked requests (LoRA, structured-output compilation, async
KV loads) and keeps a separate queue for requests holding KV.
"""

from __future__ import annotations

import functools
import heapq
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
from numba import njit

from app.engines.config import SchedulerConfig, SchedulingPolicy
from app.engines.messages import (
    FINISH_REASONS,
    EngineStatus,
    PrefillTotals,
    RequestStatus,
    TokenEvent,
)
from app.hardware.specs import BatchShape, InstanceSpec, chunk_attention_pairs
from app.sim.block_cache import BlockCache

_MASK64 = (1 << 64) - 1
_NO_DIGEST: frozenset[int] = frozenset()
# KV a decoding request reserves per iteration: the token it computes and the one it samples
_DECODE_GROWTH = 2


def sim_token_id(seed: int, index: int, vocab_size: int) -> int:
    """Deterministic 'generated' token: splitmix64 of (seed, position)."""
    z = (seed + (index + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) % vocab_size


@dataclass(eq=False)
class SimSequence:
    """One request inside the engine model (mutable scheduling state)."""

    request_id: str
    num_prompt_tokens: int
    max_output_tokens: int  # total output length, resumed tokens included
    arrival_s: float
    num_resumed_tokens: int = 0  # generated elsewhere; re-prefilled here
    block_hashes: tuple[int, ...] = ()  # prefix hashes of the prompt
    hash_block_size: int = 16  # tokens per entry of block_hashes
    token_seed: int = 0
    skip_prefill: bool = False  # decode role: KV arrived from a prefill engine
    priority: int = 0  # priority mode: lower runs first (the router's request_priority)

    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_output_tokens: int = field(init=False)
    # tokens whose KV must exist before the next token is sampled: prompt + resumed at
    # first, prompt + everything generated after a recompute preemption
    prefill_target: int = field(init=False)
    num_cached_tokens: int = 0  # prefix-cache hit (or delivered KV) at admission
    first_scheduled_s: float | None = None

    def __post_init__(self) -> None:
        if self.num_prompt_tokens < 1:
            raise ValueError(f"request {self.request_id}: empty prompt")
        if not 0 <= self.num_resumed_tokens < self.max_output_tokens:
            raise ValueError(
                f"request {self.request_id}: resumed {self.num_resumed_tokens} of "
                f"max {self.max_output_tokens} output tokens"
            )
        self.num_output_tokens = self.num_resumed_tokens
        self.prefill_target = self.num_prompt_tokens + self.num_resumed_tokens

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed_tokens < self.prefill_target

    @property
    def context_len(self) -> int:
        return self.num_computed_tokens

    @property
    def queue_key(self) -> tuple[int, float, str]:
        """Priority mode's waiting order (vLLM's `Request.__lt__`)."""
        return (self.priority, self.arrival_s, self.request_id)

    @property
    def preemption_key(self) -> tuple[int, float]:
        """Priority mode's victim: the running request with the largest key."""
        return (self.priority, self.arrival_s)


class FcfsQueue(deque[SimSequence]):
    """Waiting requests in arrival order; a preempted one goes back to the front."""

    def add(self, seq: SimSequence) -> None:
        self.append(seq)

    def prepend(self, seq: SimSequence) -> None:
        self.appendleft(seq)

    def peek(self) -> SimSequence:
        return self[0]

    def pop_next(self) -> SimSequence:
        return self.popleft()

    def priorities(self) -> None:
        """Every waiting request runs before a new one: no order to report."""
        return None


class PriorityQueue:
    """Waiting requests by (priority, arrival, request id); a preempted one re-enters
    by the same key."""

    def __init__(self) -> None:
        self._heap: list[tuple[tuple[int, float, str], SimSequence]] = []

    def add(self, seq: SimSequence) -> None:
        heapq.heappush(self._heap, (seq.queue_key, seq))

    prepend = add

    def peek(self) -> SimSequence:
        return self._heap[0][1]

    def pop_next(self) -> SimSequence:
        return heapq.heappop(self._heap)[1]

    def remove(self, seq: SimSequence) -> None:
        self._heap = [entry for entry in self._heap if entry[1] is not seq]
        heapq.heapify(self._heap)

    def priorities(self) -> tuple[int, ...]:
        """The waiting requests' priorities, ascending."""
        return tuple(sorted(key[0] for key, _ in self._heap))

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[SimSequence]:
        """In the order they would be admitted."""
        return (seq for _, seq in sorted(self._heap))


def waiting_queue(policy: SchedulingPolicy) -> FcfsQueue | PriorityQueue:
    """The waiting queue of a scheduling policy (vLLM's `create_request_queue`)."""
    if policy is SchedulingPolicy.PRIORITY:
        return PriorityQueue()
    return FcfsQueue()


@dataclass(frozen=True)
class ScheduledStep:
    """One iteration's plan: what runs and how long it takes."""

    start_s: float
    duration_s: float
    req_to_num_tokens: dict[str, int]  # request_id -> tokens computed this iteration
    batch: BatchShape

    @property
    def end_s(self) -> float:
        return self.start_s + self.duration_s


@dataclass(frozen=True, eq=False)
class DecodeRun:
    """A begun decode iteration (`step`, iteration 0) and the iterations that repeat
    its batch one token further each (1 to `num_repeats`), priced at once."""

    step: ScheduledStep
    seqs: tuple[SimSequence, ...]  # the batch, in running order
    # per sequence, when `step` began: computed and output tokens, KV blocks held
    computed: list[int]
    generated: list[int]
    held: list[int]
    durations_s: list[float]  # per iteration
    ends_s: list[float]  # per iteration; each its start (the one before's end) + duration
    new_blocks: list[int]  # per iteration: KV blocks the batch took since `step` began
    num_free_blocks: int  # when `step` began

    @property
    def num_repeats(self) -> int:
        return len(self.ends_s) - 1

    def start_s(self, index: int) -> float:
        """When iteration `index` begins: the end of the one before."""
        return self.ends_s[index - 1] if index else self.step.start_s

    def iteration(self, index: int) -> ScheduledStep:
        """Iteration `index` as `begin_step` schedules it."""
        if index == 0:
            return self.step
        batch, num_seqs = self.step.batch, len(self.seqs)
        shape = BatchShape(0, 0, 0, 0, num_seqs, batch.decode_context_tokens + index * num_seqs)
        return ScheduledStep(self.ends_s[index - 1], self.durations_s[index],
                             self.step.req_to_num_tokens, shape)


@njit(cache=True)
def _run_blocks(computed: np.ndarray, held: np.ndarray, block_size: int, limit: int,
                num_free: int) -> np.ndarray:
    """New KV blocks the batch has taken by each of repeats 0 to r (repeat r grows each
    request to hold its computed tokens + r + `_DECODE_GROWTH`), for the most repeats r,
    up to `limit`, that the `num_free` blocks cover."""
    taken = np.zeros(limit + 1, dtype=np.int64)
    for r in range(1, limit + 1):
        total = 0
        for i in range(len(computed)):
            needed = (computed[i] + r + _DECODE_GROWTH + block_size - 1) // block_size
            if needed > held[i]:
                total += needed - held[i]
        if total > num_free:
            return taken[:r]
        taken[r] = total
    return taken


@functools.cache
def warm_up() -> None:
    """Compile (or load from the on-disk cache) the run planner's pass before the first
    run is planned."""
    one = np.ones(1, dtype=np.int64)
    _run_blocks(one, one, 16, 1, 1)


class SimEngineCore:
    """vLLM-v1-like scheduler over the roofline latency model.

    Running requests are served first (decode: one token; partial prefill: the
    rest of the chunk budget), then waiting requests are admitted in queue order
    (arrival, or priority then arrival: the module docstring) while there is sequence
    room, token budget and KV blocks. When KV runs out, a running request is preempted
    (the latest admitted, or the one of the largest priority) and later recomputed
    (vLLM's recompute policy).
    """

    def __init__(
        self, instance: InstanceSpec, config: SchedulerConfig, *, status_window: int = 32,
        vocabulary: Sequence[int] | None = None,
    ) -> None:
        """`vocabulary`: the ids output tokens are drawn from (default: every id of the
        model's vocabulary)."""
        self.instance = instance
        self.config = config
        self.vocabulary = None if vocabulary is None else tuple(vocabulary)
        default_blocks = instance.kv_capacity_tokens // config.block_size
        self.num_kv_blocks = config.num_kv_blocks or default_blocks
        self.prefix_cache = BlockCache(config.block_size, config.enable_prefix_caching)
        self.waiting = waiting_queue(config.scheduling_policy)
        self.running: list[SimSequence] = []
        self.requests: dict[str, SimSequence] = {}
        self.req_to_blocks: dict[str, int] = {}  # request_id -> KV blocks held
        # request_id -> the cached prefix entries it holds (shared; part of its blocks)
        self.req_to_cached: dict[str, list[int]] = {}
        # a session's context held through a tool wait: key -> (entries, held until)
        self.pins: dict[str, tuple[list[int], float]] = {}
        self._pin_ends: list[tuple[float, str]] = []  # (held until, key), a heap
        self.num_free_blocks = self.num_kv_blocks
        self.recent_iteration_s: deque[float] = deque(maxlen=status_window)
        self.recent_queue_wait_s: deque[float] = deque(maxlen=status_window)
        self.num_iterations = 0
        self.num_queue_wait_samples = 0
        self.num_finished = 0
        self.num_preemptions = 0
        self.prefill = PrefillTotals()
        warm_up()

    # ---- request lifecycle -------------------------------------------------
    def add_request(self, seq: SimSequence) -> None:
        if seq.request_id in self.requests:
            raise ValueError(f"duplicate request id {seq.request_id}")
        needed = self._blocks_for(seq.prefill_target + 1)
        if needed > self.num_kv_blocks:
            raise ValueError(
                f"request {seq.request_id}: {seq.prefill_target} tokens exceed KV capacity "
                f"({self.num_kv_blocks * self.config.block_size} tokens)"
            )
        self.requests[seq.request_id] = seq
        self.waiting.add(seq)

    def abort_request(self, request_id: str) -> SimSequence | None:
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return None
        if seq.status == RequestStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self._free(seq)
        seq.status = RequestStatus.FINISHED_ABORTED
        return seq

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one iteration -----------------------------------------------------
    def begin_step(self, now_s: float) -> ScheduledStep | None:
        """Choose this iteration's batch; None when there is nothing to run."""
        self._release_pins(now_s)
        req_to_num_tokens = self._schedule(now_s)
        if not req_to_num_tokens:
            return None
        batch = self._batch_shape(req_to_num_tokens)
        duration_s = self.instance.iteration_time_s(batch)
        return ScheduledStep(now_s, duration_s, req_to_num_tokens, batch)

    def complete_step(self, step: ScheduledStep, now_s: float) -> list[TokenEvent]:
        """Apply a finished iteration; returns the tokens it produced."""
        self._count_iteration(step)
        events: list[TokenEvent] = []
        vocabulary = self.vocabulary
        vocab = self.instance.model.vocab_size if vocabulary is None else len(vocabulary)
        for request_id, num_tokens in step.req_to_num_tokens.items():
            seq = self.requests.get(request_id)
            if seq is None or seq.status != RequestStatus.RUNNING:
                continue  # aborted or preempted mid-iteration
            was_prefilling = seq.is_prefilling
            seq.num_computed_tokens += num_tokens
            if seq.is_prefilling:
                continue
            if was_prefilling:  # prompt KV now exists: later requests can reuse it
                self._cache_prompt(seq)
            index = seq.num_output_tokens
            seq.num_output_tokens += 1
            finish = None
            if seq.num_output_tokens >= seq.max_output_tokens:
                seq.status = RequestStatus.FINISHED_LENGTH
                finish = FINISH_REASONS[seq.status]
                self._finish(seq)
            token = sim_token_id(seq.token_seed, index, vocab)
            if vocabulary is not None:
                token = vocabulary[token]
            cached = seq.num_cached_tokens if was_prefilling else None
            events.append(TokenEvent(request_id, token, index, now_s, finish, cached))
        return events

    def _count_iteration(self, step: ScheduledStep) -> None:
        self.num_iterations += 1
        self.recent_iteration_s.append(step.duration_s)
        if step.batch.num_prefill_tokens > 0:
            self.prefill = self.prefill.add(step.duration_s, step.batch.num_prefill_tokens)

    # ---- runs of one decode batch --------------------------------------------
    def plan_run(self, step: ScheduledStep, max_repeats: int) -> DecodeRun | None:
        """The iterations after `step` (just begun) that `begin_step` would schedule
        if nothing reached the engine meanwhile: `step`'s batch again, one token
        further each, up to and including the first that finishes a request, none that
        might not find KV for every request (there the scheduler preempts), at most
        `max_repeats`. None unless `step` decodes every running request and no waiting
        one could join (none waits, or every sequence slot is taken).

        A simulator applies the run with `complete_repeats` and `begin_repeat` (and
        `complete_step` for its last iteration, which may finish a request), without
        scheduling each; anything that adds or removes a request in between voids the
        rest."""
        running = self.running
        if (max_repeats < 1 or step.batch.num_prefill_tokens > 0
                or len(step.req_to_num_tokens) != len(running)
                or (self.waiting and len(running) < self.config.max_num_seqs)):
            return None
        # the iteration in flight is repeat 0; a request with k tokens left ends in repeat k-1
        limit = min(max_repeats,
                    min(seq.max_output_tokens - seq.num_output_tokens for seq in running) - 1)
        if limit < 1:
            return None
        computed = np.array([seq.num_computed_tokens for seq in running], dtype=np.int64)
        held = np.array([self.req_to_blocks.get(seq.request_id, 0) for seq in running],
                        dtype=np.int64)
        blocks = _run_blocks(computed, held, self.config.block_size, limit,
                             self.num_free_blocks)
        count = len(blocks) - 1
        if count < 1:
            return None
        num_seqs = len(running)
        durations, ends = self.instance.decode_run_s(
            step.end_s, num_seqs, step.batch.decode_context_tokens + num_seqs, count)
        return DecodeRun(step, tuple(running), computed.tolist(),
                         [seq.num_output_tokens for seq in running], held.tolist(),
                         [step.duration_s, *durations.tolist()], [step.end_s, *ends.tolist()],
                         blocks.tolist(), self.num_free_blocks)

    def complete_repeats(self, run: DecodeRun, first: int, stop: int) -> int:
        """Apply iterations `first` to `stop` - 1 of `run` (iteration `first` in flight,
        none of them its last) to the engine's own figures, what a status reports: what
        `complete_step` does to iterations that finish no request and whose tokens
        nobody reads, the KV as iteration `stop` - 1 took it. The batch's sequences
        follow in `place_batch` (or `begin_repeat`), once for any number of iterations.
        Returns the tokens produced."""
        num = stop - first
        self.num_iterations += num
        self.recent_iteration_s.extend(run.durations_s[first:stop])
        self.num_free_blocks = run.num_free_blocks - run.new_blocks[stop - 1]
        self.prefix_cache.evict(self.num_free_blocks)
        return num * len(run.seqs)

    def begin_repeat(self, run: DecodeRun, index: int) -> None:
        """Begin iteration `index` of `run`, the ones before it completed: each
        request's KV grows as `_schedule_running` grows a decoding one (`plan_run`
        checked that it fits)."""
        self.place_batch(run, index, begun=True)

    def place_batch(self, run: DecodeRun, num_completed: int, *, begun: bool) -> None:
        """The batch's sequences (tokens and KV) as after `run`'s first `num_completed`
        iterations, and iteration `num_completed` too when `begun`."""
        block_size, req_to_blocks = self.config.block_size, self.req_to_blocks
        index = num_completed if begun else num_completed - 1  # the latest begun
        for seq, computed, generated, held in zip(run.seqs, run.computed, run.generated,
                                                  run.held, strict=True):
            seq.num_computed_tokens = computed + num_completed
            seq.num_output_tokens = generated + num_completed
            needed = -(-(computed + index + _DECODE_GROWTH) // block_size)
            req_to_blocks[seq.request_id] = needed if needed > held else held
        self.num_free_blocks = run.num_free_blocks - run.new_blocks[index]
        self.prefix_cache.evict(self.num_free_blocks)

    # ---- scheduling helpers ------------------------------------------------
    def _schedule(self, now_s: float) -> dict[str, int]:
        """Running requests first, then waiting ones (priority mode: none after a
        preemption, and an iteration left empty is passed over; module docstring).
        A pass repeats only when it preempted and scheduled nothing; each such pass
        takes a request off the running list, so they end."""
        skip_admission_after_preemption = (
            self.config.scheduling_policy is SchedulingPolicy.PRIORITY)
        while True:
            req_to_num_tokens: dict[str, int] = {}
            num_preemptions = self.num_preemptions
            budget = self._schedule_running(self.config.max_num_batched_tokens,
                                            req_to_num_tokens)
            preempted = self.num_preemptions > num_preemptions
            if not (preempted and skip_admission_after_preemption):
                self._admit_waiting(budget, req_to_num_tokens, now_s)
                return req_to_num_tokens
            if req_to_num_tokens:
                return req_to_num_tokens

    def _schedule_running(self, budget: int, req_to_num_tokens: dict[str, int]) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.is_prefilling:
                num_tokens = min(seq.prefill_target - seq.num_computed_tokens, budget)
                growth = num_tokens
            else:
                num_tokens, growth = 1, _DECODE_GROWTH
            if not self._grow(seq, growth):
                victim = self._preemption_victim()
                victim_index = self.running.index(victim)
                self._preempt(victim)
                budget += req_to_num_tokens.pop(victim.request_id, 0)
                if victim is seq:
                    break
                if victim_index < i:  # scheduled already: the pass goes on from seq
                    i -= 1
                continue
            req_to_num_tokens[seq.request_id] = num_tokens
            budget -= num_tokens
            i += 1
        return budget

    def _preemption_victim(self) -> SimSequence:
        """The running request preempted when one cannot grow (see the module docstring)."""
        if self.config.scheduling_policy is SchedulingPolicy.PRIORITY:
            return max(self.running, key=lambda seq: seq.preemption_key)
        return self.running[-1]

    def _admit_waiting(
        self, budget: int, req_to_num_tokens: dict[str, int], now_s: float
    ) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting.peek()
            self._apply_prefix_hit(seq)  # what is cached now (a preempted one's too)
            num_tokens = min(seq.prefill_target - seq.num_computed_tokens, budget)
            if num_tokens > 0 and not self._grow(seq, num_tokens):
                break
            self.waiting.pop_next()
            seq.status = RequestStatus.RUNNING
            self.running.append(seq)
            if seq.first_scheduled_s is None:
                seq.first_scheduled_s = now_s
                self.recent_queue_wait_s.append(now_s - seq.arrival_s)
                self.num_queue_wait_samples += 1
            if num_tokens == 0:  # KV already present (transfer or full prefix hit)
                num_tokens = 1 if self._grow(seq, 1) else 0
            if num_tokens:
                req_to_num_tokens[seq.request_id] = num_tokens
                budget -= num_tokens

    def _apply_prefix_hit(self, seq: SimSequence) -> None:
        """The prompt's leading entries found cached now (held once admitted, by
        `_grow`); as in vLLM, whole entries only and never the last prompt token, which
        is computed to sample the first output token."""
        if seq.skip_prefill:  # delivered KV; the last token samples the next
            seq.num_computed_tokens = seq.num_cached_tokens = seq.prefill_target - 1
            return
        hits = min(self.prefix_cache.peek(seq.block_hashes),
                   (seq.prefill_target - 1) // seq.hash_block_size)
        seq.num_cached_tokens = seq.num_computed_tokens = hits * seq.hash_block_size

    def _batch_shape(self, req_to_num_tokens: dict[str, int]) -> BatchShape:
        num_prefill = num_prefill_seqs = pairs = kv_read = num_decode = decode_ctx = 0
        for request_id, num_tokens in req_to_num_tokens.items():
            seq = self.requests[request_id]
            if seq.is_prefilling:
                ctx = seq.num_computed_tokens
                num_prefill += num_tokens
                num_prefill_seqs += 1
                pairs += chunk_attention_pairs(num_tokens, ctx)
                kv_read += ctx + num_tokens
            else:
                num_decode += 1
                decode_ctx += seq.context_len + 1
        return BatchShape(num_prefill, num_prefill_seqs, pairs, kv_read, num_decode, decode_ctx)

    # ---- KV block accounting -----------------------------------------------
    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.config.block_size)

    def _grow(self, seq: SimSequence, num_new_tokens: int) -> bool:
        """Reserve blocks so `seq` can hold `num_new_tokens` more; False if no room. Free
        cached blocks are evicted as the new blocks need them."""
        held = self.req_to_blocks.get(seq.request_id)
        if held is None:
            return self._first_blocks(seq, num_new_tokens)
        needed = -(-(seq.num_computed_tokens + num_new_tokens) // self.config.block_size) - held
        if needed <= 0:
            return True
        if needed > self.num_free_blocks and not self._yield_pins(lambda: needed):
            return False
        self.num_free_blocks -= needed
        self.req_to_blocks[seq.request_id] = held + needed
        cache = self.prefix_cache
        if cache.num_free_cached_blocks > self.num_free_blocks:
            cache.evict(self.num_free_blocks)
        return True

    def _first_blocks(self, seq: SimSequence, num_new_tokens: int) -> bool:
        """`seq`'s first reservation: it holds the cached entries its prefix hit found
        (those no running request holds come out of the free pool too) and new blocks
        for the rest."""
        cache = self.prefix_cache
        hits: Sequence[int] = ()
        if seq.num_cached_tokens and not seq.skip_prefill:
            hits = seq.block_hashes[:seq.num_cached_tokens // seq.hash_block_size]
        hit_blocks = len(hits) * cache.entry_blocks(seq.hash_block_size)
        needed = max(self._blocks_for(seq.num_computed_tokens + num_new_tokens) - hit_blocks, 0)

        def blocks_needed() -> int:
            return needed + cache.free_blocks_of(hits)

        if blocks_needed() > self.num_free_blocks and not self._yield_pins(blocks_needed):
            return False
        if hits:
            self.num_free_blocks -= cache.acquire(hits)
            self.req_to_cached[seq.request_id] = list(hits)
        self.num_free_blocks -= needed
        self.req_to_blocks[seq.request_id] = hit_blocks + needed
        if cache.num_free_cached_blocks > self.num_free_blocks:
            cache.evict(self.num_free_blocks)
        return True

    def _cache_prompt(self, seq: SimSequence) -> None:
        """The prompt's KV is computed: its entries not cached yet become cached, held
        by `seq` until it ends."""
        cached = self.req_to_cached.setdefault(seq.request_id, [])
        cached += self.prefix_cache.add_held(seq.block_hashes[len(cached):],
                                             seq.hash_block_size)

    def cache_context(self, block_hashes: Sequence[int], hash_block_size: int) -> None:
        """A context's KV arrived with no request (moved here): cached in the free
        pool, as far as it fits."""
        self.prefix_cache.add_free(block_hashes, hash_block_size)
        self.prefix_cache.evict(self.num_free_blocks)

    def pin(self, key: str, block_hashes: Sequence[int], until_s: float) -> int:
        """Hold the leading cached entries of `block_hashes` until `until_s` (or `unpin`):
        a session's context kept through its tool wait, which no eviction takes. Those
        no running request held come out of the free pool. Returns the entries held."""
        self.unpin(key)
        held = list(block_hashes[:self.prefix_cache.peek(block_hashes)])
        if held:
            self.num_free_blocks -= self.prefix_cache.acquire(held)
            self.pins[key] = (held, until_s)
            heapq.heappush(self._pin_ends, (until_s, key))
        return len(held)

    def unpin(self, key: str) -> None:
        """Stop holding `key`'s entries: still cached, in the free pool."""
        pinned = self.pins.pop(key, None)
        if pinned is not None:
            self.num_free_blocks += self.prefix_cache.release(pinned[0])

    def _yield_pins(self, blocks_needed: Callable[[], int]) -> bool:
        """Unpin contexts, the soonest to end first, until `blocks_needed()` blocks are
        free: a kept context never makes a request wait or a running one be preempted.
        Whether they are."""
        while self.pins and blocks_needed() > self.num_free_blocks:
            self.unpin(min(self.pins, key=lambda key: self.pins[key][1]))
        return blocks_needed() <= self.num_free_blocks

    def _release_pins(self, now_s: float) -> None:
        """Unpin what was held until `now_s` or before (a later pin of a key renews it)."""
        ends = self._pin_ends
        while ends and ends[0][0] <= now_s:
            until_s, key = heapq.heappop(ends)
            pinned = self.pins.get(key)
            if pinned is not None and pinned[1] == until_s:
                self.unpin(key)

    def _free(self, seq: SimSequence) -> None:
        """`seq` ends or is preempted: its own blocks return to the free pool, and its
        cached entries with it if no other running request holds them."""
        self.num_free_blocks += self.req_to_blocks.pop(seq.request_id, 0)
        cached = self.req_to_cached.pop(seq.request_id, None)
        if cached:
            shared = len(cached) * self.prefix_cache.entry_blocks(seq.hash_block_size)
            self.num_free_blocks += self.prefix_cache.release(cached) - shared
        assert self.num_free_blocks <= self.num_kv_blocks

    def _preempt(self, seq: SimSequence) -> None:
        """Recompute-style preemption: drop its KV, requeue (fcfs: at the front)."""
        self.running.remove(seq)
        self._free(seq)
        seq.status = RequestStatus.PREEMPTED
        seq.num_computed_tokens = 0
        seq.prefill_target = seq.num_prompt_tokens + seq.num_output_tokens
        seq.skip_prefill = False
        self.waiting.prepend(seq)
        self.num_preemptions += 1

    def _finish(self, seq: SimSequence) -> None:
        self.num_finished += 1
        self.running.remove(seq)
        self._free(seq)
        del self.requests[seq.request_id]

    # ---- black-box status --------------------------------------------------
    def status(
        self, engine_id: str, role: str, now_s: float, *, with_digest: bool = True
    ) -> EngineStatus:
        return EngineStatus(
            engine_id=engine_id,
            gpu_type=self.instance.name,
            role=role,
            num_waiting=len(self.waiting),
            num_running=len(self.running),
            recent_iteration_s=tuple(self.recent_iteration_s),
            recent_queue_wait_s=tuple(self.recent_queue_wait_s),
            num_kv_blocks_used=self.num_kv_blocks - self.num_free_blocks,
            num_kv_blocks_free=self.num_free_blocks,
            num_cached_prefix_blocks=len(self.prefix_cache),
            prefix_digest=self.prefix_cache.digest() if with_digest else _NO_DIGEST,
            time_s=now_s,
            num_iterations=self.num_iterations,
            num_queue_wait_samples=self.num_queue_wait_samples,
            num_finished=self.num_finished,
            prefill=self.prefill,
            kv_block_size=self.config.block_size,
        )
