"""A live flight's states: any sequence of events leaves it in a possible state, and a
router driven through random moves, engine failures and cancellations never loses a
request (each ends finished, cancelled or lost, and is counted once)."""

from __future__ import annotations

import asyncio
from contextlib import aclosing

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.engines.messages import KV_PREFIX_PARAM, SamplingSpec
from app.routing.move_path import MovePath
from app.routing.view import RouteRequest
from app.serving.flight import (
    LIVE,
    TERMINAL,
    Flight,
    FlightState,
    GenerationRequest,
    InvalidTransition,
    MoveRecord,
)
from app.serving.live_router import EngineLost
from app.serving.telemetry import MigrationReason
from tests.unit.test_live_router import PROMPT, ScriptedEngine, request, started, token_of

pytestmark = pytest.mark.unit

EVENTS = ("token", "finish", "end_prefill", "hand_off", "decode_without_kv", "ask_move",
          "move", "fail_over", "lose", "cancel")


def new_flight(disaggregated: bool) -> Flight:
    sampling = SamplingSpec(max_tokens=8)
    req = GenerationRequest("r", (1, 2, 3), sampling, 0.0)
    route = RouteRequest(request_id="r", arrival_s=0.0, deadline_s=10.0, num_prompt_tokens=3)
    return Flight.routed(req, route, "d0", "p0" if disaggregated else None, disaggregated)


def apply(flight: Flight, event: str, step: int) -> None:
    target = f"d{step + 1}"
    match event:
        case "token":
            flight.took_tokens(float(step))
            flight.output.token_ids.append(step)
        case "finish":
            flight.finish("length", float(step))
        case "end_prefill":
            flight.end_prefill(float(step))
        case "hand_off":
            flight.hand_off({"step": step}, 0.01)
        case "decode_without_kv":
            flight.decode_without_kv()
        case "ask_move":
            flight.ask_move(target, MigrationReason.SLO_RISK)
        case "move":
            flight.move(move_record(flight.placement.move_to or target, step))
        case "fail_over":
            flight.fail_over(move_record(target, step))
        case "lose":
            flight.lose()
        case "cancel":
            flight.cancel()


def move_record(target: str, step: int) -> MoveRecord:
    """Odd steps move with the stored prompt KV (2 tokens of it), even ones by token ids."""
    kv = step % 2 == 1
    return MoveRecord(target, MigrationReason.SLO_RISK,
                      MovePath.KV if kv else MovePath.TOKEN_IDS, 0.1, 64.0 if kv else 0.0,
                      load_tokens=2 if kv else 0)


def snapshot(flight: Flight) -> tuple:
    p = flight.placement
    return (flight.state, tuple(p.instance_ids), p.attempt, p.move_to, p.num_migrations,
            p.num_failovers, len(flight.output.token_ids), flight.output.finish_reason)


def assert_possible(flight: Flight, disaggregated: bool) -> None:
    """What every state promises about the records."""
    p, kv, output = flight.placement, flight.kv, flight.output
    assert flight.state in FlightState
    assert p.attempt == p.num_migrations + p.num_failovers == len(p.instance_ids) - 1
    assert len(p.moves) == p.attempt and [m.target for m in p.moves] == p.instance_ids[1:]
    loading = flight.loading_move
    assert loading is None or (flight.state is FlightState.QUEUED and loading is p.moves[-1])
    if (flight.state not in TERMINAL and flight.state is not FlightState.PREFILLING
            and len(output.token_ids) < flight.request.sampling.max_tokens):
        params = flight.engine_request().kv_transfer_params or {}
        assert (KV_PREFIX_PARAM in params) == (loading is not None and loading.load_tokens > 0)
    assert (p.move_to is not None) == (flight.state is FlightState.MOVING)
    assert (kv is not None) == disaggregated
    if flight.state in (FlightState.PREFILLING, FlightState.HANDING_OFF):
        assert disaggregated and p.attempt == 0 and p.prefill_instance_id == "p0"
    if flight.state is FlightState.PREFILLING:
        assert flight.instance_id == "p0" and flight.engine_request_id == "r:prefill"
    else:
        assert flight.instance_id == p.instance_ids[-1]
    if flight.state is FlightState.HANDING_OFF:
        assert kv is not None and kv.prefill_end_s is not None
    if kv is not None and kv.delivered:
        assert p.attempt == 0 and flight.state not in (FlightState.PREFILLING,
                                                        FlightState.HANDING_OFF)
    assert (output.finish_reason is not None) == (flight.state is FlightState.FINISHED)
    assert (output.first_token_s is not None) == bool(output.token_ids)
    assert flight.is_running == (flight.state in (FlightState.RUNNING, FlightState.MOVING) or (
        flight.state is FlightState.PREFILLING and bool(output.token_ids)))


@settings(max_examples=400, deadline=None)
@given(disaggregated=st.booleans(), events=st.lists(st.sampled_from(EVENTS), max_size=30))
def test_any_event_sequence_leaves_the_flight_in_a_possible_state(disaggregated, events):
    flight = new_flight(disaggregated)
    assert_possible(flight, disaggregated)
    for step, event in enumerate(events):
        before, was_terminal = snapshot(flight), flight.state in TERMINAL
        try:
            apply(flight, event, step)
        except InvalidTransition:
            assert snapshot(flight) == before  # a refused event changes nothing
        else:
            assert not was_terminal  # nothing leaves an end state
        assert_possible(flight, disaggregated)


def test_each_live_state_can_end_and_the_end_states_refuse_everything():
    for state in LIVE:
        for end in ("lose", "cancel"):
            flight = new_flight(True)
            flight.state = state
            if state is FlightState.MOVING:
                flight.placement.move_to = "d9"
            apply(flight, end, 0)
            assert flight.state in TERMINAL
            for event in EVENTS:
                with pytest.raises(InvalidTransition):
                    apply(flight, event, 1)


class Action:
    MIGRATE, CANCEL, NOTHING = "migrate", "cancel", "nothing"


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(fail_at=st.lists(st.one_of(st.none(), st.integers(0, 12)), min_size=3, max_size=3),
       actions=st.lists(st.tuples(st.sampled_from([Action.MIGRATE, Action.CANCEL,
                                                   Action.NOTHING]), st.integers(0, 10)),
                        min_size=4, max_size=4))
def test_a_router_under_random_moves_failures_and_cancels_loses_no_request(fail_at, actions):
    """Each of four requests meets an event at some token: a migration, a cancel, or its
    engine failing (engines die at random indices). Every stream ends one of three ways
    (all its tokens in order, cancelled by its client, or EngineLost), nothing stays in
    flight, and the router counts each once."""
    asyncio.run(_drive(fail_at, actions))


async def _drive(fail_at: list[int | None], actions: list[tuple[str, int]]) -> None:
    engines = [ScriptedEngine(f"e{i}", gpu, step_s=0.001, fail_at=f)
               for i, (gpu, f) in enumerate(zip(("H800", "A800", "A40"), fail_at, strict=True))]
    router = await started(*engines, policy="round-robin")
    outcomes: dict[str, str] = {}

    async def run(index: int, action: str, at: int) -> None:
        flight = await router.submit(request(f"r{index}", max_tokens=12))
        tokens: list[int] = []
        try:
            async with aclosing(router.stream(flight)) as stream:
                async for batch in stream:
                    tokens.extend(ev.token_id for ev in batch)
                    if len(tokens) == at + 1 and action == Action.MIGRATE:
                        try:
                            router.migrate(flight.request_id)
                        except ValueError:
                            pass  # nowhere to go: it finishes where it is
                    if len(tokens) == at + 1 and action == Action.CANCEL:
                        break
        except EngineLost:
            assert flight.state is FlightState.LOST
            outcomes[flight.request_id] = "lost"
            return
        if flight.state is FlightState.FINISHED:
            assert tokens == [token_of(PROMPT, i) for i in range(12)]  # nothing lost or doubled
        else:
            assert flight.state is FlightState.CANCELLED and action == Action.CANCEL
        outcomes[flight.request_id] = flight.state.value

    tasks = [run(i, action, at) for i, (action, at) in enumerate(actions)]
    await asyncio.wait_for(asyncio.gather(*tasks), timeout=30)
    router.close()
    counters = router.counters()
    assert router.flights == {} and counters.num_in_flight == 0
    assert len(outcomes) == counters.num_routed == len(actions)
    finished = sum(o == "finished" for o in outcomes.values())
    assert counters.num_finished == finished
    assert counters.num_dropped == len(actions) - finished
