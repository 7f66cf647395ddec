"""Start engine actors pinned to GPU kinds, locally or on a real Ray cluster.

Pinning uses a custom resource per GPU kind (`gpu_type:H800`). Nodes of a real
cluster declare it in cluster.yaml; a local run declares the same resources on
the one local node, so one config pins identically in both places.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import ray

from app.control.config import InventoryItem
from app.control.fleet import engine_name
from app.engines.config import ClusterConfig, EngineConfig, gpu_resource_name
from app.engines.messages import EngineRequest, TokenEvent
from deployments.engine import EngineActor, generate_on

ENGINE_NAMESPACE = "goodserve"  # engines are looked up by name from Serve replicas

# Serve kills an HTTP proxy not ready within 5 s (health check: 10 s), and `serve.start`
# then fails. A local node shared with other CPU-bound work can take longer than that to
# start a worker, so a local instance gives its proxies a minute; a user's own setting
# of these variables wins.
LOCAL_SERVE_ENV = {
    "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60",
    "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "60",
}


def use_local_serve_env() -> None:
    """Set `LOCAL_SERVE_ENV` where unset, before a local Ray starts: its processes, the
    Serve controller's among them, inherit this process's environment."""
    for name, value in LOCAL_SERVE_ENV.items():
        os.environ.setdefault(name, value)


ROUTER_RESOURCE = "router"  # what only CPU nodes declare (cluster.yaml's head)

# How fast Ray's GCS finds a lost node dead: a health check a second, three missed.
# Ray's default (every 3 s, five missed) leaves 15-30 s in which a Serve replica that
# was streaming to the lost node holds its event loop (a streaming call waits, at its
# end, for the dead caller to acknowledge every item), so a router replica answers
# nothing while a proxy or ingress on that node is not yet found dead. cluster.yaml's
# head sets the same.
NODE_HEALTH_CHECK = {"health_check_period_ms": 1000, "health_check_failure_threshold": 3}


class LocalNodes:
    """Ray's own multi-node test cluster (`ray.cluster_utils.Cluster`) on this machine,
    shaped as cluster.yaml shapes a real one: a head for Serve's controller and proxy
    that declares no GPU kind, CPU nodes declaring `ROUTER_RESOURCE` (a config with
    `router_resources` keeps the routers, the ingress and the controller there: the
    head itself when `router_nodes` is 0), and a node per engine of `cluster` declaring
    its kind (`gpu_type:<GPU>`, tp units), plus `spare_per_kind` more per kind for the
    engines lost with a node. Connected on entry; every node stopped on exit."""

    def __init__(self, cluster: ClusterConfig, spare_per_kind: int = 0,
                 router_nodes: int = 0, head_cpus: int = 2) -> None:
        self.cluster, self.spare_per_kind, self.head_cpus = cluster, spare_per_kind, head_cpus
        self.router_nodes = router_nodes
        self.nodes = None

    def __enter__(self) -> LocalNodes:
        from ray.cluster_utils import Cluster

        use_local_serve_env()
        routers = {ROUTER_RESOURCE: 1000}
        self.nodes = Cluster(initialize_head=True, head_node_args={
            "num_cpus": self.head_cpus, "resources": {} if self.router_nodes else routers,
            "include_dashboard": False, "_system_config": NODE_HEALTH_CHECK})
        for _ in range(self.router_nodes):
            self.nodes.add_node(num_cpus=0, resources=routers)
        engines = self.cluster.engines()
        kinds = {e.resource_name: e.tp for e in engines}
        spares = [(name, tp) for name, tp in kinds.items() for _ in range(self.spare_per_kind)]
        for name, tp in [(e.resource_name, e.tp) for e in engines] + spares:
            self.nodes.add_node(num_cpus=0, resources={name: tp})
        self.nodes.connect()
        return self

    def __exit__(self, *exc_info: object) -> None:
        ray.shutdown()
        if self.nodes is not None:
            self.nodes.shutdown()

    def node_of(self, actor_name: str) -> str:
        """The id of the node a live named actor runs on (KeyError: none)."""
        for actor in ray._private.state.actors().values():  # the GCS actor table
            if actor.get("Name") == actor_name and actor["State"] == "ALIVE":
                return actor["Address"]["NodeID"]
        raise KeyError(f"no live actor named {actor_name}")

    def kinds_of_nodes(self) -> dict[str, set[str]]:
        """Each live node's id -> the GPU kinds it declares."""
        return {n["NodeID"]: {r for r in n["Resources"] if r.startswith("gpu_type:")}
                for n in ray.nodes() if n["Alive"]}

    def remove(self, node_id: str) -> None:
        """Kill a worker node's every process at once, as a lost machine."""
        assert self.nodes is not None
        node = next(n for n in self.nodes.worker_nodes if n.node_id == node_id)
        self.nodes.remove_node(node, allow_graceful=False)


@dataclass(frozen=True)
class EngineHandle:
    """A started engine actor and what it serves."""

    engine_id: str
    config: EngineConfig
    actor: ray.actor.ActorHandle


def local_node_resources(cluster: ClusterConfig,
                         inventory: Sequence[InventoryItem] = ()) -> dict[str, float]:
    """Custom resources a single local node must declare to host `cluster`, or all of
    a controller's `inventory` at once when that needs more."""
    counts: Counter[str] = Counter()
    for engine in cluster.engines():
        counts[engine.resource_name] += engine.tp
    for item in inventory:
        name = gpu_resource_name(item.gpu_type)
        counts[name] = max(counts[name], item.tp * item.count)
    return {name: float(n) for name, n in counts.items()}


def init_local_ray(cluster: ClusterConfig, num_cpus: int | None = None,
                   inventory: Sequence[InventoryItem] = (),
                   metrics_export_port: int | None = None,
                   metrics_report_interval_ms: int | None = None) -> None:
    """Start (or join) a local Ray instance that can place every engine of `cluster`
    (and of a controller's `inventory`); with `metrics_export_port`, Ray's Prometheus
    endpoint (GoodServe's series included) listens there, as `ray start
    --metrics-export-port` does, refreshed every `metrics_report_interval_ms`
    (Ray's default 10 s when None)."""
    if ray.is_initialized():
        return
    use_local_serve_env()
    system_config = ({} if metrics_report_interval_ms is None
                     else {"metrics_report_interval_ms": metrics_report_interval_ms})
    ray.init(
        address="local",  # a new instance, never one a `ray start` left behind
        num_cpus=num_cpus,
        resources=local_node_resources(cluster, inventory),
        include_dashboard=False,
        log_to_driver=False,
        _metrics_export_port=metrics_export_port,
        _system_config=system_config or None,
    )


def launch_engine(engine_id: str, config: EngineConfig, shared: bool = False,
                  owner: str | None = None) -> EngineHandle:
    """Create one actor on a node of its GPU kind; vLLM actors need no Ray CPU slot
    (the engine core runs in its own process), so small machines can host several.

    An engine holds one unit of its `gpu_type:<GPU>` resource per GPU (tp units), and
    a vLLM engine on a real GPU also holds tp Ray GPUs, so Ray sets the devices it may
    use. Engines are named actors in ENGINE_NAMESPACE. `shared` returns the running
    engine of that name if there is one and otherwise starts it detached (engines
    started outside a controller, shared by name). An `owner` (a controller's name)
    starts it detached under that owner, which stops it with its application.
    """
    options: dict = {}
    if shared:
        options = {"get_if_exists": True, "lifetime": "detached"}
    elif owner is not None:
        options = {"lifetime": "detached"}
    actor = EngineActor.options(
        name=engine_id,
        namespace=ENGINE_NAMESPACE,
        resources={config.resource_name: config.tp},
        num_gpus=config.num_gpus,
        num_cpus=0,
        max_concurrency=1000,
        **options,
    ).remote(engine_id, config, owner)
    return EngineHandle(engine_id, config, actor)


def engine_ids(cluster: ClusterConfig) -> list[tuple[str, EngineConfig]]:
    """(id, config) per configured engine of `cluster` (ids from `engine_name`)."""
    return [(engine_name(cluster.name, config, i), numbered_config(config, i))
            for i, config in enumerate(cluster.engines())]


def numbered_config(config: EngineConfig, index: int) -> EngineConfig:
    """Engine number `index`'s config: its own KV handshake port (engines of a group
    share one config, and each needs a port of its own)."""
    connector = config.kv_connector
    if connector is None or connector.side_channel_port is None:
        return config
    port = connector.side_channel_port + index
    return config.model_copy(update={
        "kv_connector": connector.model_copy(update={"side_channel_port": port})})


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


async def collect_tokens(handle: EngineHandle, request: EngineRequest) -> list[TokenEvent]:
    """Run one request to completion through the streaming actor call."""
    return [event async for batch in generate_on(handle.actor, request) for event in batch]
