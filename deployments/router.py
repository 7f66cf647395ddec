"""Ray Serve shell of the router: HTTP endpoints over `CompletionService`.

`build_app(config)` returns the Serve application (`serve run app.main:app`, or
`goodserve serve --config ...`). The application's controller actor (started by the
first replica, see deployments/controller.py) owns the engine actors; every replica
routes over the controller's registry, follows its changes without restarting and
reports its arrivals and completions to it. All request handling lives in
app/serving/; this file only maps HTTP onto it and Ray actors onto `EngineClient`.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from functools import partial

import ray
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve

from app.control.fleet import Member
from app.engines.messages import EngineRecord, EngineRequest, EngineStatus, TokenEvent
from app.routing.budgets import budgets_of
from app.serving.config import ServeConfig
from app.serving.instances import EngineClient
from app.serving.live_router import LiveRouter
from app.serving.relay import RelayHead
from app.serving.replies import EVENT_STREAM
from app.serving.service import CompletionService, JsonReply, StreamReply
from app.serving.status_board import StatusChanges
from deployments.cluster import ENGINE_NAMESPACE, EngineHandle, engine_ids
from deployments.controller import controller_for, stop_controller
from deployments.engine import generate_on, output_stream
from deployments.http_api import ROUTE_ACCESS, NodeMetrics, Route, http_app
from deployments.ingress import INGRESS_ACTOR_OPTIONS, IngressDeployment
from deployments.metrics import RayMetricFactory

logger = logging.getLogger(__name__)

REGISTRY_WAIT_S = 1.0  # long-poll period, also the load report period
# a cache or a proxy in front (nginx buffers by default) must pass each event on as the
# engine produces it, or the client sees the stream arrive at once at the end
STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def member_client(member: Member) -> ActorEngineClient:
    """A client for a registry member's engine actor (found by name)."""
    actor = ray.get_actor(member.engine_id, namespace=ENGINE_NAMESPACE)
    return ActorEngineClient(EngineHandle(member.engine_id, member.config, actor))


async def joining_clients(members: Sequence[Member],
                          router: LiveRouter) -> dict[str, ActorEngineClient]:
    """Clients for the members the router does not know yet, found off the event loop
    (`ray.get_actor` blocks on the cluster's metadata store, and the loop carries every
    request of the replica)."""
    joining = [m for m in members if m.engine_id not in router.instances]
    clients = await asyncio.gather(*(asyncio.to_thread(member_client, m) for m in joining))
    return {m.engine_id: client for m, client in zip(joining, clients, strict=True)}


def found_client(clients: dict[str, ActorEngineClient], member: Member) -> ActorEngineClient:
    """The client `joining_clients` found for `member`, else one found now."""
    return clients.get(member.engine_id) or member_client(member)


class ActorEngineClient(EngineClient):
    """`EngineClient` over an `EngineActor` handle."""

    def __init__(self, handle: EngineHandle) -> None:
        super().__init__(handle.engine_id, handle.config)
        self.actor = handle.actor

    def generate(self, request: EngineRequest) -> AsyncIterator[list[TokenEvent]]:
        return generate_on(self.actor, request)

    def read(self, request_id: str, from_index: int) -> AsyncIterator[list[TokenEvent]]:
        return output_stream(self.actor, request_id, from_index)

    async def find(self, request_id: str) -> list[EngineRecord]:
        return await self.actor.find.remote(request_id)

    async def abort(self, request_id: str) -> bool:
        return await self.actor.abort.remote(request_id)

    async def status(self) -> EngineStatus:
        return await self.actor.status.remote()




def _reply(result: JsonReply | StreamReply) -> Response:
    if isinstance(result, JsonReply):
        return JSONResponse(result.body, status_code=result.status_code,
                            headers=dict(result.headers))
    return StreamingResponse(result.events, media_type=EVENT_STREAM,
                             headers=STREAM_HEADERS | dict(result.headers))


class RouterReplica:
    """One router replica: its own status estimates, budgets and watchdog. It answers
    a request an ingress forwards (`relay`); `RouterDeployment` also takes HTTP."""

    def __init__(self, config: ServeConfig) -> None:
        self.controller = controller_for(config, serve.get_replica_context().app_name)
        registry = ray.get(self.controller.registry.remote())
        self.registry_key = registry.key
        self.replica = serve.get_replica_context().replica_tag
        clients = [member_client(m) for m in registry.members]
        self.status_version = 0
        self.finish_cursor = 0  # the board's finish log read up to here
        self.poll_interval_s = config.poll_interval_s
        self._node_metrics = NodeMetrics()  # `GET /metrics` where it takes HTTP itself
        self.service = CompletionService(config, clients, companion=self._follow,
                                         metrics=RayMetricFactory(),
                                         status_feed=self._published_statuses)
        self.service.router.follow(registry.members, member_client)  # draining ones too

    async def _published_statuses(self) -> StatusChanges:
        """The engines' reports the controller published since the last call (it polls
        each engine once for every replica); none while it is unreachable. With each
        poll the replica tells the smallest slack its requests have per engine and the
        requests it saw finish, and takes the other replicas' (GoodServe's do-no-harm
        budgets; its length estimator learns from every finish)."""
        router = self.service.router
        budgets = budgets_of(router.policy)
        told = None if budgets is None else budgets.own_shortest_stalls()
        finished = router.take_finished()
        try:
            answer = await self.controller.engine_statuses.remote(
                self.status_version, self.poll_interval_s, self.replica, told or {}, finished,
                self.finish_cursor)
        except Exception as exc:
            logger.warning("engine reports unavailable (%s); routing on the last ones", exc)
            await asyncio.sleep(self.poll_interval_s)
            return {}
        if budgets is not None:
            budgets.take_others(answer.others_stalls)
        router.learn_finished(answer.others_finished)
        self.finish_cursor = answer.finish_cursor
        if answer.version < self.status_version:  # a restarted controller counts from 0
            self.status_version = 0
            self.finish_cursor = 0
            return answer.changes
        self.status_version = answer.version
        return answer.changes

    async def _follow(self, router: LiveRouter) -> None:
        """Long-poll the controller's registry and push load reports; while the
        controller is down (it restarts), serve on the last registry."""
        while True:
            try:
                report = router.take_load_report()
                if not report.is_empty:
                    self.controller.report.remote(report)
                self.controller.router_load.remote(self.replica, len(router.flights))
                registry = await self.controller.registry.remote(self.registry_key,
                                                                 REGISTRY_WAIT_S)
            except Exception as exc:
                logger.warning("controller unreachable (%s); routing on registry %s",
                               exc, self.registry_key)
                await asyncio.sleep(REGISTRY_WAIT_S)
                continue
            if registry is None:
                continue
            try:
                clients = await joining_clients(registry.members, router)
            except Exception as exc:  # not yet findable: take this registry again
                logger.warning("engines of registry %s not reachable yet (%s)",
                               registry.key, exc)
                await asyncio.sleep(REGISTRY_WAIT_S)
                continue
            self.registry_key = registry.key
            self.service.closing = registry.closing
            router.follow(registry.members, partial(found_client, clients))

    def _denied(self, route: Route, headers: Mapping[str, str]) -> JsonReply | None:
        """The reply to a request refused before its body is read (key, size)."""
        access = ROUTE_ACCESS.get(route)
        if access is None:
            return None
        return (self.service.authorize(headers.get("authorization"), access)
                or self.service.too_large(headers.get("content-length")))

    async def answer(self, route: Route, headers: Mapping[str, str],
                     body: Callable[[], Awaitable[bytes]],
                     received_perf_s: float) -> JsonReply | StreamReply:
        """The reply to one request on `route`; `body` reads it once it is let in."""
        if denied := self._denied(route, headers):
            return denied
        match route:
            case Route.COMPLETIONS | Route.CHAT:
                return await self.service.complete(body, chat=route is Route.CHAT,
                                                   received_perf_s=received_perf_s,
                                                   headers=headers)
            case Route.MODELS:
                return JsonReply(200, self.service.models())
            case Route.HEALTH:
                return await self.service.health()
            case Route.INSTANCES:
                return JsonReply(200, await self.service.instances())
            case Route.MIGRATE:
                return await self.service.migrate(await body())

    async def relay(self, route: str, headers: dict[str, str],
                    body: bytes) -> AsyncIterator[RelayHead | str | bytes]:
        """A request an ingress forwards (deployments/ingress.py): the reply's head, then
        a stream's events one by one, or a whole reply's JSON body."""
        received = time.perf_counter()

        async def read() -> bytes:
            return body

        reply = await self.answer(Route(route), headers, read, received)
        if isinstance(reply, JsonReply):
            yield RelayHead(reply.status_code, dict(reply.headers), streamed=False)
            yield _reply(reply).body
            return
        yield RelayHead(200, STREAM_HEADERS | dict(reply.headers), streamed=True)
        async for text in reply.events:
            yield text

    def __del__(self) -> None:
        self.service.close()


# A router replica's requests run on Serve's own event loop rather than on a second
# loop in a thread of their own (Serve's default): there, every body read, response
# chunk and call's reply crosses between the two loops (a thread wake-up and a GIL
# hand-off each), and the two threads take turns at the GIL. Nothing of ours blocks
# the loop: the prediction has its own thread, engine look-ups go off the loop.
ROUTER_ENV = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}

# Serve names both "RouterDeployment" (the faults harness and the tests find its
# replicas by it); an application holds at most one FastAPI deployment
ROUTER_OPTIONS: dict[str, object] = {
    "name": "RouterDeployment",
    "ray_actor_options": {"num_cpus": 0, "runtime_env": {"env_vars": ROUTER_ENV}},
    "max_ongoing_requests": 4096}

# behind an ingress (`ingress_replicas` > 0): reached through Serve handles only
RouterCore = serve.deployment(**ROUTER_OPTIONS)(RouterReplica)


@serve.deployment(**ROUTER_OPTIONS)
@serve.ingress(http_app)
class RouterDeployment(RouterReplica):
    """A router replica that takes HTTP from Serve's proxy itself."""

    async def _http(self, route: Route, request: Request) -> Response:
        received = time.perf_counter()  # the arrival, before the body is read
        return _reply(await self.answer(route, request.headers, request.body, received))

    @http_app.post(Route.COMPLETIONS.value)
    async def completions(self, request: Request) -> Response:
        return await self._http(Route.COMPLETIONS, request)

    @http_app.post(Route.CHAT.value)
    async def chat_completions(self, request: Request) -> Response:
        return await self._http(Route.CHAT, request)

    @http_app.get(Route.MODELS.value)
    async def models(self, request: Request) -> Response:
        return await self._http(Route.MODELS, request)

    @http_app.get(Route.HEALTH.value)
    async def health(self, request: Request) -> Response:
        return await self._http(Route.HEALTH, request)

    @http_app.get(Route.INSTANCES.value)
    async def instances(self, request: Request) -> Response:
        return await self._http(Route.INSTANCES, request)

    @http_app.post(Route.MIGRATE.value)
    async def migrate(self, request: Request) -> Response:
        return await self._http(Route.MIGRATE, request)

    @http_app.get(Route.METRICS.value)
    async def metrics(self) -> Response:
        return await self._node_metrics.page()


def free_port() -> int:
    """An unused local TCP port for the HTTP proxy."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_app(config: ServeConfig) -> serve.Application:
    """Replicas being stopped (shutdown, downscaling) take no new request and let those
    in flight finish for up to `shutdown_grace_s`. The replica count is fixed, or Ray
    Serve's autoscaling when the config asks for it. With `ingress_replicas` an ingress
    takes HTTP and the routers answer its handle calls."""
    replicas: dict[str, object] = (
        {"num_replicas": config.num_router_replicas} if config.router_autoscaling is None
        else {"autoscaling_config": config.router_autoscaling.serve_options()})
    deployment = RouterDeployment if config.ingress_replicas == 0 else RouterCore
    placed = {"resources": config.router_resources}
    routers = deployment.options(
        **replicas, graceful_shutdown_timeout_s=config.shutdown_grace_s,
        graceful_shutdown_wait_loop_s=0.5,
        ray_actor_options=ROUTER_OPTIONS["ray_actor_options"] | placed).bind(config)
    if config.ingress_replicas == 0:
        return routers
    return IngressDeployment.options(
        num_replicas=config.ingress_replicas, graceful_shutdown_timeout_s=config.shutdown_grace_s,
        graceful_shutdown_wait_loop_s=0.5,
        ray_actor_options=INGRESS_ACTOR_OPTIONS | placed).bind(routers, config.ingress_tries)


@contextmanager
def serve_application(config: ServeConfig, app_name: str,
                      port: int | None = None) -> Iterator[str]:
    """`config`'s router application on the running Ray, on `port` (default a free one),
    yielding its URL; Serve is shut down afterwards (the engines stay)."""
    port = port or free_port()
    # one proxy, on the head: the nodes of a test cluster share this machine's ports
    serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
    serve.run(build_app(config), name=app_name, route_prefix="/")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()


@contextmanager
def serving(config: ServeConfig, app_name: str, port: int | None = None) -> Iterator[str]:
    """`serve_application`, then the controller and every engine it started stopped."""
    try:
        with serve_application(config, app_name, port) as url:
            yield url
    finally:
        stop_controller(config.cluster.name)
        wait_until_gone(config)


def wait_until_gone(config: ServeConfig, timeout_s: float = 60.0) -> None:
    """`ray.kill` returns before the actor is dead: wait until no engine of the cluster
    is registered, so a later application starts engines of its own under those names."""
    deadline_s = time.monotonic() + timeout_s
    for engine_id, _ in engine_ids(config.cluster):
        while time.monotonic() < deadline_s:
            try:
                ray.get_actor(engine_id, namespace=ENGINE_NAMESPACE)
            except ValueError:  # gone
                break
            time.sleep(0.1)
