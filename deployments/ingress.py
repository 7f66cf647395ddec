"""An ingress in front of the router replicas (`ingress_replicas` > 0): Serve's HTTP
proxy reaches it, and it forwards each request to a router replica through a Serve
handle. When that replica dies, the ingress sends the request again, with the same id,
to a live one, which re-attaches it where its engine runs it (never a second run): the
client sees neither the death nor a repeated or skipped event. What each try sends is
app/serving/relay.py; the router's side is `RouterReplica.relay`."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.exceptions import DeploymentUnavailableError, ReplicaUnavailableError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from app.serving.api import error_body
from app.serving.relay import Forwarded, RelayHead, StreamCursor, retry_backoff_s
from app.serving.replies import EVENT_STREAM
from app.serving.reply_writing import stream_error
from deployments.http_api import NodeMetrics, Route, api_app

logger = logging.getLogger(__name__)

# a router replica that died, or that Serve cannot reach: the request goes to another
REPLICA_GONE = (RayActorError, ReplicaUnavailableError, DeploymentUnavailableError)

ingress_app = api_app()  # the routes of http_app, each forwarded


class RoutersLost(Exception):
    """Every try of a request met a dead or unreachable router replica."""


INGRESS_ACTOR_OPTIONS = {"num_cpus": 0}


@serve.deployment(ray_actor_options=INGRESS_ACTOR_OPTIONS, max_ongoing_requests=4096)
@serve.ingress(ingress_app)
class IngressDeployment:
    """Forwards every route to the router replicas, a request at most `max_tries` times."""

    def __init__(self, router: DeploymentHandle, max_tries: int) -> None:
        self.router = router.options(stream=True)
        self.max_tries = max_tries
        self._node_metrics = NodeMetrics()

    async def _open(self, route: Route, forwarded: Forwarded, body: bytes, tries: int,
                    after: int | None = None
                    ) -> tuple[DeploymentResponseGenerator, RelayHead, int]:
        """Send until a replica answers with a reply's head: the reply, its head and
        the tries used so far (`tries` before this call). A try after the first carries
        the events relayed so far (`after`, `Forwarded.retry`)."""
        while tries < self.max_tries:
            if tries:
                await asyncio.sleep(retry_backoff_s(tries - 1))
            headers = forwarded.first() if tries == 0 else forwarded.retry(after)
            tries += 1
            reply = self.router.relay.remote(route.value, headers, body)
            try:
                return reply, await reply.__anext__(), tries
            except REPLICA_GONE as exc:
                logger.warning("router replica lost before %s answered (%s); try %d of %d",
                               headers["x-request-id"], type(exc).__name__, tries,
                               self.max_tries)
        raise RoutersLost(f"no router replica answered in {self.max_tries} tries")

    async def _forward(self, route: Route, request: Request) -> Response:
        forwarded = Forwarded.of(request.headers)
        body = await request.body()
        tries = 0
        try:
            while True:
                reply, head, tries = await self._open(route, forwarded, body, tries)
                if head.streamed:
                    return StreamingResponse(self._events(route, forwarded, body, reply, tries),
                                             media_type=EVENT_STREAM, headers=head.headers)
                try:
                    content = await reply.__anext__()
                except REPLICA_GONE:
                    continue  # the whole reply again, by the same id
                return Response(content, status_code=head.status_code, headers=head.headers,
                                media_type="application/json")
        except RoutersLost as exc:
            return JSONResponse(error_body(str(exc), "service_unavailable"), status_code=503)

    async def _events(self, route: Route, forwarded: Forwarded, body: bytes,
                      reply: DeploymentResponseGenerator, tries: int) -> AsyncIterator[str]:
        """A stream's events; a replica lost mid-stream is replaced by one that sends the
        events after the last one relayed."""
        cursor = StreamCursor(keep_ids=forwarded.client_reads_ids)
        while True:
            try:
                async for text in reply:
                    yield cursor.relay(text)
                return
            except REPLICA_GONE as exc:
                logger.warning("router replica lost mid-stream of %s (%s); resuming after "
                               "%s tokens", forwarded.headers["x-request-id"],
                               type(exc).__name__, cursor.resume_from())
            try:
                reply, head, tries = await self._open(route, forwarded, body, tries,
                                                      after=cursor.resume_from())
            except RoutersLost as exc:
                error = error_body(str(exc), "service_unavailable")
            else:
                if head.streamed:
                    continue
                error = json.loads(await reply.__anext__())  # refused where it would resume
            for _, event in stream_error(error):
                yield event
            return

    @ingress_app.post(Route.COMPLETIONS.value)
    async def completions(self, request: Request) -> Response:
        return await self._forward(Route.COMPLETIONS, request)

    @ingress_app.post(Route.CHAT.value)
    async def chat_completions(self, request: Request) -> Response:
        return await self._forward(Route.CHAT, request)

    @ingress_app.get(Route.MODELS.value)
    async def models(self, request: Request) -> Response:
        return await self._forward(Route.MODELS, request)

    @ingress_app.get(Route.HEALTH.value)
    async def health(self, request: Request) -> Response:
        return await self._forward(Route.HEALTH, request)

    @ingress_app.get(Route.INSTANCES.value)
    async def instances(self, request: Request) -> Response:
        return await self._forward(Route.INSTANCES, request)

    @ingress_app.post(Route.MIGRATE.value)
    async def migrate(self, request: Request) -> Response:
        return await self._forward(Route.MIGRATE, request)

    @ingress_app.get(Route.METRICS.value)
    async def metrics(self) -> Response:
        return await self._node_metrics.page()
