"""Start engine actors pinned to GPU kinds, locally or on a real Ray cluster.

Pinning uses a custom resource per GPU kind (`gpu_type:H800`). Nodes of a real
cluster declare it in cluster.yaml; a local run declares the same resources on
the one local node, so one config pins identically in both places.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import ray

from app.config import ClusterConfig, EngineConfig
from app.engine_types import EngineRequest, TokenEvent
from deployments.engine import EngineActor


@dataclass(frozen=True)
class EngineHandle:
    """A started engine actor and what it serves."""

    engine_id: str
    config: EngineConfig
    actor: ray.actor.ActorHandle


def local_node_resources(cluster: ClusterConfig) -> dict[str, float]:
    """Custom resources a single local node must declare to host `cluster`."""
    counts = Counter(e.resource_name for e in cluster.engines())
    return {name: float(n) for name, n in counts.items()}


def init_local_ray(cluster: ClusterConfig, num_cpus: int | None = None) -> None:
    """Start (or join) a local Ray instance that can place every engine of `cluster`."""
    if ray.is_initialized():
        return
    ray.init(
        num_cpus=num_cpus,
        resources=local_node_resources(cluster),
        include_dashboard=False,
        log_to_driver=False,
    )


def launch_engine(engine_id: str, config: EngineConfig) -> EngineHandle:
    """Create one actor on a node of its GPU kind; vLLM actors need no Ray CPU slot
    (the engine core runs in its own process), so small machines can host several."""
    actor = EngineActor.options(
        name=engine_id,
        resources={config.resource_name: 1},
        num_cpus=0,
        max_concurrency=1000,
    ).remote(engine_id, config)
    return EngineHandle(engine_id, config, actor)


def launch_cluster(cluster: ClusterConfig, start: bool = True) -> list[EngineHandle]:
    """One actor per engine of `cluster`; ids are `<cluster>-<gpu>-<n>`."""
    handles = []
    for i, config in enumerate(cluster.engines()):
        tag = config.gpu_type if config.tp == 1 else f"{config.tp}x{config.gpu_type}"
        handles.append(launch_engine(f"{cluster.name}-{tag}-{i}", config))
    if start:
        ray.get([h.actor.start.remote() for h in handles])
    return handles


def shutdown_engines(handles: list[EngineHandle]) -> None:
    ray.get([h.actor.shutdown.remote() for h in handles])
    for h in handles:
        ray.kill(h.actor)


async def collect_tokens(handle: EngineHandle, request: EngineRequest) -> list[TokenEvent]:
    """Run one request to completion through the streaming actor call."""
    stream = handle.actor.generate.options(num_returns="streaming").remote(request)
    events: list[TokenEvent] = []
    async for ref in stream:
        events.extend(await ref)
    return events
