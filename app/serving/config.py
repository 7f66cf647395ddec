"""Configuration of the live serving application (`goodserve serve`, `serve run`).

One YAML file: the `cluster` (same schema the simulator reads, so any cluster config
is also a serve config) plus optional routing, SLO and router settings.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from pydantic import Field, field_validator, model_validator

from app.config import (
    ClusterConfig,
    EngineBackend,
    EngineConfig,
    Frozen,
    InstanceGroup,
    SchedulerConfig,
    load_yaml_model,
)
from app.routing.goodserve import (
    DEFAULT_BUDGET_REFRESH_ITERATIONS,
    DEFAULT_CONFIDENCE_QUANTILE,
    DEFAULT_MIGRATION_COST_QUANTILE,
    DEFAULT_MIGRATION_MARGIN,
    DEFAULT_RESERVATION_QUANTILE,
    DEFAULT_STALL_FACTOR,
    TRAINED_PREDICTOR_STALL_FACTOR,
)
from app.routing.registry import SIM_ONLY, PolicyKind, RoutingOptions


class RoutingConfig(Frozen):
    """Which policy routes, with GoodServe's knobs (see app/routing/registry.py)."""

    policy: str = Field("goodserve", description="a policy name from `goodserve replay`")
    tau_iterations: int = Field(50, ge=1, description="watchdog period, engine iterations")
    alpha: float = Field(0.2, gt=0, le=1, description="EMA weight of the status estimator")
    headroom: float = Field(0.5, ge=0, description="just-enough slack reserve, fraction of T")
    migration_margin: float = Field(
        DEFAULT_MIGRATION_MARGIN, ge=0,
        description="watchdog moves requests late by more than this fraction of time left")
    budget_refresh_iterations: int = Field(
        DEFAULT_BUDGET_REFRESH_ITERATIONS, ge=1,
        description="admitted requests' budgets are refreshed this often (engine iterations)")
    migration_cost_quantile: float = Field(
        DEFAULT_MIGRATION_COST_QUANTILE, ge=0, le=1,
        description="a move may cost its target up to this quantile of the estimated "
        "latency of the new requests recently placed there; 1 = no limit")
    reservation_quantile: float = Field(
        DEFAULT_RESERVATION_QUANTILE, ge=0, le=1,
        description="when the strongest instances strand requests they take only those "
        "whose SLO is within this quantile of recent arrivals' SLOs; 1 = no reservation")
    stall_factor: float | None = Field(
        None, ge=0,
        description="share of a new request's prefill estimate charged against admitted "
        "requests' slack by the do-no-harm check; 0 = no check; None = "
        f"{TRAINED_PREDICTOR_STALL_FACTOR} with a trained predictor (predictor_dir), "
        f"{DEFAULT_STALL_FACTOR} with the running history")
    confidence_quantile: float = Field(
        DEFAULT_CONFIDENCE_QUANTILE, ge=0.5, le=1,
        description="just-enough places by this quantile of the predicted length first, "
        "when the length estimator knows its spread (the running history does); "
        "0.5 = the point estimate alone")
    fast_while_cold: bool = Field(
        RoutingOptions.fast_while_cold,
        description="while the running history is cold (its finished lengths do not "
        "reach confidence_quantile yet, e.g. right after start-up), place on the "
        "fastest feasible instance with capacity to spare instead of the weakest")
    seed: int = 0
    predictor_dir: str | None = Field(
        None, description="trained predictor directory (`goodserve predictor train`); "
        "None = running history of finished lengths"
    )
    predictor_name: str = Field("moe", description="which saved predictor to load")

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, name: str) -> str:
        kind = PolicyKind.from_str(name)
        if kind in SIM_ONLY:
            raise ValueError(
                f"{kind.value} needs true output lengths; it runs in the simulator only")
        return kind.value


# knobs the serve config and the registry's RoutingOptions share, read by name both ways,
# so a knob added to both reaches the live router from every caller
ROUTING_KNOBS = tuple(
    name for name in RoutingConfig.model_fields
    if name in {f.name for f in dataclasses.fields(RoutingOptions)}
)


def routing_knobs(source: RoutingConfig | RoutingOptions) -> dict[str, Any]:
    """The shared knobs of a serve config's routing section or of RoutingOptions."""
    return {name: getattr(source, name) for name in ROUTING_KNOBS}


class ServeConfig(Frozen):
    """The served model's cluster and how the router treats requests."""

    cluster: ClusterConfig = Field(description="the engines the router serves over")
    model_name: str = Field("goodserve", description="the `model` clients must send")
    routing: RoutingConfig = Field(
        RoutingConfig(), description="the routing policy and its knobs")
    default_slo_s: float | None = Field(
        None, gt=0, description="deadline for requests that send no slo_s; None = best effort"
    )
    tokenizer_path: str | None = Field(
        None, description="local tokenizer directory; default: the vLLM engines' model_path"
    )
    poll_interval_s: float = Field(0.1, gt=0, description="engine status poll period")
    num_router_replicas: int = Field(
        1, ge=1, description="router deployment replicas (Ray Serve); each routes its share")
    http_port: int = Field(8000, ge=1, le=65535, description="HTTP port of the OpenAI API")

    @model_validator(mode="after")
    def _one_model(self) -> ServeConfig:
        engines = self.cluster.engines()
        if self.cluster.mode != "unified":
            raise ValueError("cluster.mode: live serving supports 'unified' only for now")
        models = {(e.backend, e.model, e.model_path) for e in engines}
        if len(models) > 1:
            raise ValueError(f"cluster: every engine must serve the same model, got {models}")
        return self

    @property
    def engine_template(self) -> EngineConfig:
        """Any engine (they all serve the same model)."""
        return self.cluster.engines()[0]

    @property
    def is_simulated(self) -> bool:
        return self.engine_template.backend == EngineBackend.SIM


def default_serve_config() -> ServeConfig:
    """Llama-3.1-8B on simulated H800, A800, A40 and 2xV100 (TP2), routed by GoodServe."""
    scheduler = SchedulerConfig(max_num_seqs=64)
    groups = [
        InstanceGroup(engine=EngineConfig(gpu_type=g, tp=tp, scheduler=scheduler))
        for g, tp in (("H800", 1), ("A800", 1), ("A40", 1), ("V100", 2))
    ]
    return ServeConfig(cluster=ClusterConfig(name="local-sim", groups=groups))


def load_serve_config(path: str | Path) -> ServeConfig:
    return load_yaml_model(path, ServeConfig)
