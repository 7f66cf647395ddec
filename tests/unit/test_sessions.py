"""Agent sessions: presets, the session trace format, and closed-loop release."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from app.engines.config import load_cluster_config
from app.routing.registry import RoutingOptions, build_routing
from app.sim.records import RequestOutcome
from app.sim.simulator import Simulator
from app.workloads.sessions import (
    AgentSession,
    AgentStep,
    Release,
    SessionPreset,
    StepReleases,
    file_workload,
    iter_session_rows,
    load_session_trace,
    preset_workload,
    sessions_workload,
)
from app.workloads.slo import assign_slos, reference_instance, solo_latencies_s
from app.workloads.workload import Arrivals, SyntheticArrivals

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


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_research_agent_sub_agents_branch_from_one_context_work_in_steps_and_are_joined(seed):
    """research-agent: an orchestrator's sub-agents start together from its context (a
    shared prefix), each runs a chain of its own steps, and one step joins them all, so
    every session ends in one step (no sub-agent's result goes unread)."""
    w = _preset(SessionPreset.RESEARCH_AGENT, seed, rate=0.05, duration=600)
    children = w.graph.children()
    ends = Counter(w.requests[i].session_id for i, c in enumerate(children) if not c)
    assert set(ends.values()) == {1}
    joins = [i for i, p in enumerate(w.graph.parents) if len(p) > 1]
    assert len(joins) > 10
    chain_lengths = []
    for join in joins:
        firsts = []
        for end in w.graph.parents[join]:
            step, length = end, 1
            while (len(w.graph.parents[step]) == 1
                   and len(children[w.graph.parents[step][0]]) == 1):
                step, length = w.graph.parents[step][0], length + 1
            firsts.append(w.requests[step])
            chain_lengths.append(length)
        # the first sub-agent runs on the orchestrator's context; the others extend it
        context = firsts[0].block_hashes
        assert all(_leading_shared(context, f.block_hashes) == len(context) for f in firsts)
    assert np.mean(np.array(chain_lengths) > 1) > 0.5  # sub-agents work over several steps
    steps = len(w.requests) / len({r.session_id for r in w.requests})
    assert 10 < steps < 40


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


FIRST = {"session_id": "a", "step_id": "0", "input_tokens": 500, "output_tokens": 3,
         "arrival_ms": 1000, "app": "x", "app_prefix_tokens": 100}


@pytest.mark.parametrize("lines, message", [
    ([FIRST | {"input_tokens": 0}],
     "field 'input_tokens': Input should be greater than or equal to 1"),
    ([FIRST | {"tool_wait_ms": "5"}], "field 'tool_wait_ms': Input should be a valid number"),
    ([{k: v for k, v in FIRST.items() if k != "session_id"}],
     "field 'session_id': Field required"),
    ([FIRST | {"appended_tokens": 501}],
     "field 'appended_tokens': Input should be at most input_tokens (500)"),
    ([FIRST | {"apended_tokens": 5}], "field 'apended_tokens': Extra inputs are not permitted"),
    ([FIRST | {"parent": [1.5]}], "field 'parent': Input should be a valid string"),
    ([FIRST | {"app": None}], "field 'app_prefix_tokens': Input should come with an 'app'"),
    ([FIRST, {"session_id": "a", "step_id": "1", "parent": "9", "input_tokens": 5,
              "output_tokens": 3}],
     "field 'parent': '9' is not an earlier step of session 'a'"),
    ([FIRST, {"session_id": "a", "step_id": "1", "input_tokens": 5, "output_tokens": 3,
              "arrival_ms": 999}],
     "field 'arrival_ms': before its session's start (1000 ms)"),
    ([FIRST, {"session_id": "a", "step_id": "1", "parent": "0", "input_tokens": 600,
              "output_tokens": 3, "app": "y"}],
     "field 'app': differs from its session's first line ('x')"),
])
def test_session_trace_errors_name_the_line_and_field(tmp_path, lines, message):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    with pytest.raises(ValueError) as info:
        load_session_trace(path)
    assert str(info.value) == f"{path}:{len(lines)}: {message}"


# A hand-written log (100-token blocks). Session "s" of app "coder" (a 300-token prefix)
# plans, fans out into three reads, joins them in an answer; a follow-up starts on its
# own later. Session 7 (integer ids, no app) starts first; its lines come in between.
HAND_LOG = [
    {"session_id": "s", "step_id": "plan", "parent": None, "input_tokens": 500,
     "appended_tokens": 500, "output_tokens": 100, "arrival_ms": 2000, "app": "coder",
     "app_prefix_tokens": 300},
    {"session_id": 7, "step_id": 0, "input_tokens": 200, "output_tokens": 50,
     "arrival_ms": 1000.0},
    {"session_id": "s", "step_id": "read-a", "parent": "plan", "input_tokens": 700,
     "appended_tokens": 100, "output_tokens": 80, "tool_wait_ms": 1000},
    {"session_id": "s", "step_id": "read-b", "parent": "plan", "input_tokens": 650,
     "output_tokens": 10, "tool_wait_ms": 500, "arrival_ms": 9000},
    {"session_id": "s", "step_id": "read-c", "parent": ["plan"], "input_tokens": 450,
     "output_tokens": 10, "tool_wait_ms": 2500.5, "app": "coder"},
    {"session_id": "s", "step_id": "answer", "parent": ["read-a", "read-b", "read-c"],
     "input_tokens": 900, "appended_tokens": 120, "output_tokens": 30, "tool_wait_ms": 400,
     "arrival_ms": 3000},
    {"session_id": "s", "step_id": "followup", "input_tokens": 400, "output_tokens": 20,
     "arrival_ms": 30000},
    {"session_id": 7, "step_id": 1, "parent": 0, "input_tokens": 350, "output_tokens": 5},
]


def _hand_log(tmp_path) -> Path:
    path = tmp_path / "hand.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in HAND_LOG) + "\n")
    return path


def test_a_session_log_s_fan_out_join_waits_and_arrivals(tmp_path):
    s, seven = load_session_trace(_hand_log(tmp_path), block_size=100)
    assert (s.session_id, s.arrival_s, s.app, s.app_prefix_tokens) == ("s", 2.0, "coder", 300)
    assert [(t.step_id, t.wait_for, t.tool_wait_s, t.arrival_offset_s, t.num_appended_tokens)
            for t in s.steps] == [
        ("plan", (), 0.0, 0.0, 500),
        ("read-a", ("plan",), 1.0, 0.0, 100),
        ("read-b", ("plan",), 0.5, 7.0, 50),  # no appended_tokens: 650 - (500 + 100)
        ("read-c", ("plan",), 2.5005, 0.0, 150),  # shorter than that: 450 - the app's 300
        ("answer", ("read-a", "read-b", "read-c"), 0.4, 1.0, 120),
        ("followup", (), 0.0, 28.0, 400),
    ]
    plan, read_a, read_b, read_c, answer, followup = (t.block_hashes for t in s.steps)
    app = plan[:3]
    assert len(plan) == 5 and len(read_a) == 7 and read_a[:5] == plan
    # read-b extends plan's prompt and output (600 tokens, 6 blocks); its 50 new tokens
    # fill no block
    assert read_b == read_a[:6]
    assert read_c[:3] == app and len(read_c) == 4 and read_c[3] not in read_a
    # answer shares 780 tokens with read-a's prompt (700) and output (80): 7 blocks
    assert answer[:7] == read_a and len(answer) == 9 and not set(answer[7:]) & set(read_a)
    assert followup[:3] == app and len(followup) == 4 and followup[3] != plan[3]
    assert (seven.session_id, seven.arrival_s, seven.app, seven.app_prefix_tokens) == \
        ("7", 1.0, "app", 0)
    first, second = seven.steps
    assert (second.step_id, second.wait_for, second.num_appended_tokens) == ("1", ("0",), 100)
    assert second.block_hashes[:2] == first.block_hashes and len(second.block_hashes) == 3
    s_blocks = {h for t in s.steps for h in t.block_hashes}
    assert not s_blocks & set(first.block_hashes + second.block_hashes)


def test_a_session_log_s_steps_wait_for_their_parents_and_their_own_arrival(tmp_path):
    w = sessions_workload(load_session_trace(_hand_log(tmp_path)), 60.0, "hand")
    at = {r.request_id: i for i, r in enumerate(w.requests)}
    assert list(at) == ["7/0", "7/1", "s/plan", "s/read-a", "s/read-b", "s/read-c",
                        "s/answer", "s/followup"]
    releases = StepReleases(w.requests, w.graph)

    def times(found: list[Release]) -> dict[str, float]:
        for r in found:
            releases.after_arrival(r.index)
        return {w.requests[r.index].request_id: r.time_s for r in found}

    first = releases.first()
    assert (first.time_s, first.index) == (1.0, at["7/0"])
    assert times([releases.after_arrival(at["7/0"])]) == {"s/plan": 2.0}
    # the follow-up waits for nothing: it is sent at its own arrival
    assert times([releases.after_arrival(at["s/plan"])]) == {"s/followup": 30.0}
    assert releases.after_arrival(at["s/followup"]) is None
    assert times(releases.after_end(at["7/0"], 1.5, True)[0]) == {"7/1": 1.5}
    ready, cancelled = releases.after_end(at["s/plan"], 4.0, True)
    # read-b's own arrival (9 s) comes after plan's end plus its tool wait (4.5 s)
    assert times(ready) == pytest.approx({"s/read-a": 5.0, "s/read-b": 9.0, "s/read-c": 6.5005})
    assert not cancelled
    assert releases.after_end(at["s/read-a"], 6.0, True) == ([], [])
    assert releases.after_end(at["s/read-c"], 8.0, True) == ([], [])
    # the join waits for its last parent plus its tool wait, past its own arrival (3 s)
    assert times(releases.after_end(at["s/read-b"], 12.0, True)[0]) == {"s/answer": 12.4}


def test_the_simulator_sends_a_logged_step_no_earlier_than_its_arrival(tmp_path):
    cluster = load_cluster_config("configs/paper-4gpu.yaml")
    w = sessions_workload(load_session_trace(_hand_log(tmp_path)), 60.0, "hand")
    stack = build_routing("least-request", RoutingOptions())
    records = {r.request_id: r for r in
               Simulator.from_config(cluster, stack.policy, seed=0).run(w).records}
    assert records["s/followup"].arrival_s == 30.0
    plan_end = records["s/plan"].finish_s
    assert plan_end + 0.5 < 9.0 and records["s/read-b"].arrival_s == 9.0
    assert records["s/read-a"].arrival_s == pytest.approx(plan_end + 1.0)


def test_rescaling_a_session_log_moves_sessions_not_their_steps_offsets(tmp_path):
    w = file_workload(_hand_log(tmp_path), rate=0.25)  # one session each 4 s, not 1 s
    earliest = dict(zip((r.request_id for r in w.requests), w.graph.earliest_s, strict=True))
    assert earliest["7/0"] == 0.0 and earliest["s/plan"] == 4.0
    assert earliest["s/read-b"] == 11.0 and earliest["s/followup"] == 32.0


def test_a_session_log_written_and_loaded_back_is_the_same(tmp_path):
    loaded = load_session_trace(_hand_log(tmp_path), block_size=100)
    rows = list(iter_session_rows(loaded))
    assert {k: rows[0][k] for k in ("arrival_ms", "app", "app_prefix_tokens")} == \
        {"arrival_ms": 2000.0, "app": "coder", "app_prefix_tokens": 300}
    assert [r.get("arrival_ms") for r in rows] == [2000.0, None, 9000.0, None, 3000.0,
                                                   30000.0, 1000.0, None]
    path = tmp_path / "written.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    assert load_session_trace(path, block_size=100) == loaded


def _replay_workload(tmp_path, **kwargs):
    from app.experiments.replay import build_workload

    base = dict(arrivals=Arrivals.POISSON, trace=None, prompts=None, rate=0.1,
                duration_s=100.0, max_requests=None, seed=0, context_limit=LIMIT)
    return build_workload(**(base | kwargs))


def test_content_modes_of_the_replay_command(tmp_path):
    from app.workloads.workload import ContentMode

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
    cluster = tmp_path / "one-engine.yaml"  # one layout to score: the rate is the point
    cluster.write_text("cluster:\n  name: one\n  groups:\n"
                       "    - engine: {gpu_type: A800, model: llama-3.1-8b}\n")

    def steps_per_s(rate: float) -> float:
        result = CliRunner().invoke(cli, [
            "plan", "cluster", "--cluster", str(cluster), "--content",
            "sessions", "--sessions", str(path), "--rate", str(rate), "--duration", "20",
            "--json"])
        assert result.exit_code == 0, result.output
        return json.loads(result.output)["rate_rps"]

    assert steps_per_s(0.5) == pytest.approx(5 / 20)
    assert steps_per_s(0.05) == pytest.approx(1 / 20)


def test_every_session_preset_is_a_content_mode_preset():
    from app.workloads.workload import ContentMode

    assert {m.value for m in ContentMode if m.is_preset} == {p.value for p in SessionPreset}
