"""Live router core and OpenAI service without Ray: engines behind a scripted transport.

`ScriptedEngine` fakes only the transport (like Ray Serve's FakeRunningReplica):
token i of a prompt is a fixed function of (prompt, i), as with greedy decoding,
so a stream resumed elsewhere by token ids must continue with the same tokens.
Real engines behind the same router are covered by the integration (sim engine
actors) and e2e (vLLM) tests.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import replace

import pytest

from app.engines.config import (
    ClusterConfig,
    EngineConfig,
    EngineRole,
    InstanceGroup,
    KvConnectorConfig,
    KvConnectorKind,
    SchedulerConfig,
)
from app.engines.messages import EngineRequest, EngineStatus, SamplingSpec, TokenEvent
from app.routing.base import ActiveRequest, RouteDecision, RoutingPolicy, Watchdog
from app.routing.budgets import budgets_of
from app.routing.instance_view import InstanceId
from app.routing.priority import PriorityRule
from app.routing.registry import PolicyKind, RoutingStack, build_routing
from app.routing.view import ClusterView, RouteRequest
from app.serving.config import ServeConfig
from app.serving.flight import FlightState, GenerationRequest
from app.serving.instances import EngineClient
from app.serving.kv_transfer import ConnectorTransport, KvHandoff, KvTransport, SimulatedLink
from app.serving.live_router import EngineLost, LiveRouter, RequestRejected
from app.serving.reply_writing import sse_data
from app.serving.service import CompletionService, JsonReply
from app.serving.status_board import StatusBoard
from app.serving.telemetry import RouterMetrics
from app.serving.tokenizer import OutputText, Tokenizer, WordHashTokenizer
from tests.unit.metrics_utils import RecordingFactory

pytestmark = pytest.mark.unit

PROMPT = tuple(range(100, 164))


def token_of(prompt: Sequence[int], index: int) -> int:
    return (sum(prompt) * 31 + index * 7) % 50_000 + 2


class ScriptedEngine(EngineClient):
    """One token per `step_s`; `fail_at` raises at that output index; abort ends the stream."""

    def __init__(self, engine_id: str, gpu_type: str, step_s: float = 0.002,
                 fail_at: int | None = None, role: EngineRole = EngineRole.UNIFIED) -> None:
        super().__init__(engine_id, EngineConfig(gpu_type=gpu_type, role=role))
        self.step_s = step_s
        self.fail_at = fail_at
        self.received: list[EngineRequest] = []
        self.kv_params: dict | None = None  # sent with the last token (a prefill's hand-off)
        self.aborted: list[str] = []
        self.num_iterations = 0
        self.active: set[str] = set()  # requests generating now (reported as running)
        self._stop: dict[str, asyncio.Event] = {}

    async def generate(self, request: EngineRequest) -> AsyncIterator[list[TokenEvent]]:
        self.received.append(request)
        stop = self._stop.setdefault(request.request_id, asyncio.Event())
        prompt, max_tokens = request.prompt_token_ids, request.sampling.max_tokens
        self.active.add(request.request_id)
        try:
            for i in range(len(request.resume_token_ids), max_tokens):
                await asyncio.sleep(self.step_s)
                if stop.is_set():
                    return
                if self.fail_at is not None and i >= self.fail_at:
                    raise RuntimeError("engine process died")
                self.num_iterations += 1
                reason = "length" if i == max_tokens - 1 else None
                first = i == len(request.resume_token_ids)  # KV handed over: found, not computed
                cached = (len(prompt) if request.kv_transferred else 0) if first else None
                params = self.kv_params if reason and self.kv_params else None
                yield [TokenEvent(request.request_id, token_of(prompt, i), i, time.time(),
                                  reason, num_cached_tokens=cached, kv_transfer_params=params)]
        finally:
            self.active.discard(request.request_id)

    async def abort(self, request_id: str) -> bool:
        self.aborted.append(request_id)
        self._stop.setdefault(request_id, asyncio.Event()).set()
        return True

    async def status(self) -> EngineStatus:
        return EngineStatus(self.engine_id, self.config.gpu_type, "unified", 0, len(self.active),
                            (), (), 0, 100_000, 0, time_s=time.time(),
                            num_iterations=self.num_iterations)


def request(rid: str = "r1", max_tokens: int = 20, slo_s: float | None = None) -> GenerationRequest:
    return GenerationRequest(rid, PROMPT, SamplingSpec(max_tokens=max_tokens), time.time(), slo_s)


def assert_load_matches_flights(router: LiveRouter) -> None:
    """The load the router routes on (kept as flights change) equals a recount."""
    for inst in router.view(time.time()).instances:
        mine = [f for f in router.flights.values() if f.instance_id == inst.instance_id]
        running = sum(f.is_running for f in mine)
        assert (inst.num_running, inst.num_waiting) == (running, len(mine) - running)
        on = router.tracker.load.flights_on(inst.instance_id)  # what the watchdog checks there
        assert sorted(f.request_id for f in on) == sorted(f.request_id for f in mine)


async def drain(router: LiveRouter, flight) -> list[TokenEvent]:
    return [ev async for batch in router.stream(flight) for ev in batch]


async def started(*engines: EngineClient, policy: str = "goodserve",
                  stack: RoutingStack | None = None,
                  kv_transport: KvTransport | None = None,
                  metrics: RouterMetrics | None = None) -> LiveRouter:
    live = LiveRouter(engines, stack or build_routing(policy), poll_interval_s=3600,
                      kv_transport=kv_transport, metrics=metrics)
    await live.start()
    return live


class LargeBlockEngine(ScriptedEngine):
    """Reports KV in 128-token blocks, as vLLM does on CPUs."""

    async def status(self) -> EngineStatus:
        return replace(await super().status(), num_kv_blocks_free=500, kv_block_size=128)


async def test_the_router_counts_kv_room_in_the_blocks_each_engine_reports():
    """An engine's KV room is its free blocks times *its* block size, not the config's
    (16): a vLLM CPU engine's 128-token blocks would otherwise count 8x too little."""
    router = await started(LargeBlockEngine("a", "A40"), ScriptedEngine("b", "H800"))
    views = {v.instance_id: v for v in router.view(time.time()).instances}
    assert views["a"].kv_free_tokens == 500 * 128 and views["a"].kv_block_size == 128
    assert views["b"].kv_free_tokens == 100_000 * 16
    router.close()


async def test_a_request_id_in_flight_is_refused_before_anything_is_decided():
    """A second request of an id that arrived while the first one's length was predicted:
    refused before the policy decides (no budget, no load report, nothing counted)."""
    router = await started(ScriptedEngine("a", "A40"), ScriptedEngine("b", "H800"))
    first, second = request(slo_s=30.0), request(slo_s=30.0)
    routes = [await router.routed(first), await router.routed(second)]
    flight = router.place(first, routes[0])
    budgets = budgets_of(router.policy)
    assert len(budgets) == 1  # the first is protected where it runs
    with pytest.raises(ValueError, match="duplicate request id r1"):
        router.place(second, routes[1])
    assert router.counters().num_routed == 1 and router.counters().num_rejected == 0
    assert router.take_load_report().arrivals == 1 and len(budgets) == 1
    await drain(router, flight)
    router.close()


class AbortedAtTheEnd(ScriptedEngine):
    """Its last token arrives marked aborted: an abort (a move asked, a client gone, a
    replica lost) that landed on the engine's last token."""

    async def generate(self, request: EngineRequest) -> AsyncIterator[list[TokenEvent]]:
        async for (event,) in super().generate(request):
            yield [replace(event, finish_reason="abort") if event.finished else event]


async def test_an_output_that_holds_max_tokens_ends_with_length_whatever_its_last_event():
    """Nothing is left to run elsewhere: no resubmission of zero tokens (which an engine
    refuses), no fail-over."""
    router = await started(AbortedAtTheEnd("a", "A40"), policy="round-robin")
    flight = await router.submit(request(max_tokens=8))
    events = await drain(router, flight)
    assert [e.index for e in events] == list(range(8)) and events[-1].finish_reason == "length"
    assert flight.state is FlightState.FINISHED and flight.output.finish_reason == "length"
    assert router.counters().num_failovers == 0 and router.counters().num_finished == 1
    router.close()


async def test_migration_continues_the_stream_by_token_ids():
    a, b = ScriptedEngine("a", "A40"), ScriptedEngine("b", "H800")
    router = await started(a, b, policy="round-robin")
    flight = await router.submit(request(max_tokens=30))
    source = a if flight.instance_id == "a" else b
    target = b if source is a else a
    events = []
    async for batch in router.stream(flight):
        events.extend(batch)
        assert_load_matches_flights(router)
        if len(events) == 10:
            assert router.migrate("r1") == target.engine_id  # the policy picks the other
    assert [e.index for e in events] == list(range(30))
    assert [e.token_id for e in events] == [token_of(PROMPT, i) for i in range(30)]
    moved = target.received[-1]
    assert len(moved.resume_token_ids) >= 10 and moved.request_id != "r1"
    assert list(moved.resume_token_ids) == [token_of(PROMPT, i)
                                            for i in range(len(moved.resume_token_ids))]
    assert source.aborted == ["r1"]
    assert flight.placement.instance_ids == [source.engine_id, target.engine_id]
    assert router.counters().num_migrations == 1 and not router.flights
    assert_load_matches_flights(router)


async def test_a_replica_counts_the_requests_other_replicas_run_on_an_engine():
    """Two router replicas share engines: one fills `a`, the other must route around it."""
    a, b = ScriptedEngine("a", "H800", step_s=0.05), ScriptedEngine("b", "H800", step_s=0.05)
    filler = await started(a, policy="least-request")
    other = await started(a, b, policy="least-request")
    flights = [await filler.submit(request(f"f{i}", max_tokens=400)) for i in range(3)]
    streams = [asyncio.create_task(drain(filler, f)) for f in flights]
    await asyncio.sleep(0.02)  # the three are generating on `a`
    await asyncio.gather(other.poll_once(), filler.poll_once())
    assert other.view(time.time()).get("a").num_outstanding == 3
    assert filler.view(time.time()).get("a").num_outstanding == 3  # its own, not twice
    placed = [(await other.submit(request(f"o{i}"))).instance_id for i in range(2)]
    assert placed == ["b", "b"]  # 3 (other replica's) vs 0, then 3 vs 1
    for task in streams:
        task.cancel()
    filler.close()
    other.close()


async def test_engine_failure_continues_on_another_instance():
    broken, healthy = ScriptedEngine("broken", "H800", fail_at=5), ScriptedEngine("ok", "A40")
    router = await started(broken, healthy)
    router.instances["ok"].healthy = False  # no deadline goes to the weakest: steer it
    flight = await router.submit(request(max_tokens=20))
    router.instances["ok"].healthy = True
    assert flight.instance_id == "broken"
    events = []
    async for batch in router.stream(flight):
        events.extend(batch)
        assert_load_matches_flights(router)
    assert [e.token_id for e in events] == [token_of(PROMPT, i) for i in range(20)]
    assert flight.placement.instance_ids == ["broken", "ok"] and flight.placement.num_failovers == 1
    assert list(healthy.received[0].resume_token_ids) == [token_of(PROMPT, i) for i in range(5)]
    assert not router.instances["broken"].healthy  # out of rotation until it answers a poll
    assert "broken" not in router.view(time.time()).by_id
    router.instances["broken"].healthy = True
    assert_load_matches_flights(router)


class FirstListed(RoutingPolicy):
    """Picks the first instance of the view; keeps the first tokens it hears."""

    def __init__(self) -> None:
        self.heard: list[tuple[str, InstanceId, float, float]] = []

    def choose(self, request: RouteRequest, view: ClusterView, now: float) -> RouteDecision:
        return view.instances[0].instance_id

    def on_first_token(self, request: RouteRequest, instance_id: InstanceId,
                       first_token_s: float, now: float) -> None:
        self.heard.append((request.request_id, instance_id, first_token_s, now))


async def test_the_policy_hears_a_first_token_once_from_the_engine_that_produced_it():
    """A fail-over after the first token brings no other; in P/D it is the prefill
    engine's."""
    policy = FirstListed()
    broken, healthy = ScriptedEngine("broken", "H800", fail_at=5), ScriptedEngine("ok", "A40")
    router = await started(broken, healthy, stack=RoutingStack(policy))
    flight = await router.submit(request(max_tokens=20))
    assert len(await drain(router, flight)) == 20
    assert flight.placement.instance_ids == ["broken", "ok"]
    first_s = flight.output.first_token_s
    assert policy.heard == [("r1", "broken", first_s, first_s)]
    assert flight.request.arrival_s < first_s

    policy = FirstListed()
    router = await started(*pd_engines(), stack=RoutingStack(policy),
                           kv_transport=SimulatedLink(10.0))
    flight = await router.submit(request("pd", max_tokens=8))
    assert len(await drain(router, flight)) == 8
    first_s = flight.output.first_token_s
    assert policy.heard == [("pd", "p", first_s, first_s)]


async def test_engine_lost_when_no_instance_can_take_over():
    router = await started(ScriptedEngine("only", "A40", fail_at=3))
    flight = await router.submit(request(slo_s=60.0))
    with pytest.raises(EngineLost, match="no other can continue it"):
        await drain(router, flight)
    assert not router.flights and len(router.policy.budgets) == 0
    assert router.counters().num_dropped == 1


async def test_client_disconnect_aborts_the_engine_and_forgets_the_request():
    engine = ScriptedEngine("e", "A40")
    router = await started(engine)
    flight = await router.submit(request(max_tokens=200, slo_s=60.0))
    assert len(router.policy.budgets) == 1  # admitted with a budget
    stream = router.stream(flight)
    await anext(stream)
    assert_load_matches_flights(router)
    await stream.aclose()  # the HTTP client went away
    await asyncio.sleep(0.01)
    assert_load_matches_flights(router)
    assert engine.aborted == ["r1"]
    assert not router.flights and len(router.policy.budgets) == 0
    assert router.counters().num_dropped == 1


async def test_admission_control_rejects_with_the_reason():
    router = await started(ScriptedEngine("e", "A40"), policy="goodserve-admission")
    with pytest.raises(RequestRejected, match="no instance can meet the deadline"):
        await router.submit(request(max_tokens=500, slo_s=0.001))
    assert not router.flights and router.counters().num_rejected == 1


async def test_unhealthy_cluster_rejects_instead_of_hanging():
    engine = ScriptedEngine("e", "A40")
    router = await started(engine)
    router.instances["e"].healthy = False
    with pytest.raises(RequestRejected, match="no healthy engine"):
        await router.submit(request())


async def test_view_counts_requests_the_router_sent_but_the_engine_has_not_reported():
    router = await started(ScriptedEngine("e", "A40"))
    await router.submit(request("r1"))
    await router.submit(request("r2"))
    view = router.view(time.time()).get("e")
    assert (view.num_waiting, view.num_running) == (2, 0)


async def test_deadline_priorities_reach_the_engines_and_a_moved_request_keeps_its_own():
    """Engines in priority mode: each request goes out with its deadline in ms, the view
    lists the router's waiting requests' priorities, and a move resubmits with the
    same priority."""
    a, b = ScriptedEngine("a", "A40"), ScriptedEngine("b", "H800")
    for engine in (a, b):
        engine.config = engine.config.model_copy(
            update={"scheduler": SchedulerConfig(scheduling_policy="priority")})
    router = LiveRouter([a, b], build_routing("round-robin"), poll_interval_s=3600,
                        request_priority=PriorityRule.DEADLINE)
    await router.start()
    late, soon = request("late", 30, slo_s=60.0), request("soon", 30, slo_s=20.0)
    flights = [await router.submit(r) for r in (late, soon)]
    priorities = {r.request_id: math.floor((r.arrival_s + r.slo_s) * 1000) for r in (late, soon)}
    assert {f.request_id: f.route.priority for f in flights} == priorities
    view = router.view(time.time())
    assert {v.waiting_priorities for v in view.instances} == {
        (priorities["late"],), (priorities["soon"],)}
    flight = flights[0]
    source = a if flight.instance_id == "a" else b
    target = b if source is a else a
    events = []
    async for batch in router.stream(flight):
        events.extend(batch)
        if len(events) == 5:
            assert router.migrate("late") == target.engine_id
    assert [r.priority for r in source.received if r.request_id == "late"] == [priorities["late"]]
    assert target.received[-1].request_id == "late@1"
    assert target.received[-1].priority == priorities["late"]
    await drain(router, flights[1])
    router.close()


async def test_max_tokens_caps_the_length_estimate():
    """History says 256 tokens before anything finished; max_tokens=4 must win, so a
    deadline a 256-token estimate could not meet on any instance is still admitted."""
    router = await started(ScriptedEngine("e", "A40"), policy="goodserve-admission")
    flight = await router.submit(request(max_tokens=4, slo_s=1.0))
    assert flight.instance_id == "e"


class RecordingWatchdog(Watchdog):
    """Moves every active request of the checked instance to `target`."""

    def __init__(self, tau_iterations: int, target: InstanceId) -> None:
        super().__init__(tau_iterations)
        self.target = target
        self.checks: list[tuple[InstanceId, int]] = []

    def check(self, instance_id: InstanceId, active: Sequence[ActiveRequest],
              view: ClusterView, now: float) -> Mapping[str, InstanceId]:
        self.checks.append((instance_id, len(active)))
        return {a.request.request_id: self.target for a in active if instance_id != self.target}


async def test_watchdog_runs_once_per_tau_iterations_and_its_moves_are_carried_out():
    slow, fast = ScriptedEngine("slow", "A40"), ScriptedEngine("fast", "H800")
    watchdog = RecordingWatchdog(tau_iterations=5, target="fast")
    stack = RoutingStack(build_routing("round-robin").policy, watchdog)
    factory = RecordingFactory()
    router = await started(slow, fast, stack=stack, metrics=RouterMetrics(factory))
    flight = await router.submit(request(max_tokens=40))
    flight.placement.instance_ids[0] = "slow"
    events = []
    async for batch in router.stream(flight):
        events.extend(batch)
        if len(events) in (4, 6, 7):  # slow has done 4, 6, 7 iterations: one epoch crossed
            await router.poll_once()
    assert watchdog.checks.count(("slow", 1)) == 1
    assert flight.placement.instance_ids == ["slow", "fast"]
    assert factory["goodserve_migrations"].get(reason="slo_risk", path="token-ids") == [1.0]
    assert [e.token_id for e in events] == [token_of(PROMPT, i) for i in range(40)]


class Utf8Bytes(Tokenizer):
    """One token per UTF-8 byte: characters span tokens, as with byte-level BPE."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return bytes(token_ids).decode(errors="replace")


def test_output_text_holds_back_an_incomplete_character():
    output = OutputText(Utf8Bytes())
    euro = list("€".encode())
    assert output.observe([ord("a"), euro[0]]) is None
    assert output.delta() == "a"
    output.observe(euro[1:])
    assert output.delta() == "€"
    assert output.text == "a€"
    output.observe([ord("b"), euro[0]])  # the output ends inside a character
    assert output.text == "a€b"  # as vLLM's detokenizer, which never shows it
    assert output.delta(final=True) == "b"


def sim_service(*engines: ScriptedEngine, **config) -> CompletionService:
    cluster = ClusterConfig(groups=[InstanceGroup(engine=EngineConfig(gpu_type="A40"))])
    return CompletionService(ServeConfig(cluster=cluster, **config), list(engines))


def body(**fields) -> bytes:
    return json.dumps({"model": "goodserve", "prompt": "a b c d", "max_tokens": 3} | fields
                      ).encode()


@pytest.mark.parametrize(("raw", "status", "param", "message"), [
    (b"{not json", 400, None, "not valid JSON"),
    (b"[1, 2]", 400, None, "JSON object"),
    (json.dumps({"model": "goodserve"}).encode(), 400, "prompt", "Field required"),
    (body(model="gpt-4"), 404, "model", "does not exist"),
    (body(max_tokens=0), 400, "max_tokens", "greater than or equal to 1"),
    (body(slo_s=-1), 400, "slo_s", "greater than 0"),
    (body(n=0), 400, "n", "greater than or equal to 1"),
    (body(n=17), 400, "n", "less than or equal to 16"),
    (body(stop=["ok", ""]), 400, "stop", "non-empty strings"),
    (body(stop_token_ids=[10**9]), 400, "stop_token_ids", "must be <"),
    (body(logit_bias={"word": 1.0}), 400, "logit_bias.word", "should match pattern"),
    (body(top_p=0), 400, "top_p", "greater than 0"),
    (body(min_tokens=5), 400, None, "min_tokens: must not exceed max_tokens"),
    (body(stream_options={"include_usage": True}), 400, None, "only allowed when stream"),
    (body(logprobs=2), 400, "logprobs", "simulated engines compute no token probabilities"),
    (body(echo=True), 400, "echo", "not supported"),
    (body(response_format={"type": "json_object"}), 400, "response_format",
     "simulated engines generate no text"),
    (body(tools=[{"type": "function", "function": {"name": "f"}}]), 400, "tools",
     "not supported"),
    (body(prompt="   "), 400, "prompt", "must not be empty"),
    (body(prompt=[1, -3]), 400, "prompt.1", "greater than or equal to 0"),
    (body(prompt=[10**9]), 400, "prompt", "must be <"),
    (body(max_tokens=10**9), 400, "max_tokens", "exceeds the model context of 131072"),
    (b'{"model": "goodserve", "prompt": "a", "slo_s": Infinity}', 400, "slo_s", "finite"),
    (b'{"model": "goodserve", "prompt": "a", "temperature": NaN}', 400, "temperature",
     "finite"),
    (body(prompt="word " * 2_000_000), 413, None, "exceeds the limit of 8388608 bytes"),
])
async def test_bad_requests_get_openai_errors_and_lose_nothing(raw, status, param, message):
    engine = ScriptedEngine("e", "A40")
    service = sim_service(engine)
    reply = await service.complete(raw, chat=False)
    assert isinstance(reply, JsonReply) and reply.status_code == status
    error = reply.body["error"]
    assert message in error["message"] and error["param"] == param
    ok = await service.complete(body(), chat=False)  # the next request is served
    assert ok.status_code == 200 and ok.body["usage"]["completion_tokens"] == 3
    service.close()


async def test_the_model_is_served_by_its_own_name_and_the_alias():
    """As vLLM's --served-model-name: by default the engines' model; any configured
    name is accepted and echoed; `goodserve` always is; another name is a 404."""
    service = sim_service(ScriptedEngine("e", "A40"))
    assert [m["id"] for m in service.models()["data"]] == ["llama-3.1-8b", "goodserve"]
    for name in ("llama-3.1-8b", "goodserve"):
        reply = await service.complete(body(model=name), chat=False)
        assert reply.status_code == 200 and reply.body["model"] == name
    named = sim_service(ScriptedEngine("e", "A40"), served_model_name=("meta/llama", "l8"))
    assert [m["id"] for m in named.models()["data"]] == ["meta/llama", "l8", "goodserve"]
    assert (await named.complete(body(model="l8"), chat=False)).body["model"] == "l8"
    refused = await named.complete(body(model="llama-3.1-8b"), chat=False)
    assert refused.status_code == 404 and "'meta/llama'" in refused.body["error"]["message"]
    cluster = ClusterConfig(groups=[InstanceGroup(engine=EngineConfig(gpu_type="A40"))])
    assert ServeConfig.model_validate({"cluster": cluster, "model_name": "old"}
                                      ).served_model_names == ("old", "goodserve")
    service.close()
    named.close()


class MergingEngine(ScriptedEngine):
    """Its tokens `per_batch` at a time, as an engine actor merges the batches of its
    stream interval; the first reports `cached` prompt tokens found in its cache."""

    def __init__(self, *args, per_batch: int = 3, cached: int = 2, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.per_batch, self.cached = per_batch, cached

    async def generate(self, request: EngineRequest) -> AsyncIterator[list[TokenEvent]]:
        pending: list[TokenEvent] = []
        async for (event,) in super().generate(request):
            if event.num_cached_tokens is not None:
                event = replace(event, num_cached_tokens=self.cached)
            pending.append(event)
            if len(pending) == self.per_batch or event.finished:
                yield pending
                pending = []


async def streamed_chunks(service: CompletionService, **fields) -> list[dict]:
    reply = await service.complete(body(stream=True, **fields), chat=False)
    data = [sse_data(event) async for event in reply]
    return [json.loads(d) for d in data if d != "[DONE]"]


async def test_a_stream_sends_a_token_per_chunk_and_the_usage_counts_cached_tokens():
    """Tokens that reach the router together still go out a chunk each, as vLLM
    streams them (unless `stream_chunk_tokens` allows more); the usage carries the
    engine's prefix hit as `prompt_tokens_details.cached_tokens`."""
    service = sim_service(MergingEngine("e", "A40"))
    chunks = await streamed_chunks(service, max_tokens=7,
                                   stream_options={"include_usage": True})
    texts = [c["choices"][0]["text"] for c in chunks if c["choices"]]
    assert [t.count("<") for t in texts] == [1] * 7
    assert chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 2}
    whole = await service.complete(body(max_tokens=7), chat=False)
    assert whole.body["usage"]["prompt_tokens_details"] == {"cached_tokens": 2}
    wider = sim_service(MergingEngine("e", "A40"), stream_chunk_tokens=3)
    texts = [c["choices"][0]["text"] for c in await streamed_chunks(wider, max_tokens=7)
             if c["choices"]]
    assert [t.count("<") for t in texts] == [3, 3, 1]
    service.close()
    wider.close()


async def test_with_a_tokenizer_prompts_are_counted_as_the_client_counts_them(
        tiny_tokenizer_dir):
    """`goodserve serve --tokenizer`: the router counts prompt tokens with it, and every
    simulated engine generates its words."""
    from app.serving.config import default_serve_config, with_tokenizer
    from app.serving.tokenizer import HfTokenizer

    path = str(tiny_tokenizer_dir)
    config = with_tokenizer(default_serve_config(), path)
    assert {e.tokenizer_path for e in config.cluster.engines()} == {path}
    service = CompletionService(config, [ScriptedEngine("e", "A40")])
    prompt = "zephyr quartz goodput xylophones"  # words its corpus never had
    reply = await service.complete(body(prompt=prompt), chat=False)
    counted = len(HfTokenizer(path).encode(prompt))
    assert reply.body["usage"]["prompt_tokens"] == counted != len(prompt.split())
    service.close()


@pytest.mark.parametrize(("headers", "session"), [
    ({"x-session-affinity": "conv-1"}, "conv-1"),  # AIPerf's multi-turn mode
    ({"x-amzn-sagemaker-session-id": "sm-7"}, "sm-7"),
    ({"cookie": "theme=dark; llm-d-session=ZGVmYXVsdC9wb2QtMQ=="}, "ZGVmYXVsdC9wb2QtMQ=="),
    ({"x-session-id": "h", "cookie": "llm-d-session=c"}, "h"),  # a header before a cookie
    ({"cookie": "not a cookie; ;="}, None),
    ({"x-correlation-id": "per-request"}, None),  # not a session name by default
])
async def test_a_session_named_by_a_header_or_cookie_is_routed_as_a_session(headers, session):
    service = sim_service(ScriptedEngine("e", "A40"))
    routes = []
    routed = service.router.routed

    async def spy(request):
        routes.append(await routed(request))
        return routes[-1]

    service.router.routed = spy
    reply = await service.complete(body(), chat=False, headers=headers)
    assert reply.status_code == 200 and routes[-1].session_id == session
    in_body = await service.complete(body(session_id="mine"), chat=False, headers=headers)
    assert in_body.status_code == 200 and routes[-1].session_id == "mine"  # the body wins
    service.close()


async def test_a_session_header_out_of_bounds_is_a_400_that_loses_nothing():
    service = sim_service(ScriptedEngine("e", "A40"))
    reply = await service.complete(body(), chat=False, headers={"x-session-id": "s" * 201})
    assert reply.status_code == 400 and reply.body["error"]["param"] == "x-session-id"
    assert (await service.complete(body(), chat=False)).status_code == 200
    custom = sim_service(ScriptedEngine("e", "A40"), session_headers=["X-Conversation"])
    assert custom.config.session_headers == ("x-conversation",)
    service.close()
    custom.close()


async def test_a_closing_service_refuses_new_requests_and_reports_it():
    """What a router replica does once the controller's registry says `closing`."""
    service = sim_service(ScriptedEngine("e", "A40"))
    assert (await service.complete(body(), chat=False)).status_code == 200
    service.closing = True
    refused = await service.complete(body(), chat=False)
    assert refused.status_code == 503 and refused.body["error"]["type"] == "service_unavailable"
    health = await service.health()
    assert health.status_code == 503 and health.body["status"] == "closing"
    assert service.router.counters().num_routed == 1  # the refused one never reached routing
    service.close()


def test_closing_the_fleet_is_a_registry_change_routers_see():
    from app.control.fleet import Fleet

    fleet = Fleet("c", "inc")
    before = fleet.registry()
    fleet.close()
    after = fleet.registry()
    assert not before.closing and after.closing and after.key != before.key
    fleet.close()
    assert fleet.registry().key == after.key  # once


async def test_completion_reply_and_stream_follow_the_openai_shapes():
    service = sim_service(ScriptedEngine("e", "A40"), default_slo_s=30.0)
    reply = await service.complete(body(max_tokens=5), chat=False)
    assert reply.body["object"] == "text_completion"
    choice = reply.body["choices"][0]
    assert choice["finish_reason"] == "length" and choice["text"].count("<") == 5
    assert reply.body["goodserve"]["met_deadline"] is True
    assert reply.body["goodserve"]["instance_ids"] == ["e"]
    # the first of five tokens, one per engine step, comes well before the last
    assert 0 < reply.body["goodserve"]["ttft_s"] < reply.body["goodserve"]["e2e_s"]
    chat = json.dumps({"model": "goodserve", "max_tokens": 4, "stream": True,
                       "messages": [{"role": "user", "content": "hi"}]}).encode()
    lines = [line async for line in await service.complete(chat, chat=True)]
    assert lines[-1] == "data: [DONE]\n\n"
    chunks = [json.loads(sse_data(line)) for line in lines[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    deltas = [c["choices"][0]["delta"]["content"] for c in chunks[1:] if c.get("choices")]
    assert len(deltas) == 4 and chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and "usage" not in chunks[-1]
    assert chunks[-1]["goodserve"]["slo_s"] == 30.0
    service.close()


def test_word_hash_tokenizer_is_stable_and_in_vocab():
    tok = WordHashTokenizer(vocab_size=1000)
    ids = tok.encode("the quick brown fox the")
    assert ids[0] == ids[-1] and all(2 <= i < 1000 for i in ids) and len(ids) == 5
    assert tok.decode(ids).split() == [f"<{i}>" for i in ids]


def test_live_replay_prompts_reproduce_lengths_and_shared_prefixes():
    from app.experiments.live_replay import prompt_token_ids
    from app.workloads.workload import WorkloadRequest

    a = WorkloadRequest("a", 0.0, 40, 5, block_hashes=(11, -22), hash_block_size=16)
    b = WorkloadRequest("b", 0.0, 50, 5, block_hashes=(11, -22, 33), hash_block_size=16)
    c = WorkloadRequest("c", 0.0, 20, 5, block_hashes=(99,), hash_block_size=16)
    ids_a, ids_b, ids_c = (prompt_token_ids(r, vocab_size=1000) for r in (a, b, c))
    assert (len(ids_a), len(ids_b), len(ids_c)) == (40, 50, 20)
    assert ids_a[:32] == ids_b[:32] and ids_a[32:] != ids_b[32:40]
    assert ids_c[:16] != ids_a[:16] and all(2 <= i < 1000 for i in ids_a + ids_b + ids_c)


async def test_router_remembers_the_prefixes_it_sent_each_instance():
    router = await started(ScriptedEngine("a", "A40"), ScriptedEngine("b", "A40"),
                           policy="prefix-cache")
    first = await router.submit(request("r1"))
    view = router.view(time.time())
    hits = {iid: view.prefix_hit_tokens(iid, first.route) for iid in ("a", "b")}
    assert hits[first.instance_id] == len(PROMPT) and sum(hits.values()) == len(PROMPT)
    second = await router.submit(request("r2"))  # same prompt: prefix-cache follows it
    assert second.instance_id == first.instance_id


async def test_service_with_a_trained_predictor_predicts_at_arrival(tmp_path):
    """`routing.predictor_dir`: the batched predictor's output reaches the policy (and the
    reply), and the watchdog's estimator wraps the same predictor."""
    from predictor.base import PredictionInput
    from predictor.registry import make_predictor, save_predictors

    history = make_predictor("history").fit([PredictionInput("x")] * 3, [40, 50, 60])
    save_predictors({"history": history}, tmp_path)
    service = sim_service(ScriptedEngine("e", "A40"),
                          routing={"predictor_dir": str(tmp_path), "predictor_name": "history"})
    reply = await service.complete(body(max_tokens=5), chat=False)
    assert reply.status_code == 200
    assert reply.body["goodserve"]["predicted_output_tokens"] == 50
    assert service.router.policy.length.predictor is service.router.watchdog.length.predictor
    service.close()


# ---- disaggregated: prefill and decode pools ---------------------------------------------


class BrokenLink(SimulatedLink):
    async def transfer(self, num_prompt_tokens: int, kv_bytes_per_token: float, now: float,
                       params: dict | None) -> KvHandoff:
        raise ConnectionError("KV link down")


def pd_engines(decode_fail_at: int | None = None, prefill_fail_at: int | None = None):
    prefill = ScriptedEngine("p", "H800", role=EngineRole.PREFILL, fail_at=prefill_fail_at)
    decode = ScriptedEngine("d", "A40", role=EngineRole.DECODE, fail_at=decode_fail_at)
    spare = ScriptedEngine("d2", "A800", role=EngineRole.DECODE)
    return prefill, decode, spare


async def test_prefill_then_decode_with_the_kv_delivered_gives_the_unified_tokens():
    prefill, decode, spare = pd_engines()
    link = SimulatedLink(bandwidth_gbps=1.0)
    router = await started(prefill, decode, spare, policy="round-robin", kv_transport=link)
    flight = await router.submit(request(max_tokens=12))
    assert flight.instance_id == "p" and flight.state is FlightState.PREFILLING
    events = await drain(router, flight)
    assert [e.token_id for e in events] == [token_of(PROMPT, i) for i in range(12)]
    assert [e.index for e in events] == list(range(12))
    assert events[-1].finish_reason == "length" and events[0].finish_reason is None
    (first,) = prefill.received
    assert first.sampling.max_tokens == 1 and first.request_id == "r1:prefill"
    target = decode if decode.received else spare
    (handed,) = target.received
    assert handed.kv_transferred and list(handed.resume_token_ids) == [token_of(PROMPT, 0)]
    placement = flight.placement
    assert placement.prefill_instance_id == "p" and placement.instance_ids == [target.engine_id]
    expected_s = len(PROMPT) * prefill.config.instance.model.kv_bytes_per_token / 1e9
    assert flight.kv.transfer_s == pytest.approx(expected_s, rel=0.05)
    assert flight.kv.loaded_tokens == len(PROMPT)
    assert link.link.num_transfers == 1 and not router.flights


async def test_a_one_token_request_ends_at_its_prefill():
    prefill, decode, spare = pd_engines()
    router = await started(prefill, decode, spare, policy="round-robin",
                           kv_transport=SimulatedLink(10.0))
    flight = await router.submit(request(max_tokens=1))
    events = await drain(router, flight)
    assert [e.finish_reason for e in events] == ["length"]
    assert not decode.received and not spare.received and flight.kv.transfer_s is None


@pytest.mark.parametrize("failure", ["prefill", "transfer", "decode"])
async def test_a_failed_stage_continues_by_token_ids_with_the_same_tokens(failure):
    prefill, decode, spare = pd_engines(prefill_fail_at=0 if failure == "prefill" else None,
                                        decode_fail_at=5 if failure == "decode" else None)
    link = BrokenLink(10.0) if failure == "transfer" else SimulatedLink(10.0)
    stack = build_routing("round-robin")
    router = await started(prefill, decode, spare, stack=stack, kv_transport=link)
    flights = [await router.submit(request(f"r{i}", max_tokens=10)) for i in range(2)]
    on_decode = next(f for f in flights if f.placement.instance_ids[-1] == "d")
    events = await drain(router, on_decode)
    assert [e.token_id for e in events] == [token_of(PROMPT, i) for i in range(10)]
    first_decode = decode.received[0]
    if failure == "prefill":  # no first token: the decode engine prefills the prompt
        assert not first_decode.resume_token_ids and not first_decode.kv_transferred
    elif failure == "transfer":  # first token streamed, its KV lost: re-prefill prompt + it
        assert len(first_decode.resume_token_ids) == 1 and not first_decode.kv_transferred
    else:  # decode engine died mid-stream: another decode instance goes on
        assert first_decode.kv_transferred
        moved = spare.received[-1]
        assert len(moved.resume_token_ids) == 5 and not moved.kv_transferred
        assert on_decode.placement.instance_ids == ["d", "d2"]
    await drain(router, next(f for f in flights if f is not on_decode))
    assert not router.flights


def test_engine_roles_must_form_unified_or_prefill_and_decode_pools():
    prefill, decode, _ = pd_engines()
    with pytest.raises(ValueError, match="prefill and decode pools need a KV transport"):
        LiveRouter([prefill, decode], build_routing("round-robin"))
    with pytest.raises(ValueError, match="must all be unified"):
        LiveRouter([prefill, ScriptedEngine("u", "A40")], build_routing("round-robin"))


async def test_the_prefills_connector_parameters_reach_the_decode_request_unchanged():
    prefill, decode, spare = pd_engines()
    remote = {"do_remote_prefill": True, "remote_engine_id": "p", "remote_block_ids": [1, 2],
              "remote_host": "10.0.0.7", "remote_port": 5601}
    prefill.kv_params = remote
    nixl = KvConnectorConfig(kind=KvConnectorKind.NIXL)
    factory = RecordingFactory()
    router = await started(prefill, decode, spare, policy="round-robin",
                           kv_transport=ConnectorTransport(nixl, bandwidth_gbps=10.0),
                           metrics=RouterMetrics(factory))
    flight = await router.submit(request(max_tokens=6))
    events = await drain(router, flight)
    assert [e.token_id for e in events] == [token_of(PROMPT, i) for i in range(6)]
    (handed,) = (decode if decode.received else spare).received
    assert handed.kv_transferred and handed.kv_transfer_params == remote
    assert flight.kv.loaded_tokens == len(PROMPT)
    assert flight.kv.transfer_s is not None and flight.kv.transfer_s >= 0  # measured
    assert factory["goodserve_kv_transfer_seconds"].get() == [flight.kv.transfer_s]
    (kv_bytes,) = factory["goodserve_kv_transfer_bytes"].get()
    assert kv_bytes == len(PROMPT) * router.instances["d"].spec.model.kv_bytes_per_token


def member(engine: ScriptedEngine, state: str = "active", evacuate: bool = False):
    from app.control.fleet import Member
    from app.control.plan import EngineState

    return Member(engine.engine_id, engine.config, EngineState(state), evacuate)


async def test_registry_changes_take_effect_at_once_and_drain_moves_count_apart():
    """A draining engine takes no new request from the next decision on; evacuating
    it moves its requests by token ids (drain migrations, not SLO-risk ones); a new
    member joins after its first report; one gone from the registry is forgotten once
    nothing of this router runs there."""
    a, b = ScriptedEngine("a", "H800", step_s=0.01), ScriptedEngine("b", "H800", step_s=0.01)
    c = ScriptedEngine("c", "A40", step_s=0.01)
    factory = RecordingFactory()
    router = await started(a, b, policy="round-robin", metrics=RouterMetrics(factory))
    on_a = [f for f in [await router.submit(request(f"r{i}", max_tokens=60)) for i in range(4)]
            if f.instance_id == "a"]
    streams = [asyncio.create_task(drain(router, f)) for f in router.flights.values()]
    await asyncio.sleep(0.05)
    router.follow([member(a, "draining"), member(b)], None)
    later = [await router.submit(request(f"n{i}", max_tokens=5)) for i in range(6)]
    assert {f.instance_id for f in later} == {"b"}
    router.follow([member(a, "draining", evacuate=True), member(b)], None)
    assert all(f.placement.move_to == "b" for f in on_a) and on_a
    router.follow([member(b), member(c)], lambda m: c)  # a leaves, c joins
    await asyncio.sleep(0.02)
    assert "c" in router.view(time.time()).by_id
    await asyncio.gather(*streams, *(drain(router, f) for f in later))
    for f in on_a:
        assert f.placement.instance_ids == ["a", "b"]
    counters = router.counters()
    assert counters.num_drain_migrations == len(on_a) and counters.num_migrations == 0
    assert factory["goodserve_migrations"].get(reason="drain", path="token-ids") == [
        float(len(on_a))]
    assert factory["goodserve_migrations"].get(reason="slo_risk", path="token-ids") == []
    assert "a" not in router.instances  # forgotten once its requests moved off
    report = router.take_load_report()
    assert (report.arrivals, report.finished) == (10, 10)
    assert router.take_load_report().is_empty
    router.close()


class CountingEngine(ScriptedEngine):
    """Counts the status calls it answers."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.status_calls = 0

    async def status(self) -> EngineStatus:
        self.status_calls += 1
        return await super().status()


async def test_replicas_following_one_status_board_cost_each_engine_one_call_per_round():
    """Two replicas route over the reports one poller publishes: each engine answers
    one status call per round, and both replicas see the same reports."""
    a, b = CountingEngine("a", "H800", step_s=0.05), CountingEngine("b", "A800", step_s=0.05)
    board = StatusBoard()
    versions = {"r1": 0, "r2": 0}

    def feed(name: str):
        async def changes():
            versions[name], new = await board.wait_changes(versions[name], 0.05, name)
            return new
        return changes

    async def publish_round() -> None:
        for engine in (a, b):
            board.publish(engine.engine_id, await engine.status())

    await publish_round()
    replicas = [LiveRouter([a, b], build_routing("least-request"), status_feed=feed(n))
                for n in ("r1", "r2")]
    for replica in replicas:
        await replica.poll_once()
    flights = [await replicas[0].submit(request(f"f{i}", max_tokens=400)) for i in range(2)]
    streams = [asyncio.create_task(drain(replicas[0], f)) for f in flights]
    await asyncio.sleep(0.02)
    for _ in range(3):
        await publish_round()
        for replica in replicas:
            await replica.poll_once()
    assert (a.status_calls, b.status_calls) == (4, 4)  # one per round, not one per replica
    second = replicas[1].view(time.time())
    assert sum(v.num_outstanding for v in second.instances) == 2  # the first's requests
    assert set(board.followers) == {"r1", "r2"}
    assert {v for v, _ in board.followers.values()} == {board.version}
    board.publish("a", None)  # the poller lost it: out of rotation for both
    for replica in replicas:
        await replica.poll_once()
        assert [v.instance_id for v in replica.view(time.time()).instances] == ["b"]
    for task in streams:
        task.cancel()


async def test_the_status_board_answers_changes_since_a_version_and_waits_for_new_ones():
    board = StatusBoard()
    assert board.changes(0) == (0, {})
    assert await board.wait_changes(0, 0.01) == (0, {})  # nothing came: empty after the wait
    status = await ScriptedEngine("a", "H800").status()
    board.publish("a", status)
    board.publish("b", None)
    assert board.changes(0) == (2, {"a": status, "b": None})
    assert board.changes(1) == (2, {"b": None})
    waiter = asyncio.create_task(board.wait_changes(2, 5.0))
    await asyncio.sleep(0.01)
    assert not waiter.done()
    board.publish("b", status)
    assert await asyncio.wait_for(waiter, 1.0) == (3, {"b": status})
    board.forget("a")
    assert board.changes(0) == (3, {"b": status})


def test_replicas_tell_the_board_their_smallest_slack_and_hear_the_others(monkeypatch):
    from app.serving import status_board

    clock = [100.0]
    monkeypatch.setattr(status_board.time, "monotonic", lambda: clock[0])
    board = StatusBoard()
    board.tell("r1", {"a": 0.5, "b": 2.0})
    board.tell("r2", {"a": 0.2})
    board.tell("r3", {})
    assert board.others_stalls("r1") == {"a": 0.2}
    assert board.others_stalls("r2") == {"a": 0.5, "b": 2.0}
    assert board.others_stalls(None) == {"a": 0.2, "b": 2.0}
    assert board.tellers == ["r1", "r2", "r3"]
    clock[0] += status_board.TOLD_FRESH_S + 1  # r1 and r3 stopped asking; r2 goes on
    board.tell("r2", {"a": 0.3})
    assert board.others_stalls("r3") == {"a": 0.3} and board.others_stalls("r2") == {}
    assert board.tellers == ["r2"]


async def test_the_board_forgets_replicas_silent_for_a_minute(monkeypatch):
    """Autoscaling adds and removes replicas: one that stopped polling leaves the
    followers and the tellers, the ones still polling stay."""
    from app.serving import status_board

    clock = [100.0]
    monkeypatch.setattr(status_board.time, "monotonic", lambda: clock[0])
    board = StatusBoard()
    for replica in ("r1", "r2"):
        board.tell(replica, {"a": 1.0})
        await board.wait_changes(0, 0.0, replica)
    clock[0] += status_board.GONE_S - 1
    board.tell("r2", {"a": 1.0})
    await board.wait_changes(0, 0.0, "r2")
    assert set(board.followers) == {"r1", "r2"}  # r1 silent, not yet gone
    clock[0] += 2
    await board.wait_changes(0, 0.0, "r2")
    assert set(board.followers) == {"r2"} and board.tellers == ["r2"]
    assert board.others_stalls("r2") == {}



async def test_replicas_tell_the_board_what_finished_and_learn_the_others_lengths():
    """A finish reaches the other replica's length estimator through the board (no
    prompt text on the way); a replica not on a board keeps nothing to tell."""
    board = StatusBoard()
    engine = ScriptedEngine("a", "H800")
    board.publish("a", await engine.status())

    async def reports():
        return board.changes(0)[1]

    first, second = (LiveRouter([engine], build_routing(PolicyKind.GOODSERVE),
                                status_feed=reports) for _ in range(2))
    for replica in (first, second):
        await replica.poll_once()
    flight = await first.submit(request("done", max_tokens=7))
    await drain(first, flight)
    told = first.take_finished()
    assert [(r.request.request_id, r.num_output_tokens) for r in told] == [("done", 7)]
    assert told[0].request.prompt is None and first.take_finished() == []
    board.tell("r1", {}, told)
    cursor, heard = board.others_finished(0, "r2")
    second.learn_finished(heard)
    assert list(second.policy.length._lengths.sorted) == [7] and cursor == 1
    assert board.others_finished(0, "r1") == (1, [])  # its own finish is not sent back
    alone = LiveRouter([engine], build_routing(PolicyKind.GOODSERVE))
    await alone.poll_once()
    await drain(alone, await alone.submit(request("solo", max_tokens=3)))
    assert alone.take_finished() == []
