"""The HTTP surface both deployments serve: the OpenAI-compatible routes and the
schema `GET /openapi.json` publishes (the router replicas when they take HTTP
themselves, else the ingress in front of them)."""

from __future__ import annotations

from enum import StrEnum
from functools import partial

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from app.serving.api import openapi_request_bodies
from app.serving.auth import Access


class Route(StrEnum):
    """The application's routes, by path."""

    COMPLETIONS = "/v1/completions"
    CHAT = "/v1/chat/completions"
    MODELS = "/v1/models"
    HEALTH = "/health"
    INSTANCES = "/v1/instances"
    MIGRATE = "/admin/migrate"


ROUTE_ACCESS = {Route.COMPLETIONS: Access.USER, Route.CHAT: Access.USER,
                Route.MODELS: Access.USER, Route.INSTANCES: Access.ADMIN,
                Route.MIGRATE: Access.ADMIN}  # /health is open


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
