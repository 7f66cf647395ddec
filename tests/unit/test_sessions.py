"""Agent sessions: presets, the session trace format, and closed-loop release."""

from __future__ import annotations

import json

import numpy as np
import pytest

from app.config import load_cluster_config
from app.routing.registry import RoutingOptions, build_routing
from app.sessions import (
    AgentSession,
    AgentStep,
    SessionPreset,
    StepReleases,
    file_workload,
    iter_session_rows,
    load_session_trace,
    preset_workload,
    sessions_workload,
)
from app.sim.records import RequestOutcome
from app.sim.simulator import Simulator
from app.slo import assign_slos, reference_instance, solo_latencies_s
from app.workload import Arrivals, SyntheticArrivals

pytestmark = pytest.mark.unit

LIMIT = 131072


def _preset(preset: SessionPreset, seed: int = 0, rate: float = 0.2, duration: float = 300):
    return preset_workload(preset, SyntheticArrivals(Arrivals.POISSON, rate, duration), LIMIT,
                           seed=seed)


def _step(step_id, wait_for=(), wait=0.0, prompt=1000, out=10):
    return AgentStep(step_id, tuple(wait_for), wait, prompt, 100, out, (), 256)


def _leading_shared(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@pytest.mark.parametrize("preset", list(SessionPreset))
def test_presets_are_seeded(preset):
    a, b, c = _preset(preset, 1), _preset(preset, 1), _preset(preset, 2)
    assert a.requests == b.requests and a.graph == b.graph
    assert a.requests != c.requests


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_coding_agent_matches_the_published_shape(seed):
    """TraceLab: a median step holds ~0.6 of the context window, appends ~875 tokens and
    generates ~214; ~9 steps per session; ~4% of tool calls over a minute; >90% of
    prompt tokens are a prefix seen before (here >85%: first steps have only the
    app prefix cached)."""
    w = _preset(SessionPreset.CODING_AGENT, seed, rate=0.3)
    contexts = np.array([r.num_prompt_tokens for r in w.requests])
    assert 0.4 * LIMIT < np.median(contexts) < 0.75 * LIMIT
    assert contexts.max() + max(r.num_output_tokens for r in w.requests) <= LIMIT
    assert 500 < np.median([r.num_appended_tokens for r in w.requests[1:]]) < 1500
    assert 120 < np.median([r.num_output_tokens for r in w.requests]) < 350
    sessions = {r.session_id for r in w.requests}
    assert 5 < len(w.requests) / len(sessions) < 14
    waits = np.array([w.graph.tool_wait_s[i] for i, p in enumerate(w.graph.parents) if p])
    assert 0.02 < np.mean(waits > 60) < 0.08
    assert any(len(p) > 1 for p in w.graph.parents), "no step joins parallel calls"
    seen: set[int] = set()
    reused = total = 0
    for r in w.requests:
        hit = 0
        for h in r.block_hashes:
            if h not in seen:
                break
            hit += 1
        reused += hit * r.hash_block_size
        total += r.num_prompt_tokens
        seen.update(r.block_hashes)
    assert reused / total > 0.85


def test_a_step_extends_its_parents_context_and_apps_share_a_prefix():
    w = _preset(SessionPreset.CODING_AGENT, 0)
    by_index = w.requests
    for child, parents in enumerate(w.graph.parents):
        if not parents:
            continue
        parent = by_index[parents[0]]
        shared = _leading_shared(parent.block_hashes, by_index[child].block_hashes)
        compacted = by_index[child].num_prompt_tokens < parent.num_prompt_tokens
        if not compacted:  # the whole parent prompt's full blocks are reused
            assert shared == len(parent.block_hashes)
        assert by_index[child].session_id == parent.session_id
    firsts = [r for r, p in zip(w.requests, w.graph.parents, strict=True) if not p]
    same_app = [r for r in firsts if r.task == firsts[0].task]
    other_app = [r for r in firsts if r.task != firsts[0].task]
    prefix = int(0.08 * LIMIT) // 256
    assert _leading_shared(same_app[0].block_hashes, same_app[1].block_hashes) >= prefix
    assert _leading_shared(same_app[0].block_hashes, other_app[0].block_hashes) == 0


def test_releases_wait_for_every_parent_plus_the_tool_wait():
    session = AgentSession("s", 5.0, (_step("a"), _step("b", ["a"], 2.0),
                                      _step("c", ["a"], 1.0), _step("d", ["b", "c"], 3.0)))
    w = sessions_workload([session], 10.0, "t")
    releases = StepReleases(w.requests, w.graph)
    assert releases.first().time_s == 5.0
    assert releases.after_arrival(0) is None  # one session: no other first step
    ready, cancelled = releases.after_end(0, 7.0, finished=True)
    assert [(r.time_s, r.index) for r in ready] == [(9.0, 1), (8.0, 2)] and not cancelled
    for r in ready:
        releases.after_arrival(r.index)
    assert releases.after_end(2, 8.5, True) == ([], [])  # d still waits for b
    ready, _ = releases.after_end(1, 10.0, True)
    assert [(r.time_s, r.index) for r in ready] == [(13.0, 3)]
    assert releases.issued(3, 13.0).arrival_s == 13.0


def test_a_rejected_step_ends_its_session():
    session = AgentSession("s", 0.0, (_step("a"), _step("b", ["a"]), _step("c", ["b"])))
    w = sessions_workload([session], 10.0, "t")
    releases = StepReleases(w.requests, w.graph)
    releases.after_arrival(0)
    assert releases.after_end(0, 1.0, finished=False) == ([], [1, 2])
    assert releases.unreleased() == []


def test_open_loop_releases_every_request_at_its_arrival():
    w = _preset(SessionPreset.CHAT_AGENT, 0)
    open_loop = StepReleases(w.requests)
    assert not open_loop.closed_loop
    assert open_loop.after_arrival(0).index == 1
    assert open_loop.after_end(0, 1.0, True) == ([], [])


def test_the_simulator_issues_each_step_after_its_parents_finish():
    cluster = load_cluster_config("configs/paper-4gpu.yaml")
    w = _preset(SessionPreset.CODING_AGENT, 3, rate=0.05, duration=200)
    w = assign_slos(w, solo_latencies_s(w.requests, reference_instance("llama-3.1-8b")), 2.0)
    stack = build_routing("least-request", RoutingOptions())
    result = Simulator.from_config(cluster, stack.policy, seed=0).run(w)
    records = {r.request_id: r for r in result.records}
    assert len(records) == len(w.requests)
    assert all(r.outcome != RequestOutcome.REJECTED for r in records.values())
    checked = 0
    for child, parents in enumerate(w.graph.parents):
        if not parents:
            continue
        last = max(records[w.requests[p].request_id].finish_s for p in parents)
        issued = records[w.requests[child].request_id]
        assert issued.arrival_s == pytest.approx(last + w.graph.tool_wait_s[child])
        assert issued.deadline_s == pytest.approx(issued.arrival_s + issued.slo_s)
        checked += 1
    assert checked > 10


def test_a_run_cut_short_counts_unissued_steps_as_not_served():
    cluster = load_cluster_config("configs/paper-4gpu.yaml")
    w = _preset(SessionPreset.CODING_AGENT, 0, rate=0.05, duration=100)
    stack = build_routing("round-robin", RoutingOptions())
    result = Simulator.from_config(cluster, stack.policy, max_drain_s=1.0).run(w)
    assert len(result.records) == len(w.requests)
    unissued = [r for r in result.records if r.reject_reason
                and r.reject_reason.startswith("not issued")]
    assert unissued


def test_session_trace_round_trip(tmp_path):
    w_sessions = [AgentSession("x", 1.5, (_step("0", prompt=3000, out=50),
                                          _step("1", ["0"], 0.25, prompt=3400, out=20)))]
    path = tmp_path / "log.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in iter_session_rows(w_sessions)))
    loaded = load_session_trace(path)
    assert [(s.step_id, s.wait_for, s.tool_wait_s, s.num_prompt_tokens, s.num_output_tokens)
            for s in loaded[0].steps] == [("0", (), 0.0, 3000, 50), ("1", ("0",), 0.25, 3400, 20)]
    assert loaded[0].arrival_s == 1.5
    first, second = loaded[0].steps
    # the second prompt reuses the first prompt's full blocks (3000 // 256 = 11)
    assert second.block_hashes[:11] == first.block_hashes[:11]
    w = file_workload(path)
    assert [r.request_id for r in w.requests] == ["x/0", "x/1"]
    assert w.graph.parents == ((), (0,))


@pytest.mark.parametrize("line, message", [
    ({"session_id": "a", "step_id": "0", "input_tokens": 0, "output_tokens": 3},
     "bad.jsonl:1: field 'input_tokens'"),
    ({"session_id": "a", "step_id": "1", "parent": "9", "input_tokens": 5,
      "output_tokens": 3}, "parent '9' is not an earlier step"),
    ({"step_id": "0", "input_tokens": 5, "output_tokens": 3}, "field 'session_id'"),
    ({"session_id": "a", "input_tokens": 5, "appended_tokens": 9, "output_tokens": 3},
     "appended_tokens exceeds input_tokens"),
])
def test_session_trace_errors_name_the_line_and_field(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(line) + "\n")
    with pytest.raises(ValueError, match=message):
        load_session_trace(path)


def _replay_workload(tmp_path, **kwargs):
    from app.experiments.replay import build_workload

    base = dict(arrivals=Arrivals.POISSON, trace=None, prompts=None, rate=0.1,
                duration_s=100.0, max_requests=None, seed=0, context_limit=LIMIT)
    return build_workload(**(base | kwargs))


def test_content_modes_of_the_replay_command(tmp_path):
    from app.workload import ContentMode

    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(json.dumps({"timestamp": 100 * i, "input_length": 600 + i,
                                           "output_length": 7, "hash_ids": [0, i]})
                               for i in range(20)))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt_id": "a", "prompt": "hi there", "prompt_tokens": 3,
                                   "output_tokens": 4}))
    lengths = _replay_workload(tmp_path, arrivals=Arrivals.TRACE, trace=trace, prompts=prompts,
                               content=ContentMode.TRACE, rate=None, duration_s=None)
    assert [r.num_prompt_tokens for r in lengths.requests] == [600 + i for i in range(20)]
    assert lengths.requests[3].block_hashes == (0, 3) and lengths.graph is None
    texts = _replay_workload(tmp_path, arrivals=Arrivals.TRACE, trace=trace, prompts=prompts,
                             rate=None, duration_s=None)
    assert {r.prompt for r in texts.requests} == {"hi there"}
    agents = _replay_workload(tmp_path, content=ContentMode.CHAT_AGENT)
    assert agents.graph is not None and agents.requests[0].session_id == "s0"
    with pytest.raises(ValueError, match="needs --sessions"):
        _replay_workload(tmp_path, content=ContentMode.SESSIONS)
    with pytest.raises(ValueError, match="poisson or gamma"):
        _replay_workload(tmp_path, content=ContentMode.CODING_AGENT, arrivals=Arrivals.BATCH)


def test_plan_cluster_rate_rescales_a_session_log_s_arrivals(tmp_path):
    """`goodserve plan cluster --content sessions --rate R` starts the log's sessions at
    R per second, as `goodserve replay --rate` does: five sessions ten seconds apart all
    start within 20 s at 0.5 sessions/s, and one does at 0.05."""
    from typer.testing import CliRunner

    from app.cli import cli

    sessions = [AgentSession(f"s{i}", 10.0 * i, (_step("0", prompt=2000, out=40),))
                for i in range(5)]
    path = tmp_path / "log.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in iter_session_rows(sessions)))

    def steps_per_s(rate: float) -> float:
        result = CliRunner().invoke(cli, [
            "plan", "cluster", "--cluster", "configs/paper-4gpu.yaml", "--content",
            "sessions", "--sessions", str(path), "--rate", str(rate), "--duration", "20",
            "--json"])
        assert result.exit_code == 0, result.output
        return json.loads(result.output)["rate_rps"]

    assert steps_per_s(0.5) == pytest.approx(5 / 20)
    assert steps_per_s(0.05) == pytest.approx(1 / 20)
