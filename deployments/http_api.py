"""The HTTP surface both deployments serve: the OpenAI-compatible routes and the
schema `GET /openapi.json` publishes (the router replicas when they take HTTP
themselves, else the ingress in front of them)."""

from __future__ import annotations

import asyncio
from enum import StrEnum
from functools import partial

import httpx
import ray
from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response

from app.serving.api import error_body, openapi_request_bodies
from app.serving.auth import Access


class Route(StrEnum):
    """The application's routes, by path."""

    COMPLETIONS = "/v1/completions"
    CHAT = "/v1/chat/completions"
    MODELS = "/v1/models"
    HEALTH = "/health"
    INSTANCES = "/v1/instances"
    MIGRATE = "/admin/migrate"
    METRICS = "/metrics"


ROUTE_ACCESS = {Route.COMPLETIONS: Access.USER, Route.CHAT: Access.USER,
                Route.MODELS: Access.USER, Route.INSTANCES: Access.ADMIN,
                Route.MIGRATE: Access.ADMIN}  # /health and /metrics are open, as vLLM's


def openapi_schema(app: FastAPI) -> dict:
    """FastAPI's schema of `app`'s routes plus the bodies the POST routes accept (they
    read the raw body themselves, so FastAPI cannot see them): `GET /openapi.json`."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version="1.0.0", description=app.description,
                             routes=app.routes)
        bodies, components = openapi_request_bodies()
        schema.setdefault("components", {}).setdefault("schemas", {}).update(components)
        for path, body in bodies.items():
            schema["paths"][path]["post"]["requestBody"] = body
        app.openapi_schema = schema
    return app.openapi_schema


def api_app() -> FastAPI:
    """A FastAPI app publishing `openapi_schema` for the routes a deployment adds."""
    app = FastAPI(title="GoodServe", description="SLO-aware serving on heterogeneous GPUs")
    app.openapi = partial(openapi_schema, app)  # type: ignore[method-assign]
    return app


http_app = api_app()  # the router replicas' routes


PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


class NodeMetrics:
    """`GET /metrics` on the API port, where clients that benchmark a vLLM server look:
    the Prometheus page of the Ray node this replica runs on (its metrics agent holds
    GoodServe's series and Ray's), read when asked."""

    def __init__(self) -> None:
        self._url: str | None = None

    async def page(self) -> Response:
        try:
            if self._url is None:
                self._url = await asyncio.to_thread(node_metrics_url)
            async with httpx.AsyncClient(timeout=10) as client:
                reply = await client.get(self._url)
            reply.raise_for_status()
        except (httpx.HTTPError, LookupError) as exc:
            return JSONResponse(error_body(f"metrics unavailable: {exc}",
                                           "service_unavailable"), status_code=503)
        return Response(reply.content, media_type=PROMETHEUS_TEXT)


def node_metrics_url() -> str:
    """The Prometheus page of the Ray node this process runs on (LookupError: none)."""
    node_id = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        if node["NodeID"] == node_id and node.get("MetricsExportPort"):
            return f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
    raise LookupError(f"node {node_id} exports no metrics")
