"""How a moved request reaches its target: by token ids or with its KV.

By token ids the target recomputes the context it does not cache (prompt + tokens
generated so far): cheap for a short chat prompt, a full prefill for a 100k-token
agent context. With its KV the target loads what the source computed over the link
between engines and only samples the next token. Which is faster depends on the
context, the link (and what is already queued on it), the target's speed and what
the target already caches, so each move estimates both and takes the cheaper
(`MoveRule.CHEAPER`) when it saves at least one of the target's iterations: the
estimates are of a request alone, and the engine schedules by iterations, so a
smaller difference (every short context: its prefill is about one iteration, as is
the step after a load) is not one the move can count on. The KV path loads what the
system can still reach (`num_loadable_tokens` of the context: all of it from a live
source engine in the simulator; the prompt's blocks a connector stored, live) and
computes the rest; with nothing reachable the move goes by token ids.

Both estimates leave out the target's queue: either path joins it, so it does not
decide between them. What the target is running does decide: the context it recomputes
is prefilled in the same iterations as its running requests, so each of them waits for
that prefill beyond the iteration it would take anyway, while loaded KV costs them
nothing. So each path is charged its own time plus the stall it puts on the target's
running batch (request-seconds, as every request's deadline counts the same), and a
recompute that stalls a full batch loses to a slightly slower load.

Plain Python: the simulator and the live router call the same function, with the link
they model or expect.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from app.hardware.kv_link import KvLink
from app.hardware.specs import InstanceSpec


class MovePath(StrEnum):
    TOKEN_IDS = "token-ids"  # the target recomputes the uncached context
    KV = "kv"  # the target loads the context's KV over the link


class MoveRule(StrEnum):
    """Which path moves take (a cluster setting)."""

    CHEAPER = "cheaper"  # the one estimated faster, per move
    TOKEN_IDS = "token-ids"  # always recompute
    KV = "kv"  # always load the KV when it is reachable


@dataclass(frozen=True)
class MovePlan:
    """The path a move takes and the two estimates it was chosen on."""

    path: MovePath
    token_ids_s: float  # the target's prefill of the uncached context
    kv_s: float | None  # transfer behind the link's queue + the rest's prefill; None: no KV
    num_kv_bytes: float  # what the KV path moves (the loadable context the target lacks)
    token_ids_stall_s: float = 0.0  # what recomputing delays the target's running batch
    kv_stall_s: float = 0.0  # what computing the rest after a load delays it

    @property
    def estimate_s(self) -> float:
        """The chosen path's estimated time until the target samples the next token."""
        if self.path is MovePath.KV:
            assert self.kv_s is not None
            return self.kv_s
        return self.token_ids_s


def recompute_s(target: InstanceSpec, num_context_tokens: int, num_cached_tokens: int) -> float:
    """The target's prefill of the context beyond its cached prefix, alone."""
    ttft, _ = target.solo_phases_s(num_context_tokens, 1, num_cached_tokens=num_cached_tokens)
    return ttft


def batch_stall_s(prefill_s: float, step_s: float, num_running: int) -> float:
    """Request-seconds a prefill of `prefill_s` puts on a target running `num_running`
    requests: each waits for it beyond the iteration (`step_s`) it takes anyway."""
    return num_running * max(prefill_s - step_s, 0.0)


def plan_move(target: InstanceSpec, num_context_tokens: int, num_cached_tokens: int,
              link: KvLink | None, now: float, *, num_loadable_tokens: int,
              num_running_on_target: int = 0,
              rule: MoveRule = MoveRule.CHEAPER) -> MovePlan:
    """The path for moving a request whose context (prompt + generated) is
    `num_context_tokens`, of which the target caches the first `num_cached_tokens` and
    the first `num_loadable_tokens` can be loaded over `link` (None: no KV path); the
    target runs `num_running_on_target` requests, which a recompute stalls."""
    if not 0 <= num_cached_tokens <= num_context_tokens:
        raise ValueError(f"cached tokens {num_cached_tokens} outside the context "
                         f"[0, {num_context_tokens}]")
    if not 0 <= num_loadable_tokens <= num_context_tokens:
        raise ValueError(f"loadable tokens {num_loadable_tokens} outside the context "
                         f"[0, {num_context_tokens}]")
    if num_running_on_target < 0:
        raise ValueError(f"running requests {num_running_on_target} < 0")
    token_ids_s = recompute_s(target, num_context_tokens, num_cached_tokens)
    step_s = target.decode_time_per_token_s(num_context_tokens)
    token_ids_stall_s = batch_stall_s(token_ids_s, step_s, num_running_on_target)
    if (link is None or num_loadable_tokens <= num_cached_tokens
            or rule is MoveRule.TOKEN_IDS):
        return MovePlan(MovePath.TOKEN_IDS, token_ids_s, None, 0.0, token_ids_stall_s)
    loaded = num_loadable_tokens - num_cached_tokens
    num_bytes = loaded * target.model.kv_bytes_per_token
    rest_s = recompute_s(target, num_context_tokens, num_loadable_tokens)
    kv_s = link.expected_done_s(now, num_bytes) - now + rest_s
    kv_stall_s = batch_stall_s(rest_s, step_s, num_running_on_target)
    kv_wins = (rule is MoveRule.KV
               or kv_s + kv_stall_s + step_s < token_ids_s + token_ids_stall_s)
    return MovePlan(MovePath.KV if kv_wins else MovePath.TOKEN_IDS, token_ids_s, kv_s,
                    num_bytes if kv_wins else 0.0, token_ids_stall_s, kv_stall_s)
