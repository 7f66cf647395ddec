"""Faults during live traffic (`app/experiments/faults.py`, short versions; `make soak` runs
the long ones): an engine actor, a router replica (of two) or Ray Serve's HTTP proxy
killed while requests arrive. Every request completes or gets a clear error; none
hangs and none is lost; a request that moved between engines, or was sent again after
its router replica died, keeps the text an unfaulted run gives."""

from __future__ import annotations

import pytest

from app.experiments.faults import Fault, faults_config, run_scenario

pytestmark = pytest.mark.integration

REQUESTS = 40
RATE = 8.0


@pytest.fixture(scope="module")
def config():
    return faults_config(num_router_replicas=2)


def assert_none_lost(result) -> None:
    assert result.sent == REQUESTS and result.lost == 0, result
    assert not result.rejected, result  # 60-s deadlines: nothing is turned away
    assert result.greedy_kept == result.greedy_checked > 0, result
    assert result.moved_kept == result.moved, result  # moved ones kept their text


def test_an_engine_killed_mid_replay_completes_every_request_and_moved_ones_keep_their_text(
        ray_session, config):
    """Its requests move to the other engines by token ids: every request completes,
    some of them moved, and each moved one's text is what an unfaulted resend gives."""
    result = run_scenario(config, Fault.ENGINE, REQUESTS, RATE)
    assert_none_lost(result)
    assert result.completed == REQUESTS and not result.failed, result
    assert result.moved > 0, result


def test_a_router_replica_killed_mid_replay_loses_no_request(ray_session, config):
    """Half the requests stream. Those on the killed replica get Ray Serve's HTTP 500 or
    a broken stream; sent again with their id (as the OpenAI client does), the other
    replica re-attaches each where its engine runs it, a stream after its last event:
    every request completes with the text an unfaulted run gives, and Serve starts a
    replacement."""
    result = run_scenario(config, Fault.ROUTER, REQUESTS, RATE)
    assert_none_lost(result)
    assert result.completed == REQUESTS and not result.failed, result
    assert result.retried > 0 and result.retried_kept == result.retried, result
    assert result.replaced, result


def test_behind_an_ingress_a_router_replica_killed_mid_replay_fails_no_client(ray_session):
    """With an ingress in front, a client that never retries loses nothing: the ingress
    sends each request of the killed replica again, by its id, and the other replica
    re-attaches it (a stream after its last relayed event), so every request completes
    on the first send with the text an unfaulted run gives."""
    result = run_scenario(faults_config(num_router_replicas=2, ingress_replicas=1),
                          Fault.ROUTER, REQUESTS, RATE, client_retries=0)
    assert_none_lost(result)
    assert result.completed == REQUESTS and not result.failed, result
    assert result.retries == 0, result  # the clients sent each request once
    assert result.replaced, result


def test_a_restarted_proxy_closes_its_connections_and_serves_again(ray_session, config):
    """Connections open at the kill are closed (a clear error at the client); refused
    ones are sent again until the new proxy answers, and complete."""
    result = run_scenario(config, Fault.PROXY, REQUESTS, RATE)
    assert_none_lost(result)
    assert set(result.failed) <= {"connection closed"}, result
    assert result.retries > 0 and result.completed >= REQUESTS * 0.5, result


def test_two_router_replicas_serve_every_request_on_the_reports_one_poller_publishes(
        ray_session, config):
    """Both replicas long-poll the controller's status board (each engine answers one
    status call per period, not one per replica); every request is served, and the
    replicas hold the same reports to within one poll round and tell each other every
    request they saw finish."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    import ray

    from deployments.controller import controller_for
    from tests.conftest import serving

    named = config.model_copy(update={"cluster": config.cluster.model_copy(
        update={"name": "board"})})
    with serving(named, "board") as url:
        def complete(i: int) -> int:
            return httpx.post(url + "/v1/completions", timeout=120, json={
                "model": "goodserve", "prompt": f"board {i} " * 20, "max_tokens": 6,
            }).status_code

        with ThreadPoolExecutor(8) as pool:
            codes = list(pool.map(complete, range(REQUESTS)))
        assert codes == [200] * REQUESTS
        board = ray.get(controller_for(named).status.remote())["status_board"]
        followers = board["followers"]
        assert len(followers) == named.num_router_replicas == 2, board
        engines = len(list(named.cluster.engines()))
        versions = [f["version"] for f in followers.values()]
        assert max(versions) - min(versions) <= 2 * engines, board  # within one round
        assert board["version"] - min(versions) <= 2 * engines, board
        assert all(f["answered_s_ago"] < 1.0 for f in followers.values()), board
        assert board["tellers"] == sorted(followers), board  # both tell their budgets
        deadline_s = time.monotonic() + 5.0  # each tells its finishes at its next poll
        while board["finishes_told"] < REQUESTS and time.monotonic() < deadline_s:
            time.sleep(0.2)
            board = ray.get(controller_for(named).status.remote())["status_board"]
        assert board["finishes_told"] == REQUESTS, board  # each finish told once
