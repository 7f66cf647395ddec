"""The `controller` section: GPU inventory, budget, pool limits and scaling knobs."""

from __future__ import annotations

from pydantic import Field, model_validator

from app.control.controller import CapacityModel, ControllerSettings, StageSlo
from app.control.plan import ScalingRules
from app.engines.config import Frozen
from app.hardware.specs import GPU_CATALOG, make_instance
from app.planning.inventory import DECODE, PREFILL, UNIFIED, PoolLimits, Stock, capacity_key
from app.planning.params import SloTargets
from app.planning.split import DEFAULT_P_SLO, EngineKind


class InventoryItem(Frozen):
    """Engines of one GPU kind the controller may run at once, and their price."""

    gpu_type: str = Field(description="catalog GPU name")
    tp: int = Field(1, ge=1, description="GPUs per engine")
    count: int = Field(ge=0, description="engines of this kind available at once")
    price_per_hour: float | None = Field(
        None, ge=0, description="USD per engine-hour; default: tp x the catalog price")
    max_num_seqs: int = Field(256, gt=0, description="scheduler batch cap of these engines")

    @model_validator(mode="after")
    def _known_gpu(self) -> InventoryItem:
        if self.gpu_type not in GPU_CATALOG:
            raise ValueError(f"unknown GPU {self.gpu_type!r}; known: {sorted(GPU_CATALOG)}")
        return self

    @property
    def kind(self) -> EngineKind:
        return EngineKind(self.gpu_type, self.tp, self.max_num_seqs)

    @property
    def stock(self) -> Stock:
        price = self.price_per_hour
        if price is None:
            price = self.tp * GPU_CATALOG[self.gpu_type].price_per_hour
        return Stock(self.kind, self.count, price)


class StageSloConfig(Frozen):
    """Fixed stage targets for the sizing model (else derived from `slo_scale`)."""

    ttft_s: float = Field(gt=0, description="TTFT target tau_pre, s")
    tpot_s: float = Field(gt=0, description="time per output token target tau_dec, s")
    kv_s: float | None = Field(None, gt=0, description="KV transfer target; default ttft_s")


class ControllerConfig(Frozen):
    """The SARA controller: what it may buy and how fast it reacts."""

    interval_s: float = Field(30.0, gt=0, description="seconds between decisions")
    budget_per_hour: float | None = Field(
        None, gt=0, description="USD per hour the pools may cost; None: the inventory limits")
    inventory: list[InventoryItem] = Field(description="engine kinds with counts and prices")
    min_engines: dict[str, int] = Field(
        default_factory=dict, description="role -> fewest engines (default 1 per pool)")
    max_engines: dict[str, int] = Field(
        default_factory=dict, description="role -> most engines (default: the inventory)")
    headroom: float = Field(0.1, ge=0, description="size pools for forecast x (1 + headroom)")
    cooldown_s: float = Field(
        120.0, ge=0, description="no scale-down of a pool this soon after it grew")
    scale_down_after_s: float = Field(
        60.0, ge=0, description="a pool must be above its target this long before it shrinks")
    drain_deadline_s: float = Field(
        30.0, ge=0, description="a draining engine's requests migrate by token ids after this")
    startup_s: float = Field(60.0, ge=0, description="seconds an engine takes to serve")
    trend_damping: float = Field(
        1.0, ge=0, le=1, description="the rate trend carried over the start-up is damped by "
        "this per interval (1: extended in full, 0: not at all): a trend that held while "
        "rising overshoots at a peak")
    switch_margin: float = Field(
        0.1, ge=0, description="pools keep the engines they run while that costs at most "
        "this share more than the cheapest mix (a switch pays a start-up and a drain)")
    slo_scale: float = Field(
        2.0, gt=0, description="deadline scale over the solo time on reference_gpu; sets the "
        "sizing model's stage targets unless stage_slo is given")
    reference_gpu: str = Field("A800", description="GPU whose solo time the SLO scale multiplies")
    p_slo: float = Field(DEFAULT_P_SLO, gt=0, lt=1, description="probability each stage "
                         "target must hold with")
    stage_slo: StageSloConfig | None = Field(None, description="fixed stage targets")
    capacity_factors: dict[str, float] = Field(
        default_factory=dict, description="measured / modelled rate per pool and kind, keyed "
        "'decode:A800' (`goodserve autoscale --calibrate` measures them); 1 where absent")
    capacity_model: CapacityModel = Field(
        CapacityModel.SARA, description="what sizes the pools: sara (SARA's stage models at "
        "the mean request's stage targets) or served (each request's own deadline, the "
        "engines' iteration model, prefix hits and KV; app/planning/served.py)")

    @model_validator(mode="after")
    def _roles_known(self) -> ControllerConfig:
        for limits in (self.min_engines, self.max_engines):
            unknown = set(limits) - {PREFILL, DECODE, UNIFIED}
            if unknown:
                raise ValueError(f"pool limits name unknown roles {sorted(unknown)}; use "
                                 "prefill, decode or unified")
            if any(n < 0 for n in limits.values()):
                raise ValueError("pool limits must be >= 0")
        kinds = [i.kind.name for i in self.inventory]
        if len(set(kinds)) < len(kinds):
            raise ValueError(f"inventory lists a GPU type and tp twice: {kinds}")
        if not self.inventory:
            raise ValueError("the inventory is empty")
        if self.reference_gpu not in GPU_CATALOG:
            raise ValueError(f"unknown reference GPU {self.reference_gpu!r}")
        known = {capacity_key(role, i.kind) for i in self.inventory
                 for role in (PREFILL, DECODE, UNIFIED)}
        for key, value in self.capacity_factors.items():
            if key not in known:
                raise ValueError(f"capacity factor {key!r} names no pool and inventory kind; "
                                 "keys look like 'decode:A800'")
            if not value > 0:
                raise ValueError(f"capacity factor {key!r} must be > 0, got {value}")
        return self

    def settings(self, model: str, roles: tuple[str, ...]) -> ControllerSettings:
        """The decision loop's settings for a model served in `roles`."""
        fixed = None
        if self.stage_slo is not None:
            s = self.stage_slo
            fixed = SloTargets(s.ttft_s, s.kv_s or s.ttft_s, s.tpot_s, self.p_slo)
        return ControllerSettings(
            model=model, roles=roles, stock=tuple(i.stock for i in self.inventory),
            slo=StageSlo(make_instance(self.reference_gpu, model), self.slo_scale, fixed,
                         self.p_slo),
            limits=PoolLimits(dict(self.min_engines), dict(self.max_engines),
                              self.budget_per_hour),
            rules=self.rules, interval_s=self.interval_s, headroom=self.headroom,
            startup_s=self.startup_s, trend_damping=self.trend_damping,
            switch_margin=self.switch_margin, capacity_factors=dict(self.capacity_factors),
            capacity_model=self.capacity_model)

    @property
    def rules(self) -> ScalingRules:
        return ScalingRules(self.scale_down_after_s, self.cooldown_s, self.drain_deadline_s)
