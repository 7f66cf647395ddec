"""Start engine actors pinned to GPU kinds, locally or on a real Ray cluster.

Pinning uses a custom resource per GPU kind (`gpu_type:H800`). Nodes of a real
cluster declare it in cluster.yaml; a local run declares the same resources on
the one local node, so one config pins identically in both places.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import ray

from app.config import ClusterConfig, EngineConfig, EngineRole
from app.engine_types import EngineRequest, TokenEvent
from deployments.engine import EngineActor

ENGINE_NAMESPACE = "goodserve"  # engines are looked up by name from Serve replicas


@dataclass(frozen=True)
class EngineHandle:
    """A started engine actor and what it serves."""

    engine_id: str
    config: EngineConfig
    actor: ray.actor.ActorHandle


def local_node_resources(cluster: ClusterConfig) -> dict[str, float]:
    """Custom resources a single local node must declare to host `cluster`."""
    counts: Counter[str] = Counter()
    for engine in cluster.engines():
        counts[engine.resource_name] += engine.tp
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


def launch_engine(engine_id: str, config: EngineConfig, shared: bool = False) -> EngineHandle:
    """Create one actor on a node of its GPU kind; vLLM actors need no Ray CPU slot
    (the engine core runs in its own process), so small machines can host several.

    An engine holds one unit of its `gpu_type:<GPU>` resource per GPU (tp units), and
    a vLLM engine on a real GPU also holds tp Ray GPUs, so Ray sets the devices it may
    use. Engines are named actors in ENGINE_NAMESPACE. `shared` returns the running
    engine of that name if there is one and otherwise starts it detached, so every
    router replica (and a restarted one) drives the same engines.
    """
    options: dict = {}
    if shared:
        options = {"get_if_exists": True, "lifetime": "detached"}
    actor = EngineActor.options(
        name=engine_id,
        namespace=ENGINE_NAMESPACE,
        resources={config.resource_name: config.tp},
        num_gpus=config.num_gpus,
        num_cpus=0,
        max_concurrency=1000,
        **options,
    ).remote(engine_id, config)
    return EngineHandle(engine_id, config, actor)


def engine_ids(cluster: ClusterConfig) -> list[tuple[str, EngineConfig]]:
    """(id, config) per engine of `cluster`; ids are `<cluster>-<gpu>-<n>`, with the role
    before the GPU in disaggregated mode (`<cluster>-decode-A40-2`)."""
    named = []
    for i, config in enumerate(cluster.engines()):
        tag = config.gpu_type if config.tp == 1 else f"{config.tp}x{config.gpu_type}"
        if config.role != EngineRole.UNIFIED:
            tag = f"{config.role.value}-{tag}"
        connector = config.kv_connector
        if connector is not None and connector.side_channel_port is not None:
            # one handshake port per engine: engines of a group share one config
            port = connector.side_channel_port + i
            config = config.model_copy(update={
                "kv_connector": connector.model_copy(update={"side_channel_port": port})})
        named.append((f"{cluster.name}-{tag}-{i}", config))
    return named


def launch_cluster(
    cluster: ClusterConfig, start: bool = True, shared: bool = False
) -> list[EngineHandle]:
    """One actor per engine of `cluster` (see `launch_engine` for `shared`)."""
    handles = [launch_engine(eid, config, shared) for eid, config in engine_ids(cluster)]
    if start:
        ray.get([h.actor.start.remote() for h in handles])
    return handles


def shutdown_engines(handles: list[EngineHandle], timeout_s: float | None = None) -> None:
    ray.get([h.actor.shutdown.remote() for h in handles], timeout=timeout_s)
    for h in handles:
        ray.kill(h.actor)


def shutdown_shared_engines(cluster: ClusterConfig) -> None:
    """Stop the named engines of `cluster` that are running (`launch_engine(shared=True)`),
    without starting the missing ones."""
    handles = []
    for engine_id, config in engine_ids(cluster):
        try:
            actor = ray.get_actor(engine_id, namespace=ENGINE_NAMESPACE)
        except ValueError:  # not running
            continue
        handles.append(EngineHandle(engine_id, config, actor))
    shutdown_engines(handles)


async def collect_tokens(handle: EngineHandle, request: EngineRequest) -> list[TokenEvent]:
    """Run one request to completion through the streaming actor call."""
    stream = handle.actor.generate.options(num_returns="streaming").remote(request)
    events: list[TokenEvent] = []
    async for ref in stream:
        events.extend(await ref)
    return events
