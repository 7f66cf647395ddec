"""Which backend an engine config names: a module of its own, since each backend builds
on `app.engines.base`."""

from __future__ import annotations

from app.engines.base import EngineBackendBase
from app.engines.config import EngineBackend, EngineConfig


def backend_class(backend: EngineBackend) -> type[EngineBackendBase]:
    """The class `backend` names (its module, and vLLM's, imported only when asked)."""
    if backend == EngineBackend.SIM:
        from app.engines.sim import SimBackend

        return SimBackend
    if backend == EngineBackend.VLLM:
        from app.engines.vllm import VllmBackend

        return VllmBackend
    raise ValueError(f"unknown engine backend {backend!r}")


def make_backend(engine_id: str, config: EngineConfig) -> EngineBackendBase:
    """The backend `config.backend` names."""
    return backend_class(config.backend)(engine_id, config)
