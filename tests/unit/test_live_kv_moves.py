"""Live moves between unified engines choose their path: with the prompt's KV the first
engine's connector stored (the target is asked to load that prefix), or by token ids
when there is no store, it is too old, or the rule says so; the reply and the metrics
say which path each move took."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import pytest

from app.engines.config import KvConnectorConfig, KvConnectorKind
from app.engines.messages import KV_PREFIX_PARAM, EngineRequest, StoredPromptKv, TokenEvent
from app.routing.move_path import MovePath, MoveRule
from app.routing.registry import build_routing
from app.serving.kv_transfer import ConnectorTransport
from app.serving.live_router import LiveRouter
from app.serving.telemetry import MigrationReason, RouterMetrics
from tests.unit.metrics_utils import RecordingFactory
from tests.unit.test_live_router import PROMPT, ScriptedEngine, request, token_of

pytestmark = pytest.mark.unit

STORED = 48  # whole blocks of PROMPT (64 tokens) the connector keeps


class StoringEngine(ScriptedEngine):
    """A unified engine whose connector stores each prompt it computes: its first token
    says where; a submission naming a stored prefix loads it (reports it as cached).
    `loads`: what its connector loads instead, asked or not (vLLM's stock lookup finds
    a stored prompt the moved context repeats; a store swept away gives nothing)."""

    loads: int | None = None

    async def generate(self, request: EngineRequest) -> AsyncIterator[list[TokenEvent]]:
        prefix = (request.kv_transfer_params or {}).get(KV_PREFIX_PARAM)
        found = (prefix or 0) if self.loads is None else self.loads
        first = True
        async for batch in super().generate(request):
            if first:
                stored = None if prefix else StoredPromptKv(f"/kv/{self.engine_id}", STORED)
                batch = [TokenEvent(**{**vars(batch[0]), "num_cached_tokens": found,
                                       "kv_transfer_params": stored and stored.as_params()})]
                first = False
            yield batch


class Clock:
    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


async def moved_once(rule: MoveRule = MoveRule.KV, *, connector: bool = True,
                     fail_at: int | None = None, age_s: float = 0.0,
                     target_loads: int | None = None):
    """One request on engine a, moved to b after 5 tokens (or failing over at
    `fail_at`); b's connector loads `target_loads` tokens, if given, rather than what
    it is asked to; returns the flight, both engines and the metrics."""
    a = StoringEngine("a", "A40", fail_at=fail_at)
    b = StoringEngine("b", "H800")
    b.loads = target_loads
    factory, clock = RecordingFactory(), Clock()
    transport = ConnectorTransport(
        KvConnectorConfig(kind=KvConnectorKind.EXAMPLE, shared_storage_path="/kv",
                          kv_ttl_s=120.0), 25.0, clock=clock) if connector else None
    router = LiveRouter([a, b], build_routing("round-robin"), poll_interval_s=3600,
                        kv_transport=transport, move_rule=rule, clock=clock,
                        metrics=RouterMetrics(factory))
    await router.start()
    flight = await router.submit(request(max_tokens=20))
    assert flight.instance_id == "a"
    events = []
    async for batch in router.stream(flight):
        events.extend(batch)
        if len(events) == 5 and fail_at is None:
            clock.now += age_s
            assert router.migrate("r1", "b") == "b"
    router.close()
    assert [e.token_id for e in events] == [token_of(PROMPT, i) for i in range(20)]
    return flight, a, b, factory


async def test_a_move_loads_the_stored_prompt_and_computes_the_rest():
    flight, a, b, factory = await moved_once()
    moved = b.received[-1]
    assert moved.kv_transfer_params == {KV_PREFIX_PARAM: STORED}
    assert len(moved.resume_token_ids) >= 5  # the generated tokens are computed there
    (move,) = flight.placement.moves
    kv_per_token = b.config.instance.model.kv_bytes_per_token
    assert (move.path, move.target, move.reason) == (MovePath.KV, "b", MigrationReason.OPERATOR)
    assert move.kv_bytes == STORED * kv_per_token and move.loaded_tokens == STORED
    assert move.time_s is not None and move.time_s >= 0
    assert factory["goodserve_migrations"].get(reason="operator", path="kv") == [1.0]
    assert factory["goodserve_move_kv_bytes"].get(path="kv") == [STORED * kv_per_token]
    assert move.as_dict()["path"] == "kv"


async def test_a_fail_over_loads_the_store_its_dead_engine_left():
    flight, a, b, _ = await moved_once(fail_at=7)
    (move,) = flight.placement.moves
    assert (move.path, move.reason) == (MovePath.KV, MigrationReason.FAILURE)
    assert b.received[-1].kv_transfer_params == {KV_PREFIX_PARAM: STORED}


@pytest.mark.parametrize("why", ["token-ids rule", "no connector", "store near its TTL"])
async def test_without_a_usable_store_or_by_rule_the_move_recomputes(why):
    flight, a, b, factory = await moved_once(
        MoveRule.TOKEN_IDS if why == "token-ids rule" else MoveRule.KV,
        connector=why != "no connector", age_s=61.0 if why == "store near its TTL" else 0.0)
    (move,) = flight.placement.moves
    assert move.path is MovePath.TOKEN_IDS and move.kv_bytes == 0
    assert b.received[-1].kv_transfer_params is None
    assert factory["goodserve_migrations"].get(reason="operator", path="token-ids") == [1.0]


async def test_a_move_planned_by_token_ids_whose_target_loads_the_store_records_the_kv_path():
    """The record names the path taken: the target's first token found the stored
    prompt (its connector loaded it unasked), so the move went with its KV."""
    flight, a, b, factory = await moved_once(MoveRule.TOKEN_IDS, target_loads=STORED)
    assert b.received[-1].kv_transfer_params is None  # not asked to load
    (move,) = flight.placement.moves
    kv_per_token = b.config.instance.model.kv_bytes_per_token
    assert (move.planned_path, move.path) == (MovePath.TOKEN_IDS, MovePath.KV)
    assert move.kv_bytes == STORED * kv_per_token and move.loaded_tokens == STORED
    assert move.as_dict()["path"] == "kv" and move.as_dict()["planned_path"] == "token-ids"
    assert factory["goodserve_move_kv_bytes"].get(path="kv") == [STORED * kv_per_token]
    assert factory["goodserve_move_kv_bytes"].get(path="token-ids") == []


async def test_a_move_planned_with_kv_whose_target_finds_nothing_records_token_ids():
    """The store was gone when the target looked: it computed the context."""
    flight, a, b, factory = await moved_once(MoveRule.KV, target_loads=0)
    assert b.received[-1].kv_transfer_params == {KV_PREFIX_PARAM: STORED}
    (move,) = flight.placement.moves
    assert (move.planned_path, move.path) == (MovePath.KV, MovePath.TOKEN_IDS)
    assert move.kv_bytes == 0 and move.loaded_tokens == 0
    assert factory["goodserve_move_kv_bytes"].get(path="token-ids") == [0.0]


async def test_without_a_connector_what_the_target_found_is_its_own_cache():
    """No connector, nothing to load from: cached tokens are the target's prefix cache,
    and the move went by token ids."""
    flight, a, b, _ = await moved_once(MoveRule.KV, connector=False, target_loads=STORED)
    (move,) = flight.placement.moves
    assert move.path is MovePath.TOKEN_IDS and move.kv_bytes == 0
    assert move.loaded_tokens == STORED
