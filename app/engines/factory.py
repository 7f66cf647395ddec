"""Which backend an engine config names: a module of its own, since each backend builds
on `app.engines.base`."""

from __future__ import annotations

from app.config import EngineBackend, EngineConfig
from app.engines.base import EngineBackendBase


def make_backend(engine_id: str, config: EngineConfig) -> EngineBackendBase:
    """The backend `config.backend` names (vLLM is imported only when used)."""
    if config.backend == EngineBackend.SIM:
        from app.engines.sim import SimBackend

        return SimBackend(engine_id, config)
    if config.backend == EngineBackend.VLLM:
        from app.engines.vllm import VllmBackend

        return VllmBackend(engine_id, config)
    raise ValueError(f"unknown engine backend {config.backend!r}")
