"""Ray Serve shell of the router: HTTP endpoints over `CompletionService`.

`build_app(config)` returns the Serve application (`serve run app.main:app`, or
`goodserve serve --config ...`). Each replica drives the cluster's engine actors,
created on first use as named detached actors (see `launch_engine`), so replicas
share them. All request handling lives in app/serving/; this file only maps
HTTP onto it and Ray actors onto `EngineClient`.
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve

from app.engine_types import EngineRequest, EngineStatus, TokenEvent
from app.serving.config import ServeConfig
from app.serving.router import EngineClient
from app.serving.service import CompletionService, JsonReply
from deployments.cluster import EngineHandle, launch_cluster


class ActorEngineClient(EngineClient):
    """`EngineClient` over an `EngineActor` handle."""

    def __init__(self, handle: EngineHandle) -> None:
        super().__init__(handle.engine_id, handle.config)
        self.actor = handle.actor

    async def generate(self, request: EngineRequest) -> AsyncIterator[list[TokenEvent]]:
        stream = self.actor.generate.options(num_returns="streaming").remote(request)
        async for ref in stream:
            yield await ref

    async def abort(self, request_id: str) -> bool:
        return await self.actor.abort.remote(request_id)

    async def status(self) -> EngineStatus:
        return await self.actor.status.remote()


http_app = FastAPI(title="GoodServe", description="SLO-aware serving on heterogeneous GPUs")


def _reply(result: JsonReply | AsyncIterator[str]) -> Response:
    if isinstance(result, JsonReply):
        return JSONResponse(result.body, status_code=result.status_code)
    return StreamingResponse(result, media_type="text/event-stream")


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=4096)
@serve.ingress(http_app)
class RouterDeployment:
    """One router replica: its own status estimates, budgets and watchdog."""

    def __init__(self, config: ServeConfig) -> None:
        handles = launch_cluster(config.cluster, shared=True)
        self.service = CompletionService(config, [ActorEngineClient(h) for h in handles])

    @http_app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return _reply(await self.service.complete(await request.body(), chat=False))

    @http_app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return _reply(await self.service.complete(await request.body(), chat=True))

    @http_app.get("/v1/models")
    async def models(self) -> dict:
        return self.service.models()

    @http_app.get("/health")
    async def health(self) -> Response:
        return _reply(await self.service.health())

    @http_app.get("/v1/instances")
    async def instances(self) -> dict:
        return await self.service.instances()

    @http_app.post("/admin/migrate")
    async def migrate(self, request: Request) -> Response:
        return _reply(await self.service.migrate(await request.body()))

    def __del__(self) -> None:
        self.service.close()


def free_port() -> int:
    """An unused local TCP port for the HTTP proxy."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_app(config: ServeConfig) -> serve.Application:
    deployment = RouterDeployment.options(num_replicas=config.num_router_replicas)
    return deployment.bind(config)
