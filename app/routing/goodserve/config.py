"""GoodServe's knobs: one frozen config object, the single definition of each.

Each field carries its default, its bounds and a one-line meaning. The serve YAML's
`routing` section (`app/serving/config.py: RoutingConfig`) subclasses this model, the
replay and experiment command lines generate their options from its fields
(`app/experiments/knob_cli.py`), and the policy and watchdog read it directly, so a new
knob is added here and nowhere else. Why each default is what it is, with the
measurements, is in docs/goodserve-routing.md under the knob's name.
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import ConfigDict, Field

from app.engines.config import Frozen
from app.routing.length import OutputLengthEstimator, PredictorLength

# The stall factor's default depends on the length estimator's errors: a trained
# predictor over-predicts the requests it calls late, exact and label-free lengths do
# not (docs/goodserve-routing.md, "stall factor").
DEFAULT_STALL_FACTOR = 1.0  # exact or label-free lengths
TRAINED_PREDICTOR_STALL_FACTOR = 0.5  # a trained predictor (`PredictorLength`)


class JustEnoughVariant(StrEnum):
    WEAKEST = "weakest"  # the paper's rule: weakest capable instance
    LEAST_SLACK = "least-slack"  # finish closest to the deadline


def stall_factor_for(length: OutputLengthEstimator) -> float:
    """The do-no-harm charge that suits `length`'s errors."""
    if isinstance(length, PredictorLength):
        return TRAINED_PREDICTOR_STALL_FACTOR
    return DEFAULT_STALL_FACTOR


def stall_factor_label(stall_factor: float | None) -> str:
    """How reports name the stall factor; None is chosen per length estimator."""
    if stall_factor is not None:
        return f"{stall_factor:g}"
    return (f"{TRAINED_PREDICTOR_STALL_FACTOR:g} with a trained predictor, "
            f"{DEFAULT_STALL_FACTOR:g} with exact or label-free lengths")


class LengthReestimate(StrEnum):
    """How the watchdog re-estimates a running request's total length."""

    CONDITIONAL = "conditional"  # the arrival estimate given the tokens generated so far
    REPREDICT = "repredict"  # the length estimator again (a trained predictor: its model)
    AT_RISK = "at-risk"  # conditional, and the estimator again for the requests it calls late


class GoodServeConfig(Frozen):
    """Placement (just-enough) and watchdog knobs, shared by the router and the watchdog."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_enum_values=False)

    # ---- status estimate ------------------------------------------------------------
    alpha: float = Field(0.2, gt=0, le=1, description="EMA weight of the status estimator")
    # ---- placement --------------------------------------------------------------------
    variant: JustEnoughVariant = Field(
        JustEnoughVariant.WEAKEST,
        description="which feasible instance just-enough takes: the weakest (the paper's "
        "rule) or the one that finishes closest to the deadline (least-slack)")
    headroom: float = Field(
        0.5, ge=0, description="slack kept in reserve, fraction of T: an instance that "
        "would finish with less spare time counts as infeasible")
    cache_affinity_tokens: int | None = Field(
        2048, ge=0, description="cache affinity: just-enough picks only among the feasible "
        "instances whose uncached prompt is within this many tokens of the least uncached "
        "one, so a long context cached on a capable GPU is not recomputed on a weaker one; "
        "None = off")
    long_context_estimates: bool = Field(
        True, description="scale an instance's per-token prefill and decode estimates to "
        "the request's own context by the hardware model's growth with attended span "
        "(the figures hold at a 1k-token span; at 64k prefill is about 3x and decode "
        "1.5x slower per token) when scoring instances for placement; contexts under 1k "
        "are unchanged")
    admission_control: bool = Field(
        False, description="reject early, with the reason, when no instance can meet the "
        "deadline even without headroom (else best effort on the least harmful fastest "
        "instance); an agent session is admitted or turned away at its first step, and "
        "its later steps are never rejected")
    triage: bool | None = Field(
        None, description="a request that no instance can finish by its deadline even with "
        "an optimistic length goes to the most backlogged instance, where it takes least "
        "from requests that still can; None = on with a trained predictor or exact "
        "lengths, off with the label-free history (whose pessimistic estimates under "
        "steady overload would triage requests that can still meet)")
    triage_min_context_tokens: int | None = Field(
        2048, ge=1, description="where triage is left off for the label-free history "
        "(triage unset), requests with at least this many context tokens are triaged all "
        "the same: their latency is mostly the known queue and prefill, so the history's "
        "guess cannot make them look hopeless; None = never (triage false: never either)")
    triage_session_steps: bool = Field(
        True, description="triage applies to agent-session steps too; off: a hopeless "
        "step is placed best effort instead, where its session's next steps are better "
        "off (its context stays cached where it runs), at the cost of spreading the "
        "hopeless work under overload")
    session_homes: bool = Field(
        True, description="best effort for an agent-session step only among instances "
        "that would meet its deadline once their queues drained, where any would: the "
        "step's context stays cached where it runs and draws its session's next steps")
    triage_quantile: float = Field(
        0.1, ge=0, le=0.5, description="the optimistic length triage assumes: this quantile "
        "of the length estimator's spread (one token when it knows none)")
    protect_admitted: bool = Field(
        True, description="do no harm: skip instances where the new request's prefill "
        "would stall an admitted request past its slack")
    stall_factor: float | None = Field(
        None, ge=0, description="share of a new request's prefill estimate charged "
        "against admitted requests' slack by the do-no-harm check; 0 = no check; None = "
        f"{stall_factor_label(None)}")
    confidence_quantile: float = Field(
        0.9, ge=0.5, le=1, description="place by this quantile of the predicted length "
        "first, when the length estimator knows its spread; 0.5 = the point estimate alone")
    fast_while_cold: bool = Field(
        True, description="while the label-free length history is cold, place on the "
        "fastest feasible instance with capacity to spare instead of the weakest")
    reservation_quantile: float = Field(
        0.9, ge=0, le=1, description="stranding strongest instances take only requests "
        "whose SLO span is within this quantile of recent arrivals'; 1 = no reservation")
    admissions_window: int = Field(
        200, ge=1, description="recent arrivals over which an instance counts as "
        "contended or stranding, and recent placements whose T sets the move cost limit")
    slo_window: int = Field(
        1000, ge=1, description="recent arrivals whose SLO spans set the reservation's limit")
    min_slo_samples: int = Field(
        100, ge=1, description="no reservation before this many arrivals were seen")
    # ---- watchdog -----------------------------------------------------------------------
    tau_iterations: int = Field(
        50, ge=1, description="watchdog move period, in iterations of an instance")
    budget_refresh_iterations: int = Field(
        10, ge=1, description="admitted requests' budgets are refreshed this often "
        "(iterations of their instance); moves stay every tau")
    reestimate: LengthReestimate = Field(
        LengthReestimate.CONDITIONAL, description="how the watchdog re-estimates running "
        "requests' lengths: conditional (the arrival estimate's spread given the tokens "
        "already generated: no second predictor call), repredict (the predictor again, "
        "with the tokens generated as a feature) or at-risk (conditional, and the "
        "predictor again, in one call, for the requests the conditional estimate calls "
        "late)")
    max_migrations_per_request: int = Field(
        1, ge=0, description="moves a request may make; 0 = no migration")
    migration_margin: float = Field(
        0.0, ge=0, description="move only requests late by more than this fraction of "
        "their time left")
    migration_cost_quantile: float = Field(
        0.5, ge=0, le=1, description="a move may cost a contended target up to this "
        "quantile of the T of the new requests recently placed there; 1 = no limit")

    def for_length(self, length: OutputLengthEstimator) -> GoodServeConfig:
        """This config with the stall factor and triage resolved for `length` where
        left to it."""
        update: dict[str, object] = {}
        if self.stall_factor is None:
            update["stall_factor"] = stall_factor_for(length)
        if self.triage is None:
            update["triage"] = not length.label_free
        elif not self.triage:  # off by choice: long contexts too
            update["triage_min_context_tokens"] = None
        return self.model_copy(update=update) if update else self

    def paper_algorithm(self) -> GoodServeConfig:
        """This config with every addition beyond the paper's algorithm turned off, so
        that each addition's worth is the difference it makes. What stays is the
        paper: the EMA status estimate, just-enough on the weakest instance that meets
        the deadline (min T when none does), and a watchdog that re-predicts lengths
        every tau iterations and moves late requests to stronger instances. `alpha`
        and `tau_iterations` keep their values, and so does
        `max_migrations_per_request`: the paper names no cap, and a move only
        ever goes to a stronger instance."""
        return self.model_copy(update={
            "variant": JustEnoughVariant.WEAKEST,
            "headroom": 0.0,
            "admission_control": False,
            "cache_affinity_tokens": None,
            "long_context_estimates": False,
            "triage": False,
            "triage_min_context_tokens": None,
            "session_homes": False,
            "protect_admitted": False,
            "confidence_quantile": 0.5,
            "fast_while_cold": False,
            "reservation_quantile": 1.0,
            "budget_refresh_iterations": self.tau_iterations,
            "reestimate": LengthReestimate.REPREDICT,
            "migration_margin": 0.0,
            "migration_cost_quantile": 1.0,
        })

    @property
    def charged_stall_factor(self) -> float:
        """The stall factor in force (the per-estimator default when unresolved)."""
        return DEFAULT_STALL_FACTOR if self.stall_factor is None else self.stall_factor


def goodserve_knobs(config: GoodServeConfig) -> dict[str, object]:
    """The knob values of `config` (or of a subclass such as the serve YAML section)."""
    return {name: getattr(config, name) for name in GoodServeConfig.model_fields}
