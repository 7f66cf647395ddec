"""`goodserve overhead`: the router-thread replay, micro-batches and the command's JSON;
beside a reference, the processes' command lines, the ratios and their summary, and what
--reference names."""

from __future__ import annotations

import enum
import json
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from app.cli import cli
from app.experiments.overhead import BatchCost, RouterThread, WorkLog, mixed_cluster

pytestmark = pytest.mark.unit


def test_work_waits_for_the_router_thread():
    """Two decisions 1 ms apart each taking 3 ms: the second waits 2 ms; a status update
    due in between delays it by its own cost too."""
    log = WorkLog()
    log.add(0.000, 0.003, "choose", arrival=0.000)
    log.add(0.001, 0.003, "choose", arrival=0.001)
    log.add(0.0005, 0.001, "status")
    thread = RouterThread.replay(log)
    assert thread.latency_s.tolist() == pytest.approx([0.003, 0.006])  # 0 -> 3, 1 -> 7 ms
    assert thread.busy_s == pytest.approx(0.007)
    assert thread.span_s == pytest.approx(0.007)
    late = RouterThread.replay(log, measured_from_s=0.0008)  # the first is warm-up
    assert late.latency_s.tolist() == pytest.approx([0.006])
    with pytest.raises(ValueError, match="no routing decision"):
        RouterThread.replay(log, measured_from_s=1.0)


def test_decisions_wait_for_their_prediction_batch():
    """Three arrivals within 1 ms, a batch costing 1 ms: the first finds the batcher
    idle and is predicted at once (0-1 ms, decided by 1.1 ms); the two that arrive
    while its batch runs wait for it to end and for the oldest's 2 ms (2.5 ms), then
    share one batch (to 3.5 ms) and are decided in turn."""
    log = WorkLog()
    for t in (0.0, 0.0005, 0.001):
        log.add(t, 0.0001, "choose", arrival=t)
    flat = BatchCost((1, 64), (0.001, 0.001))
    thread = RouterThread.replay(log, batches=flat)
    assert thread.latency_s.tolist() == pytest.approx([0.0011, 0.0031, 0.0027])
    assert thread.predict_s == pytest.approx(0.002)
    assert thread.busy_s == pytest.approx(0.0023)


def test_a_busy_thread_makes_the_batch_take_what_arrived_meanwhile():
    """Other work holds the thread for 10 ms: the batch then takes every arrival so far,
    up to the batch size; the rest form the next batch."""
    log = WorkLog()
    log.add(0.0, 0.010, "status")
    for t in (0.001, 0.002, 0.003):
        log.add(t, 0.0001, "choose", arrival=t)
    capped = BatchCost((1, 2), (0.001, 0.002), max_batch_size=2)
    thread = RouterThread.replay(log, batches=capped)
    # batch of 2 at 10 ms -> 12 ms; its decisions 12.1, 12.2; batch of 1 -> 13.2; 13.3
    assert thread.latency_s.tolist() == pytest.approx([0.0111, 0.0102, 0.0103])
    assert thread.predict_s == pytest.approx(0.003)
    assert capped(1) == 0.001 and capped(2) == 0.002
    assert BatchCost((1, 3), (0.001, 0.003))(2) == pytest.approx(0.002)


def test_mixed_cluster_takes_the_gpu_kinds_in_turn():
    config = mixed_cluster(6)
    assert [(g.engine.gpu_type, g.count) for g in config.groups] == [
        ("H800", 2), ("A800", 2), ("A40", 1), ("V100", 1)]
    with pytest.raises(ValueError, match="instances"):
        mixed_cluster(0)


def test_the_overhead_command_prints_its_figures():
    result = CliRunner().invoke(cli, ["overhead", "--instances", "8", "--rps", "200",
                                      "--duration", "0.5", "--warmup", "0.5", "--json"])
    assert result.exit_code == 0, result.output
    figures = json.loads(result.output)
    for key in ("p50_ms", "p99_ms", "max_ms", "decisions_per_s", "cpu_ms_per_decision"):
        assert figures[key] > 0
    assert figures["p50_ms"] <= figures["p99_ms"] <= figures["max_ms"]
    assert figures["decisions"] > 50 and figures["breakdown_ms_per_decision"]["choose"] > 0
    bad = CliRunner().invoke(cli, ["overhead", "--rps", "0"])
    assert bad.exit_code != 0 and "rps" in bad.output


def test_a_trained_predictor_is_timed_in_batches():
    from app.experiments.overhead import measure
    from app.workloads.workload import Content
    from predictor.base import PredictionInput
    from predictor.history import HistoryPredictor

    pool = [Content(200 + 50 * (i % 7), 30 + 10 * (i % 5), (i,), prompt=f"p{i}")
            for i in range(64)]
    predictor = HistoryPredictor().fit([PredictionInput("p")] * 4, [10, 20, 30, 40])
    result = measure(8, 400.0, 0.3, pool, lambda: predictor, warmup_s=0.3)
    assert result.predictor == "moe" and result.decisions > 60
    assert result.breakdown_ms["predict"] > 0 and result.breakdown_ms["choose"] > 0
    assert result.cpu_ms_per_decision == pytest.approx(sum(result.breakdown_ms.values()))


def test_requests_carry_deadlines_so_the_decisions_spread_over_the_instances():
    """Without deadlines every GPU is just enough and all arrivals would join one
    instance, leaving the status updates and watchdog checks of the rest unmeasured."""
    from app.experiments.overhead import measure
    from app.workloads.workload import Content

    pool = [Content(200 + 50 * (i % 7), 30 + 10 * (i % 5), (i,)) for i in range(64)]
    result = measure(8, 400.0, 0.5, pool, None, seed=1, warmup_s=0.3, slo_scale=1.5)
    assert result.instances_used >= 6, result.summary()
    assert result.summary()["slo_scale"] == 1.5
    assert result.breakdown_ms["status"] > 0


def test_several_routers_each_lay_their_share_on_their_own_thread():
    from app.experiments.overhead import measure
    from app.workloads.workload import Content

    pool = [Content(200 + 50 * (i % 7), 30 + 10 * (i % 5), (i,)) for i in range(64)]
    one = measure(8, 400.0, 0.5, pool, None, seed=2, warmup_s=0.3)
    four = measure(8, 400.0, 0.5, pool, None, seed=2, warmup_s=0.3, routers=4)
    assert four.routers == 4 and len(four.per_router) == 4
    assert four.decisions == one.decisions  # each arrival decided once, by one replica
    assert sum(r["decisions"] for r in four.per_router) == four.decisions
    for router in four.per_router:
        assert 0.1 * four.decisions < router["decisions"] < 0.45 * four.decisions
        assert 0 < router["busy_share"] < 1
    summary = four.summary()
    assert summary["routers"] == 4 and len(summary["per_router"]) == 4
    assert "per_router" not in one.summary()


def test_the_routers_start_up_heap_is_frozen_for_the_run_as_serve_does(monkeypatch):
    """Ray Serve collects and freezes a replica's heap after its constructor: the
    measured run sees no scan of the start-up state, and the freeze ends with the run."""
    import gc

    from app.experiments import overhead
    from app.sim.simulator import Simulator
    from app.workloads.workload import Content

    frozen_during_run = []
    run = Simulator.run

    def recording_run(self, workload):
        frozen_during_run.append(gc.get_freeze_count())
        return run(self, workload)

    monkeypatch.setattr(Simulator, "run", recording_run)
    pool = [Content(200, 30, (i,)) for i in range(8)]
    overhead.measure(4, 200.0, 0.2, pool, None, warmup_s=0.1)
    assert frozen_during_run[0] > 1000 and gc.get_freeze_count() == 0


def test_the_timed_fleet_passes_every_feedback_to_the_replicas():
    """The harness's fleet wrapper forwards engine reports as the fleet itself does."""
    from app.experiments.overhead import TimedFleet
    from app.routing.base import RoutingPolicy
    from app.routing.fleet import FleetConfig, RouterFleet

    class Heard(RoutingPolicy):
        def __init__(self) -> None:
            self.statuses = 0

        def choose(self, request, view, now):
            return "A800"

        def on_status(self, status, now):
            self.statuses += 1

    policies = [Heard(), Heard()]
    fleet = RouterFleet([(p, None) for p in policies], FleetConfig(2))
    TimedFleet(fleet, [WorkLog(), WorkLog()]).on_status(object(), 0.0)
    assert [p.statuses for p in policies] == [1, 1]


def test_first_tokens_are_timed_for_the_listeners_that_hear_them_and_reach_fleets():
    """A policy that listens has its first-token work timed as feedback; one that does
    not is not called (as the substrates skip it); the fleet wrapper passes them on."""
    from app.experiments.overhead import TimedFeedback, TimedFleet, TimedWatchdog
    from app.routing.baselines import LeastRequestPolicy
    from app.routing.fleet import FleetConfig, RouterFleet
    from app.routing.kv_router import KvRouterPolicy
    from app.routing.registry import PolicyKind, build_routing
    from tests.unit.routing_utils import make_cluster, make_request, make_view

    request = make_request(9.0, rid="r")
    kv, log = KvRouterPolicy(), WorkLog()
    TimedFeedback(kv, log).on_first_token(request, "A40", 0.5, 0.5)
    assert log.what == ["finish"] and log.due_s == [0.5]
    quiet = WorkLog()
    TimedFeedback(LeastRequestPolicy(), quiet).on_first_token(request, "A40", 0.5, 0.5)
    TimedWatchdog(build_routing(PolicyKind.GOODSERVE).watchdog, quiet).on_first_token(
        request, "A40", 0.5, 0.5)
    assert quiet.what == []

    heard: list[str] = []

    class Hearing(LeastRequestPolicy):
        def on_first_token(self, request, instance_id, first_token_s, now):
            heard.append(request.request_id)

    fleet = RouterFleet([(Hearing(), None), (Hearing(), None)], FleetConfig(2))
    timed = TimedFleet(fleet, [WorkLog(), WorkLog()])
    timed.choose(request, make_cluster(make_view("A40")), 0.0)
    timed.on_first_token(request, "A40", 0.5, 0.5)
    assert heard == ["r"]


def test_timed_replicas_still_share_their_budgets_and_learn_each_others_finishes():
    """The timing wrapper shows the fleet the policy's estimator and budgets, so the
    measured replicas do the sharing work deployed ones do."""
    from app.experiments.overhead import TimedFeedback
    from app.routing.budgets import budgets_of
    from app.routing.finish_log import lengths_of
    from app.routing.registry import PolicyKind, build_routing

    policy = build_routing(PolicyKind.GOODSERVE).policy
    timed = TimedFeedback(policy, WorkLog())
    assert lengths_of(timed) is policy.length and budgets_of(timed) is policy.budgets


def test_a_replicas_report_is_timed_apart_from_its_decisions():
    from app.experiments.overhead import measure
    from app.workloads.workload import Content

    pool = [Content(200 + 50 * (i % 7), 30 + 10 * (i % 5), (i,)) for i in range(64)]
    four = measure(8, 400.0, 0.5, pool, None, seed=2, warmup_s=0.3, routers=4)
    assert four.breakdown_ms["report"] > 0 and four.breakdown_ms["choose"] > 0


# ---- beside a reference ------------------------------------------------------------------


class Colour(enum.Enum):
    RED = "red"


def test_each_process_gets_every_option_explicitly_with_absolute_paths(tmp_path, monkeypatch):
    """Both checkouts measure the same thing whatever their own defaults: every option of
    the measurement is on the command line, paths absolute (the processes run in the
    checkouts), the prompts default made explicit; what the comparison itself takes is
    not passed on, and each seed goes as --seed."""
    from app.experiments import overhead as module

    calls = []
    monkeypatch.setattr(module, "measure_beside", lambda *args: calls.append(args))
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(cli, [
        "overhead", "--instances", "8", "--rps", "200", "--predictor", "models",
        "--prompts", "p.jsonl", "--no-gc", "--reference", "HEAD", "--seeds", "4,5",
        "--out", "runs", "--json"])
    assert result.exit_code == 0, result.output
    ((ref, seeds, options, prime, out, as_json),) = calls
    assert (ref, seeds, out, as_json) == ("HEAD", [4, 5], Path("runs"), True)
    assert options == [
        "--instances", "8", "--rps", "200.0", "--duration", "1.0", "--warmup", "1.0",
        "--predictor", str(tmp_path / "models"), "--prompts", str(tmp_path / "p.jsonl"),
        "--routers", "1", "--slo-scale", "2.0", "--no-gc"]
    assert prime == [  # a small run of the same code first, to fill compile caches
        "--instances", "8", "--rps", "200.0", "--duration", "0.2", "--warmup", "0.1",
        *options[8:]]
    assert module.measurement_command(options, 4) == [
        sys.executable, "-m", "app.cli", "overhead", *options, "--seed", "4", "--json"]


def test_the_shared_prompts_are_named_for_the_reference(monkeypatch, tmp_path):
    """A reference checked out elsewhere would not find the shared data by its own
    relative default and would measure on synthetic content."""
    from app.experiments import overhead as module

    prompts = tmp_path / "prompt_lengths.jsonl"
    prompts.write_text("")
    monkeypatch.setattr(module, "default_prompts", lambda: prompts)
    calls = []
    monkeypatch.setattr(module, "measure_beside", lambda *args: calls.append(args))
    assert CliRunner().invoke(cli, ["overhead", "--reference", "HEAD"]).exit_code == 0
    ((_, seeds, options, _, _, _),) = calls
    assert seeds == module.REFERENCE_SEEDS
    assert options[options.index("--prompts") + 1] == str(prompts)


def test_forwarded_options_speak_each_kind_of_option():
    """Flags by their on or off name (a flag with no off name only when on), enums by
    value, None left out, skipped names left out."""
    from app.experiments.reference import forwarded_options

    app = typer.Typer()

    @app.command()
    def command(ctx: typer.Context, count: int = 3, colour: Colour = Colour.RED,
                where: Path | None = None, fast: bool = True,
                loud: bool = typer.Option(False, "--loud"), seed: int = 0) -> None:
        typer.echo(json.dumps(forwarded_options(ctx, {"seed"}, {"count": 7})))

    result = CliRunner().invoke(app, ["--no-fast", "--loud", "--seed", "9"])
    assert json.loads(result.output) == ["--count", "7", "--colour", "red", "--no-fast",
                                         "--loud"]


def test_the_sides_take_turns_at_going_first():
    from app.experiments.reference import order

    assert [order(i) for i in range(3)] == [("reference", "current"),
                                            ("current", "reference"),
                                            ("reference", "current")]


def test_ratios_and_their_summary_over_runs():
    """Per figure: min / median / max of each side over the runs, and of each run's own
    current / reference (a zero reference gives no ratio); a figure one run lacks is left
    out."""
    from app.experiments.reference import ratios, summarize

    assert ratios({"a": 2.0, "b": 0.0, "c": 1.0}, {"a": 3.0, "b": 1.0}) == {"a": 1.5,
                                                                          "b": None}
    pairs = [({"dps": 100.0, "p99": 2.0, "new": 1.0}, {"dps": 150.0, "p99": 1.0, "new": 1.0}),
             ({"dps": 200.0, "p99": 4.0}, {"dps": 200.0, "p99": 4.0}),
             ({"dps": 400.0, "p99": 0.0}, {"dps": 100.0, "p99": 3.0})]
    summary = summarize(pairs)
    assert list(summary) == ["dps", "p99"]
    assert summary["dps"] == {"reference": {"min": 100.0, "median": 200.0, "max": 400.0},
                              "current": {"min": 100.0, "median": 150.0, "max": 200.0},
                              "ratio": {"min": 0.25, "median": 1.0, "max": 1.5}}
    assert summary["p99"]["ratio"] == {"min": 0.5, "median": 0.75, "max": 1.0}


def test_the_report_gives_each_seed_both_sides_and_the_ratios():
    from app.experiments.overhead import compared_figures, reference_report, report_lines
    from app.experiments.reference import Checkout, PairedRun

    def summary(dps: float, choose: float) -> dict:
        return {"decisions_per_s": dps, "p50_ms": 0.1, "p99_ms": 0.4,
                "cpu_ms_per_decision": 0.2, "decisions": 9,
                "breakdown_ms_per_decision": {"choose": choose, "status": 0.05}}

    assert compared_figures(summary(10.0, 0.3)) == {
        "decisions_per_s": 10.0, "p50_ms": 0.1, "p99_ms": 0.4, "cpu_ms_per_decision": 0.2,
        "breakdown.choose": 0.3, "breakdown.status": 0.05}
    runs = [PairedRun(0, ("reference", "current"), summary(100.0, 0.2), summary(125.0, 0.1)),
            PairedRun(1, ("current", "reference"), summary(100.0, 0.4), summary(50.0, 0.1))]
    report = reference_report(Checkout("reference", Path("/r"), "HEAD (abc)"),
                              Checkout("current", Path("/c"), "abc-dirty"), ["--rps", "5"],
                              runs)
    assert [s["seed"] for s in report["seeds"]] == [0, 1]
    assert report["seeds"][1]["order"] == ["current", "reference"]
    assert report["seeds"][0]["ratio"]["decisions_per_s"] == 1.25
    assert report["seeds"][1]["ratio"]["breakdown.choose"] == 0.25
    assert report["summary"]["decisions_per_s"]["ratio"] == {"min": 0.5, "median": 0.875,
                                                             "max": 1.25}
    text = "\n".join(report_lines(report))
    assert "seed 1 (current first):" in text and "summary over 2 seeds:" in text
    assert "0.500 / 0.875 / 1.250" in text


def test_a_reference_is_a_checkout_directory_or_a_commit(tmp_path):
    import subprocess

    from app.experiments.reference import REPO, resolve_reference

    checkout = tmp_path / "other"
    (checkout / "app").mkdir(parents=True)
    (checkout / "app" / "__init__.py").write_text("")
    assert resolve_reference(str(checkout)) == checkout.resolve()
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()
    assert resolve_reference("HEAD") == head
    with pytest.raises(ValueError, match="not a checkout of this project"):
        resolve_reference(str(tmp_path))
    with pytest.raises(ValueError, match="neither a directory nor a commit"):
        resolve_reference("no-such-ref-anywhere")


def test_a_bad_reference_is_one_line_and_checks_out_nothing():
    result = CliRunner().invoke(cli, ["overhead", "--reference", "no-such-ref-anywhere"])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        f"error: --reference 'no-such-ref-anywhere' is neither a directory nor a commit "
        f"of {Path(__file__).resolve().parents[2]}"]
    for args, message in ((["--seeds", "1"], "--seeds goes with --reference"),
                          (["--reference", "HEAD", "--sweep"], "leave out --sweep"),
                          (["--reference", "HEAD", "--seeds", "a"], "comma-separated")):
        bad = CliRunner().invoke(cli, ["overhead", *args])
        assert bad.exit_code == 2 and message in bad.output, bad.output


def test_a_reference_without_an_option_fails_in_one_line_naming_it():
    """A checkout older than an option says which, from click's boxed usage error."""
    from app.experiments.reference import Checkout, failure, last_line

    old = Checkout("reference", Path("/tmp/old"), "v1 (abc123)")
    boxed = ("Usage: python -m app.cli overhead [OPTIONS]\n"
             "Try 'python -m app.cli overhead --help' for help.\n"
             "╭─ Error ─────────────────────────╮\n"
             "│ No such option: --slo-scale     │\n"
             "╰─────────────────────────────────╯\n")
    assert failure(old, boxed, 2) == "the reference checkout v1 (abc123) has no option --slo-scale"
    crash = "Traceback (most recent call last):\n  ...\nImportError: cannot import name 'x'\n"
    assert failure(old, crash, 1) == ("the reference run failed (exit code 1): ImportError: "
                                      "cannot import name 'x'")
    assert last_line("") == "(no error output)"
