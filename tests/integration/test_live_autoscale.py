"""The SARA controller live: a step load on simulated engines over Ray Serve grows the
pools, the step down shrinks them, no request is lost, and killing the controller
mid-step changes none of that."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from app.serving.config import load_serve_config
from tests.conftest import serving

pytestmark = pytest.mark.integration

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "local-sim-autoscale.yaml"
PROMPT = "route me " * 50
MAX_TOKENS = 32
STEP = ((3.0, 12.0), (0.5, 20.0))  # (req/s, seconds): the step up, then the step down
# A registry change reaches the routers within this. The routers long-poll the
# controller; on two cores under the full test run one change took over 0.3 s to arrive.
ROUTED_WITHIN_S = 1.0


def elastic_config(name: str):
    """configs/local-sim-autoscale.yaml under cluster `name`, deciding every second."""
    base = load_serve_config(CONFIG)
    controller = base.controller.model_copy(update={
        "interval_s": 1.0, "startup_s": 1.0, "scale_down_after_s": 2.0, "cooldown_s": 2.0,
        "drain_deadline_s": 1.0})
    cluster = base.cluster.model_copy(update={"name": name})
    return base.model_copy(update={"cluster": cluster, "controller": controller,
                                   "default_slo_s": 30.0})


@dataclass
class RegistryLog:
    """Every registry the controller publishes, with when it was seen."""

    controller: object
    seen: list[tuple[float, object]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self._thread = threading.Thread(target=self._follow, daemon=True)
        self._thread.start()

    def _follow(self) -> None:
        import ray

        known = None
        while not self._stop.is_set():
            try:
                registry = ray.get(self.controller.registry.remote(known, 0.5), timeout=10)
            except Exception:  # restarting: ask again
                time.sleep(0.2)
                continue
            if registry is not None:
                self.seen.append((time.time(), registry))
                known = registry.key

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=15)

    def __enter__(self) -> RegistryLog:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def active_at(self, t: float) -> set[str]:
        """Engines taking requests in the registry in force at `t`."""
        current = set()
        for seen_s, registry in self.seen:
            if seen_s > t:
                break
            current = set(registry.serving_ids())
        return current

    def active_during(self, start_s: float, end_s: float) -> set[str]:
        """Engines taking requests in any registry in force between the two times."""
        active = self.active_at(start_s)
        for seen_s, registry in self.seen:
            if start_s < seen_s <= end_s:
                active |= set(registry.serving_ids())
        return active

    def max_serving(self) -> int:
        return max(len(r.serving_ids()) for _, r in self.seen)


async def drive(url: str, phases, during=None) -> list[tuple[float, float, int, dict]]:
    """Send requests at each phase's rate; (send time, reply time, status, body) per
    request. `during(elapsed_s)` runs between sends."""
    async with httpx.AsyncClient(timeout=120) as client:
        async def one(sent_s: float):
            reply = await client.post(url + "/v1/completions", json={
                "model": "goodserve", "prompt": PROMPT, "max_tokens": MAX_TOKENS,
                "ignore_eos": True})
            return sent_s, time.time(), reply.status_code, reply.json()

        tasks, start = [], time.monotonic()
        for due_s in send_offsets(phases):
            await asyncio.sleep(max(start + due_s - time.monotonic(), 0.0))
            if during is not None:
                during(time.monotonic() - start)
            tasks.append(asyncio.ensure_future(one(time.time())))
        return await asyncio.gather(*tasks)


def send_offsets(phases) -> list[float]:
    """Seconds from the start at which to send, evenly at each (rate, seconds) phase's
    rate."""
    offsets, offset = [], 0.0
    for rate, seconds in phases:
        offsets += [offset + i / rate for i in range(int(rate * seconds))]
        offset += seconds
    return offsets


def settle(controller, timeout_s: float = 60.0) -> dict:
    """Wait until one engine serves and none drains or starts; the controller's status."""
    import ray

    deadline_s = time.monotonic() + timeout_s
    while True:
        status = ray.get(controller.status.remote(), timeout=30)
        states = [e["state"] for e in status["engines"]]
        if states == ["active"] or time.monotonic() > deadline_s:
            return status
        time.sleep(0.5)


def assert_grew_and_shrank(log: RegistryLog, status: dict) -> None:
    """The step up grew the pool to two engines or more; it settled back to one after a
    drain."""
    assert log.max_serving() >= 2, "the step up did not grow the pool"
    assert [e["state"] for e in status["engines"]] == ["active"], status
    assert any(step["drain"] for step in status["steps"]), "nothing was drained"


def assert_served_all(results) -> None:
    failed = [(code, body) for *_, code, body in results if code != 200]
    assert not failed, failed[:3]
    assert all(body["usage"]["completion_tokens"] == MAX_TOKENS for *_, body in results)


def controller_of(name: str):
    import ray

    from deployments.cluster import ENGINE_NAMESPACE
    from deployments.controller import controller_name

    return ray.get_actor(controller_name(name), namespace=ENGINE_NAMESPACE)


def test_a_step_load_grows_and_shrinks_the_pools_with_nothing_lost(ray_session):
    with serving(elastic_config("elastic"), "elastic") as url:
        controller = controller_of("elastic")
        with RegistryLog(controller) as log:
            results = asyncio.run(drive(url, STEP))
            status = settle(controller)
        assert_served_all(results)
        assert_grew_and_shrank(log, status)
        # every published registry differs from the one before it, under a new version
        for (_, before), (_, after) in zip(log.seen, log.seen[1:], strict=False):
            assert after.key != before.key
            assert after.members != before.members
        # every request went to an engine serving at some time between a router's lagged
        # view of its send and its reply (a busy proxy can route it well after the send)
        for sent_s, replied_s, _, body in results:
            first = body["goodserve"]["instance_ids"][0]
            active = log.active_during(sent_s - ROUTED_WITHIN_S, replied_s)
            if active and first not in active:  # empty: no registry seen yet
                pytest.fail(f"{first} took a request it was not serving for: sent at "
                            f"{sent_s:.2f}, replied at {replied_s:.2f}, registries seen at "
                            f"{[(round(t, 2), sorted(r.serving_ids())) for t, r in log.seen]}")


def test_killing_the_controller_mid_step_loses_nothing_and_the_pools_converge(ray_session):
    import ray

    with serving(elastic_config("elastic-kill"), "elastic-kill") as url:
        controller = controller_of("elastic-kill")
        before = ray.get(controller.status.remote())["incarnation"]
        killed = []

        def kill_once(elapsed_s: float) -> None:
            if not killed and elapsed_s > 6.0:
                ray.kill(controller, no_restart=False)  # Ray restarts it
                killed.append(elapsed_s)

        results = asyncio.run(drive(url, STEP, during=kill_once))
        status = settle(controller)
        assert killed
        assert status["incarnation"] != before, "the controller was not restarted"
        assert_served_all(results)
        assert [e["state"] for e in status["engines"]] == ["active"], status
        assert all(e["owned"] for e in status["engines"])
