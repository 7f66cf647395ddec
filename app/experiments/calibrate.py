"""Calibrate the sizing model against the engines: per pool role and engine kind, the
rate one engine sustains with `p_slo` of its requests within their deadlines, measured
in the simulator, over the rate the analytic model gives it.

SARA's stage models are approximations (the decode model, for one, assumes every
batch slot busy at the SLO's batch size); sized from them alone, pools come out short
wherever the model is optimistic. A production planner profiles its engines before it
plans (NVIDIA Dynamo's pre-deployment profiler does); this is that step for simulated
engines, and the factors it prints are the controller's `capacity_factors`:
    python -m app.experiments.calibrate --config configs/autoscale-sim.yaml --prompts P
The search doubles the rate from twice the model's until the engine misses its target,
up to MAX_FACTOR times the model's rate or the most its helpers carry (the factor is then
a lower bound); a pool kind whose helpers could not carry twice its modelled rate is not
measured.

One engine of the kind serves the role under test; the other stage is served by
helpers of the strongest kind for it, twice what the model says the rate needs (at
most 16), so that it is not the bottleneck. Poisson arrivals (at most 4,000 per
measurement), content from the experiment's prompt pool, deadlines as in the
experiment (slo_scale x solo time on the reference GPU).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import typer

from app.experiments.autoscale import (
    DEFAULT_CONFIG,
    AutoscaleConfig,
    load_autoscale_config,
    observed,
)
from app.experiments.replay import cli_error
from app.planning.inventory import DECODE, PREFILL, UNIFIED, InventorySizer, capacity_key
from app.planning.params import ModelParams
from app.planning.split import EngineKind, stage_slos
from app.routing.registry import PolicyKind, RoutingOptions, build_routing
from app.sim.elastic import engine_setup
from app.sim.instance import InstanceSetup
from app.sim.records import RequestOutcome
from app.sim.simulator import Simulator
from app.slo import assign_slos, reference_instance, solo_latencies_s
from app.workload import Content, Workload, poisson_workload

BISECTION_STEPS = 6
MAX_HELPERS = 16
MAX_FACTOR = 8.0  # the search's cap on measured / modelled
MAX_REQUESTS = 4000  # per measurement: high rates are measured over a shorter window
MIN_DURATION_S = 10.0


@dataclass(frozen=True)
class Measured:
    role: str
    kind: EngineKind
    modelled_rps: float
    measured_rps: float
    # the model with the stage's target given the deadline's whole slack, as the
    # measurement gives it (its helpers leave the other stage near its solo time)
    whole_slack_rps: float | None = None

    @property
    def factor(self) -> float:
        return self.measured_rps / self.modelled_rps


class Calibrator:
    """Measures one engine per (role, kind) of an experiment's inventory."""

    def __init__(self, config: AutoscaleConfig, pool: Sequence[Content], seed: int,
                 duration_s: float = 60.0) -> None:
        self.config, self.pool, self.seed, self.duration_s = config, pool, seed, duration_s
        self.settings = config.controller.settings(config.model, config.roles)
        sample = poisson_workload(10.0, 100.0, pool, seed=seed)
        lengths = observed(sample).workload
        model = ModelParams.named(config.model)
        self.sizer = InventorySizer(model, lengths, self.settings.slo.targets_for(lengths),
                                    self.settings.stock)
        self.reference = reference_instance(config.model, config.controller.reference_gpu)
        self.whole_slack = {
            role: InventorySizer(model, lengths, stage_slos(
                self.reference, lengths, config.controller.slo_scale, config.controller.p_slo,
                prefill_share=share), self.settings.stock)
            for role, share in ((PREFILL, 1.0), (DECODE, 0.0))}
        self.skipped: list[str] = []  # pool kinds `run` could not measure

    def run(self) -> list[Measured]:
        """One row per (role, kind) the model gives a rate and the helpers can serve;
        the others keep the model's rate (listed in `skipped`)."""
        rows = []
        self.skipped = []
        for role in self.config.roles:
            for stock in self.settings.stock:
                modelled = self.sizer.rate_of(role, stock.kind, 1)
                if modelled <= 0:
                    continue
                if not self._helpers_suffice(role, 2.0 * modelled):
                    self.skipped.append(capacity_key(role, stock.kind))
                    continue
                whole = (self.whole_slack[role].rate_of(role, stock.kind, 1)
                         if role in self.whole_slack else None)
                rows.append(Measured(role, stock.kind, modelled,
                                     self.sustained(role, stock.kind, modelled), whole))
        return rows

    def sustained(self, role: str, kind: EngineKind, modelled: float) -> float:
        """Highest rate that meets p_slo: doubling from twice the model's rate while it
        does (within MAX_FACTOR and what the helpers carry), then bisection."""
        lo, hi = 0.0, 2.0 * modelled
        while self.attainment(role, kind, hi) >= self.settings.slo.p_slo:
            if 2 * hi > MAX_FACTOR * modelled or not self._helpers_suffice(role, 2 * hi):
                return hi
            lo, hi = hi, 2 * hi
        for _ in range(BISECTION_STEPS):
            mid = (lo + hi) / 2
            if self.attainment(role, kind, mid) >= self.settings.slo.p_slo:
                lo = mid
            else:
                hi = mid
        return max(lo, modelled / 2 ** BISECTION_STEPS)

    def attainment(self, role: str, kind: EngineKind, rate: float) -> float:
        workload = self._workload(rate)
        setups = [engine_setup(self.config.model, role, kind), *self._helpers(role, rate)]
        stack = build_routing(PolicyKind.GOODSERVE, RoutingOptions(seed=self.seed))
        sim = Simulator(setups, stack.policy, watchdog=stack.watchdog,
                        kv_link_gbps=self.config.kv_link_gbps, seed=self.seed)
        records = sim.run(workload).records
        return sum(r.outcome is RequestOutcome.MET for r in records) / len(records)

    def _workload(self, rate: float) -> Workload:
        duration = max(min(self.duration_s, MAX_REQUESTS / rate), MIN_DURATION_S)
        workload = poisson_workload(rate, duration, self.pool, seed=self.seed)
        return assign_slos(workload, solo_latencies_s(workload.requests, self.reference),
                           self.config.controller.slo_scale)

    def _helper_kind(self, role: str) -> tuple[str, EngineKind]:
        other = DECODE if role == PREFILL else PREFILL
        kinds = [s.kind for s in self.settings.stock]
        return other, max(kinds, key=lambda k: self.sizer.rate_of(other, k, 1))

    def _helpers_suffice(self, role: str, rate: float) -> bool:
        """The most helpers carry `rate` by the model: otherwise the measurement would
        be of the helpers (small decode batches cannot keep up with a fast prefill)."""
        if role == UNIFIED:
            return True
        other, best = self._helper_kind(role)
        return self.sizer.engines_for(other, best, rate) <= MAX_HELPERS

    def _helpers(self, role: str, rate: float) -> list[InstanceSetup]:
        """The other stage, out of the way: its strongest kind, twice the model's count
        (at most MAX_HELPERS)."""
        if role == UNIFIED:
            return []
        other, best = self._helper_kind(role)
        need = self.sizer.engines_for(other, best, 2.0 * rate)
        count = MAX_HELPERS if not math.isfinite(need) else min(max(need, 1), MAX_HELPERS)
        return [engine_setup(self.config.model, other, best) for _ in range(count)]


def factors(rows: Sequence[Measured]) -> dict[str, float]:
    return {capacity_key(r.role, r.kind): round(r.factor, 3) for r in rows}


def main(
    config: Path = typer.Option(DEFAULT_CONFIG, help="autoscaling experiment YAML"),
    prompts: Path = typer.Option(..., help="prompt_lengths.jsonl: the traffic's content"),
    seed: int = typer.Option(1000, help="content and routing seed (keep it apart from the "
                             "experiment's seeds)"),
    duration_s: float = typer.Option(60.0, help="seconds of arrivals per measurement"),
    out: Path | None = typer.Option(None, help="write calibration.json here"),
) -> None:
    """Measure the capacity factors of an experiment's inventory; prints the
    `capacity_factors` line for its controller section."""
    from app.workload import load_prompts

    for path in (config, prompts):
        if not path.exists():
            raise cli_error(f"{path} does not exist")
    experiment = load_autoscale_config(config)
    pool = [row.content() for row in load_prompts(prompts)]
    calibrator = Calibrator(experiment, pool, seed, duration_s)
    rows = calibrator.run()
    for r in rows:
        whole = "" if r.whole_slack_rps is None else (
            f"  model with the whole slack {r.whole_slack_rps:8.2f} req/s")
        typer.echo(f"{r.role:8s} {r.kind.name:8s} model {r.modelled_rps:8.2f} req/s  "
                   f"measured {r.measured_rps:8.2f} req/s  factor {r.factor:.3f}{whole}")
    if calibrator.skipped:
        typer.echo("not measured (the helper stage would be the bottleneck; the model's "
                   f"rate stands): {', '.join(calibrator.skipped)}")
    measured = factors(rows)
    typer.echo("capacity_factors: " + json.dumps(measured))
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "calibration.json").write_text(json.dumps({
            "setup": {"config": config.name, "prompts": prompts.name, "seed": seed,
                      "duration_s": duration_s, "p_slo": experiment.controller.p_slo},
            "rows": [{"role": r.role, "kind": r.kind.name,
                      "modelled_rps": round(r.modelled_rps, 3),
                      "measured_rps": round(r.measured_rps, 3),
                      "whole_slack_rps": None if r.whole_slack_rps is None else round(
                          r.whole_slack_rps, 3)} for r in rows],
            "not_measured": calibrator.skipped,
            "capacity_factors": measured}, indent=2) + "\n")


if __name__ == "__main__":
    typer.run(main)
