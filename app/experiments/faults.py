"""Faults during a live replay: what happens to every request when an engine actor, a
router replica or Ray Serve's HTTP proxy is killed mid-run.

Each scenario serves the config (two router replicas), sends greedy completions (every
other one streamed, each with its `X-Request-Id`) at a fixed rate from client threads,
kills one part a third of the way in and waits for every request. A client sends a
request again as the OpenAI client does: twice, on a broken connection or a 5xx, with
the same id; a stream resumes after the last event it read (`Last-Event-ID`). A
request ends one of four ways:
- completed: the client holds the whole answer (a 200 with its tokens, or a stream
  through its finish reason and `[DONE]`); the shared-prompt ones are checked against
  an unfaulted run, and every one that moved between engines or was sent again is sent
  once more after the fault and must give the same text (all requests are greedy);
- rejected: a 4xx / 503 OpenAI error, by its type (`slo_unattainable`, ...);
- failed: a clear error, by kind (`engine_error`, an HTTP 500 from Ray Serve, a
  connection the server closed);
- lost: no answer within the client's timeout (a hang), or no record at all.
A request the application never saw is sent again for up to `CONNECT_WAIT_S` (what a
load balancer does in front of several proxies): a refused connection, and Ray Serve's
plain-text 404 from a new proxy that has not learnt the application's routes yet. On
one node the proxy takes about half a minute to come back after it dies.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import threading
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import typer

from app.serving.config import ServeConfig

if TYPE_CHECKING:
    from deployments.cluster import LocalNodes

GREEDY_PROMPT = "same every time"
CONNECT_WAIT_S = 60.0


class Fault(StrEnum):
    NONE = "none"
    ENGINE = "engine"  # the engine actor carrying the most requests
    ROUTER = "router"  # one of the router deployment's replicas
    PROXY = "proxy"  # Ray Serve's HTTP proxy actor
    NODE = "node"  # a whole Ray node: the one running the busiest engine
    CONTROLLER_NODE = "controller-node"  # the CPU node running the controller
    ROUTER_NODE = "router-node"  # a CPU node running a router replica, not the controller


NODE_FAULTS = frozenset({Fault.NODE, Fault.CONTROLLER_NODE, Fault.ROUTER_NODE})
CPU_NODE_FAULTS = frozenset({Fault.CONTROLLER_NODE, Fault.ROUTER_NODE})


@dataclass
class ScenarioResult:
    """Every request of one scenario, by how it ended."""

    scenario: str
    killed: str
    sent: int = 0
    completed: int = 0
    rejected: Counter[str] = field(default_factory=Counter)
    failed: Counter[str] = field(default_factory=Counter)
    lost: int = 0
    greedy_checked: int = 0  # completed shared-prompt requests compared with the unfaulted text
    greedy_kept: int = 0  # ... and equal to it
    moved: int = 0  # completed requests that ran on more than one engine
    moved_kept: int = 0  # moved ones whose text an unfaulted resend gives again
    retries: int = 0  # sends beyond each request's first (refused, unrouted, 5xx, broken)
    retried: int = 0  # completed requests sent more than once
    retried_kept: int = 0  # ... whose text an unfaulted resend gives again
    replaced: bool | None = None  # router / node fault: a new one runs in its place
    engines_on_their_kind: bool | None = None  # node fault: each engine on a node of its GPU
    dropped_after_s: float | None = None  # node fault: until no router lists its engines
    messages: dict[str, str] = field(default_factory=dict)  # each reason's first error text

    def as_dict(self) -> dict:
        return asdict(self) | {"rejected": dict(self.rejected), "failed": dict(self.failed)}


def unrouted(reply: httpx.Response) -> bool:
    """A proxy's own 404 ("Path ... not found"): it does not know the application's
    routes yet, so the request never reached the application (whose 404s are OpenAI
    JSON errors)."""
    return reply.status_code == 404 and reply.text.startswith("Path '")


MAX_RETRIES = 2  # the OpenAI client's default: a 408 / 409 / 429 / 5xx or a broken
# connection is sent again (same request id) after 0.5 s, then 1 s (its backoff)
RETRYABLE_STATUS = frozenset({408, 409, 429})


def backoff_s(retry: int) -> float:
    return min(0.5 * 2**retry, 8.0)


@dataclass
class StreamProgress:
    """What a streaming client holds: the text, the id of the last event it read (sent
    back as `Last-Event-ID` when it reconnects) and how the stream ended."""

    text: str = ""
    last_event_id: str | None = None
    finish_reason: str | None = None
    done: bool = False  # `[DONE]` came
    error: str | None = None  # an error event's type
    summary: dict | None = None  # the closing chunk's `goodserve` summary

    def take(self, lines: Iterable[str]) -> None:
        """A stream's lines; an event's id counts once its data is read."""
        pending_id = None
        for line in lines:
            if line.startswith("id: "):
                pending_id = line.removeprefix("id: ")
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                self.done = True
                return
            chunk = json.loads(data)
            if "error" in chunk:
                self.error = chunk["error"].get("type") or "error"
                continue
            for choice in chunk.get("choices", ()):
                self.text += choice.get("text") or ""
                self.finish_reason = choice.get("finish_reason") or self.finish_reason
            self.summary = chunk.get("goodserve", self.summary)
            if pending_id is not None:
                self.last_event_id, pending_id = pending_id, None

    def reply(self) -> dict:
        """The stream as the whole reply would read."""
        return {"choices": [{"text": self.text, "finish_reason": self.finish_reason}],
                "goodserve": self.summary or {"instance_ids": []}}


class _Client:
    """One request per call, named by its id and sent again as the OpenAI client does
    (and a stream resumed after its last event); classifies how it ended: completed
    only when the client holds the whole answer."""

    def __init__(self, url: str, timeout_s: float, max_retries: int = MAX_RETRIES) -> None:
        self.url = url
        self.timeout_s = timeout_s
        self.max_retries = max_retries

    def send(self, body: dict, request_id: str | None = None
             ) -> tuple[str, str, dict | None, int]:
        """(outcome, reason, reply body, retries); outcome completed / rejected / failed /
        lost."""
        give_up_s = time.monotonic() + CONNECT_WAIT_S
        attempt = 0
        num_retries = 0
        progress = StreamProgress()
        headers = ({} if request_id is None
                   else {"X-Request-Id": request_id, "Accept": "text/event-stream"})
        while True:
            try:
                if body.get("stream"):
                    outcome = self._stream(body, headers, progress)
                else:
                    outcome = self._classify(httpx.post(
                        self.url + "/v1/completions", json=body, headers=headers,
                        timeout=self.timeout_s))
            except httpx.ConnectError:
                if time.monotonic() > give_up_s:
                    return "failed", "connection refused", None, attempt
                attempt += 1
                time.sleep(1.0)
                continue
            except httpx.TimeoutException:
                return "lost", "no answer in time", None, attempt
            except httpx.HTTPError:  # the server closed the connection mid-request
                outcome = ("failed", "connection closed", None)
            if outcome[1] == "unrouted" and time.monotonic() <= give_up_s:
                attempt += 1
                time.sleep(1.0)
                continue
            if retryable(*outcome[:2]) and num_retries < self.max_retries and request_id:
                time.sleep(backoff_s(num_retries))
                num_retries += 1
                attempt += 1
                continue
            return (*outcome, attempt)

    def _stream(self, body: dict, headers: dict[str, str],
                progress: StreamProgress) -> tuple[str, str, dict | None]:
        if progress.last_event_id is not None:
            headers = headers | {"Last-Event-ID": progress.last_event_id}
        with httpx.stream("POST", self.url + "/v1/completions", json=body, headers=headers,
                          timeout=self.timeout_s) as reply:
            if reply.status_code != 200:
                reply.read()
                return self._classify(reply)
            progress.take(reply.iter_lines())
        if progress.error is not None:
            return "failed", progress.error, None
        if not progress.done or progress.finish_reason is None:
            return "failed", "connection closed", None
        return "completed", "", progress.reply()

    @staticmethod
    def _classify(reply: httpx.Response) -> tuple[str, str, dict | None]:
        if unrouted(reply):
            return "failed", "unrouted", None
        try:
            data = reply.json()
        except ValueError:
            data = None
        if reply.status_code == 200 and data is not None:
            return "completed", "", data
        error = (data or {}).get("error", {}) if isinstance(data, dict) else {}
        reason = error.get("type") or f"HTTP {reply.status_code}"
        if 400 <= reply.status_code < 500 or reply.status_code == 503:
            return "rejected", reason, data
        return "failed", reason, data


def retryable(outcome: str, reason: str) -> bool:
    """What the OpenAI client sends again: a broken connection or a 5xx (a 503 is a
    rejection here, counted as such), and a 408, 409 or 429."""
    if outcome == "failed":
        return True
    return outcome == "rejected" and any(reason == f"HTTP {s}" for s in RETRYABLE_STATUS)


def kill(fault: Fault, url: str, app_name: str) -> str:
    """Kill the part `fault` names (a node: `kill_node`); what was killed."""
    import ray

    from deployments.cluster import ENGINE_NAMESPACE

    if fault is Fault.NONE:
        return "nothing"
    if fault is Fault.ENGINE:
        name = busiest_engine(url)
        ray.kill(ray.get_actor(name, namespace=ENGINE_NAMESPACE), no_restart=True)
        return name
    prefix = replica_prefix(app_name) if fault is Fault.ROUTER else "SERVE_PROXY_ACTOR"
    names = actor_names(prefix)
    if not names:
        raise RuntimeError(f"no actor named {prefix}* to kill")
    ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)  # Serve restarts it
    return names[0]


def replica_prefix(app_name: str, deployment: str = "RouterDeployment") -> str:
    """How Ray Serve names the actors of an application's deployment's replicas."""
    return f"SERVE_REPLICA::{app_name}#{deployment}#"


def actor_names(prefix: str) -> list[str]:
    """The live named actors whose name starts with `prefix`, in any namespace, sorted."""
    import ray

    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["name"].startswith(prefix))


def busiest_engine(url: str, wait_s: float = 10.0) -> str:
    """The engine carrying the most requests, once one carries any (up to `wait_s`)."""
    give_up_s = time.monotonic() + wait_s
    while True:
        rows = httpx.get(url + "/v1/instances", timeout=30).json()["instances"]
        load = {r["instance_id"]: (r["num_running"] or 0) + (r["num_waiting"] or 0)
                for r in rows}
        busiest = max(load, key=load.__getitem__)
        if load[busiest] > 0 or time.monotonic() > give_up_s:
            return busiest
        time.sleep(0.05)


def kill_node(url: str, nodes: LocalNodes, engines: set[str]) -> tuple[str, set[str]]:
    """Kill the node of the busiest engine: (what was killed, `engines` it ran)."""
    busiest = busiest_engine(url)
    victim = nodes.node_of(busiest)
    on_node = {e for e in engines if nodes.node_of(e) == victim}
    nodes.remove(victim)
    return f"the node of {busiest}", on_node


def kill_cpu_node(fault: Fault, config: ServeConfig, nodes: LocalNodes,
                  app_name: str) -> tuple[str, str]:
    """Kill the CPU node that runs the controller (`CONTROLLER_NODE`), or one that runs a
    router replica and not the controller (`ROUTER_NODE`, else any with a replica):
    (what was killed, with the parts it took; the node's id)."""
    from deployments.controller import controller_name

    controller = nodes.node_of(controller_name(config.cluster.name))
    replicas = {name: nodes.node_of(name)
                for name in actor_names(replica_prefix(app_name))}
    if fault is Fault.CONTROLLER_NODE:
        victim = controller
    else:
        victim = next((n for n in replicas.values() if n != controller),
                      next(iter(replicas.values())))
    ingress = {nodes.node_of(name) for name in actor_names(
        replica_prefix(app_name, "IngressDeployment"))}
    parts = [*(["the controller"] if victim == controller else []),
             f"{sum(n == victim for n in replicas.values())} of {len(replicas)} router "
             "replicas", *(["the ingress"] if victim in ingress else [])]
    nodes.remove(victim)
    return "a CPU node: " + ", ".join(parts), victim


def parts_back(config: ServeConfig, app_name: str, nodes: LocalNodes, lost_node: str,
               wait_s: float = 120.0) -> bool:
    """Whether the controller and every router replica run again off `lost_node` (Ray
    may list them there until it finds the node dead), the controller answering (up to
    `wait_s`)."""
    import ray

    from deployments.cluster import ENGINE_NAMESPACE
    from deployments.controller import controller_name

    give_up_s = time.monotonic() + wait_s
    while time.monotonic() < give_up_s:
        try:
            name = controller_name(config.cluster.name)
            replicas = actor_names(replica_prefix(app_name))
            if (len(replicas) >= config.num_router_replicas
                    and lost_node not in {nodes.node_of(n) for n in [name, *replicas]}):
                controller = ray.get_actor(name, namespace=ENGINE_NAMESPACE)
                ray.get(controller.status.remote(), timeout=10)
                return True
        except (KeyError, ValueError, ray.exceptions.RayError):
            pass
        time.sleep(1.0)
    return False


def engines_on_their_kind(config: ServeConfig, nodes: LocalNodes, engines: set[str]) -> bool:
    """Whether each configured engine runs on a node of its GPU kind alone."""
    from deployments.cluster import engine_ids

    kinds = nodes.kinds_of_nodes()
    configured = dict(engine_ids(config.cluster))
    return engines == set(configured) and all(
        kinds[nodes.node_of(e)] == {configured[e].resource_name} for e in engines)


def engines_listed(url: str) -> set[str]:
    """The engines a router replica routes over: listed and in rotation."""
    return {r["instance_id"] for r in httpx.get(url + "/v1/instances", timeout=30).json()[
        "instances"] if r["healthy"]}


def node_loss(url: str, lost: set[str], num_engines: int, killed_s: float,
              wait_s: float = 120.0) -> tuple[float | None, bool]:
    """(seconds from the kill until no router replica asked routes over an engine of
    the lost node, None: not within `wait_s`; whether `num_engines` engines serve
    again)."""
    give_up_s = time.monotonic() + wait_s
    dropped_after_s = None
    while time.monotonic() < give_up_s:
        listed = engines_listed(url)
        if dropped_after_s is None and not listed & lost:
            dropped_after_s = time.monotonic() - killed_s
        if dropped_after_s is not None and len(listed) >= num_engines:
            return dropped_after_s, True
        time.sleep(0.1)
    return dropped_after_s, False


def run_scenario(config: ServeConfig, fault: Fault, num_requests: int, rate: float,
                 max_tokens: int = 60, timeout_s: float = 120.0,
                 client_retries: int = MAX_RETRIES,
                 nodes: LocalNodes | None = None) -> ScenarioResult:
    """Serve `config`, send `num_requests` at `rate`, kill `fault` a third of the way in;
    each client sends a request again at most `client_retries` times. A node fault
    needs `nodes`, the cluster the application runs on."""
    from deployments.router import serving

    app_name = f"faults-{fault.value}"
    with serving(config, app_name) as url:
        client = _Client(url, timeout_s, client_retries)
        greedy = {"model": config.served_model_names[0], "prompt": GREEDY_PROMPT,
                  "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
        _, _, unfaulted, _ = client.send(greedy)
        reference = None if unfaulted is None else unfaulted["choices"][0]["text"]
        result = ScenarioResult(fault.value, killed="")
        lock = threading.Lock()
        moved: list[tuple[dict, str]] = []  # (body, text) of completed requests that moved
        retried: list[tuple[dict, str]] = []  # ... that were sent more than once

        def one(i: int) -> None:
            time.sleep(i / rate)
            body = greedy if i % 5 == 0 else greedy | {"prompt": f"request {i} " * 20}
            body = body | {"stream": i % 2 == 1}  # every other one streamed
            outcome, reason, data, retries = client.send(body, f"{app_name}-{i}")
            with lock:
                result.sent += 1
                result.retries += retries
                if outcome == "completed":
                    assert data is not None
                    result.completed += 1
                    text = data["choices"][0]["text"]
                    if len(set(data["goodserve"]["instance_ids"])) > 1:
                        result.moved += 1
                        moved.append((body, text))
                    if retries:
                        result.retried += 1
                        retried.append((body, text))
                    if body["prompt"] == GREEDY_PROMPT and reference is not None:
                        result.greedy_checked += 1
                        result.greedy_kept += data["choices"][0]["text"] == reference
                elif outcome == "lost":
                    result.lost += 1
                else:
                    getattr(result, outcome)[reason] += 1
                    error = (data or {}).get("error") if isinstance(data, dict) else None
                    if isinstance(error, dict) and error.get("message"):
                        result.messages.setdefault(reason, str(error["message"]))

        engines = engines_listed(url)
        if nodes is not None:
            result.engines_on_their_kind = engines_on_their_kind(config, nodes, engines)
        elif fault in NODE_FAULTS:
            raise ValueError("a node fault needs a cluster of several nodes")
        if fault in CPU_NODE_FAULTS and not config.ingress_replicas:
            raise ValueError(f"a {fault.value} fault runs with an ingress (--ingress-replicas)")
        with concurrent.futures.ThreadPoolExecutor(num_requests) as pool:
            futures = [pool.submit(one, i) for i in range(num_requests)]
            time.sleep(num_requests / rate / 3)
            if fault is Fault.NODE:
                assert nodes is not None
                killed_s = time.monotonic()
                result.killed, on_node = kill_node(url, nodes, engines)
                result.dropped_after_s, result.replaced = node_loss(
                    url, on_node, len(engines), killed_s)
            elif fault in CPU_NODE_FAULTS:
                assert nodes is not None
                result.killed, lost_node = kill_cpu_node(fault, config, nodes, app_name)
                result.replaced = parts_back(config, app_name, nodes, lost_node)
            else:
                result.killed = kill(fault, url, app_name)
            done, _ = concurrent.futures.wait(
                futures, timeout=num_requests / rate + CONNECT_WAIT_S + 2 * timeout_s)
        result.lost += num_requests - result.sent  # threads that never recorded an end
        for future in done:
            future.result()  # a bug in the harness must show
        for body, text in moved:  # the same request again, nothing failing now
            _, _, again, _ = client.send(body)
            result.moved_kept += again is not None and again["choices"][0]["text"] == text
        for body, text in retried:
            _, _, again, _ = client.send(body)
            result.retried_kept += again is not None and again["choices"][0]["text"] == text
        if fault is Fault.ROUTER:
            result.replaced = replica_replaced(result.killed, app_name,
                                               config.num_router_replicas)
    return result


def replica_replaced(killed: str, app_name: str, num_replicas: int,
                     wait_s: float = 60.0) -> bool:
    """Whether Serve runs `num_replicas` router replicas again, none of them `killed`
    (up to `wait_s`)."""
    give_up_s = time.monotonic() + wait_s
    while True:
        names = actor_names(replica_prefix(app_name))
        if killed not in names and len(names) >= num_replicas:
            return True
        if time.monotonic() > give_up_s:
            return False
        time.sleep(0.5)


def faults_config(num_router_replicas: int = 2, ingress_replicas: int = 0) -> ServeConfig:
    """Three simulated engines (H800, A800, A40) behind two router replicas (and an
    ingress in front of them with `ingress_replicas`)."""
    from app.engines.config import ClusterConfig, EngineConfig, InstanceGroup

    groups = [InstanceGroup(engine=EngineConfig(gpu_type=g)) for g in ("H800", "A800", "A40")]
    return ServeConfig(cluster=ClusterConfig(name="faults", groups=groups),
                       default_slo_s=60.0, num_router_replicas=num_router_replicas,
                       ingress_replicas=ingress_replicas)


def table(results: list[ScenarioResult]) -> str:
    """The scenarios as a markdown table."""
    def counts(counter: Counter[str]) -> str:
        return ", ".join(f"{n} {reason}" for reason, n in counter.most_common()) or "0"

    lines = ["| fault | killed | sent | completed | rejected | failed | lost | greedy text kept |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        kept = f"{r.greedy_kept}/{r.greedy_checked}" if r.greedy_checked else "-"
        killed = ("1 of 2 router replicas" if r.killed.startswith("SERVE_REPLICA")
                  else "HTTP proxy" if r.killed.startswith("SERVE_PROXY") else r.killed)
        lines.append(f"| {r.scenario} | {killed} | {r.sent} | {r.completed} | "
                     f"{counts(r.rejected)} | {counts(r.failed)} | {r.lost} | {kept} |")
    return "\n".join(lines)


def write_results(results: list[ScenarioResult], out: Path, setup: dict) -> None:
    """faults.json (every figure, the setup) and faults.md (the table)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "faults.json").write_text(json.dumps(
        {"setup": setup, "scenarios": [r.as_dict() for r in results]}, indent=2))
    (out / "faults.md").write_text(table(results) + "\n")


def faults(
    scenario: list[Fault] = typer.Option(  # noqa: B008
        [Fault.NONE, Fault.ENGINE, Fault.ROUTER, Fault.PROXY], help="faults to run, in order"),
    config: str | None = typer.Option(
        None, help="serve config YAML (default: three simulated engines); run with two "
        "router replicas"),
    requests: int = typer.Option(60, min=3, help="requests per scenario"),
    rate: float = typer.Option(10.0, min=0.1, help="arrivals per second"),
    out: Path = typer.Option(Path("results/faults"), help="where faults.json and .md go"),  # noqa: B008
    ingress_replicas: int = typer.Option(
        0, min=0, help="an ingress in front of the routers, with this many replicas, that "
        "retries a request on a live router replica"),
    client_retries: int = typer.Option(
        MAX_RETRIES, min=0, help="times a client sends a request again (the OpenAI "
        "client's default: 2)"),
) -> None:
    """Kill an engine, a router replica or the HTTP proxy during a live replay; print
    how every request ended."""
    import ray

    from app.serving.config import load_serve_config
    from deployments.cluster import ROUTER_RESOURCE, LocalNodes, init_local_ray

    try:
        serve_config = (faults_config(ingress_replicas=ingress_replicas) if config is None
                        else load_serve_config(config).model_copy(update={
                            "num_router_replicas": 2, "ingress_replicas": ingress_replicas}))
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=2) from None
    results = []
    num_node_faults = scenario.count(Fault.NODE)
    num_cpu_node_faults = sum(f in CPU_NODE_FAULTS for f in scenario)
    if num_node_faults or num_cpu_node_faults:
        # a node per engine and a spare per kind for each engine node lost; two CPU
        # nodes for the routers and the controller, and one more for each lost
        serve_config = serve_config.model_copy(
            update={"router_resources": {ROUTER_RESOURCE: 0.001}})
        nodes: LocalNodes | None = LocalNodes(
            serve_config.cluster, num_node_faults,
            router_nodes=1 + num_cpu_node_faults if num_cpu_node_faults else 0)
        context = nodes
    else:
        nodes = None
        init_local_ray(serve_config.cluster)
        context = contextlib.nullcontext()
    try:
        with context:
            for fault in scenario:
                typer.echo(f"scenario {fault.value}: {requests} requests at {rate:g} req/s ...")
                results.append(run_scenario(serve_config, fault, requests, rate,
                                            client_retries=client_retries, nodes=nodes))
    finally:
        ray.shutdown()
    setup = {"config": config or "three simulated engines",
             "engines": [e.instance.name for e in serve_config.cluster.engines()],
             "backend": serve_config.engine_template.backend.value,
             "router_replicas": serve_config.num_router_replicas,
             "ray_nodes": ("one" if nodes is None else
                           f"a head, {nodes.router_nodes} CPU nodes for the routers (0: the "
                           f"head), a node per engine and {num_node_faults} spare per kind"),
             "ingress_replicas": serve_config.ingress_replicas,
             "client_retries": client_retries, "requests": requests,
             "rate": rate, "max_tokens": 60, "greedy_every": 5}
    write_results(results, out, setup)
    typer.echo(table(results))
