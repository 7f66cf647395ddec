"""Policy registry keyed by enum: the config or CLI name chooses the implementation.

A name builds a `RoutingStack`: the routing policy plus, for policies that move
requests (GoodServe, the oracle, Llumnix), the watchdog that shares its state.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from app.routing.base import RoutingPolicy, Watchdog
from app.routing.baselines import (
    LeastRequestPolicy,
    PowerOfTwoPolicy,
    RandomPolicy,
    RoundRobinPolicy,
)
from app.routing.cache_aware import PreblePolicy, PrefixCachePolicy
from app.routing.goodserve import (
    DEFAULT_BUDGET_REFRESH_ITERATIONS,
    DEFAULT_MIGRATION_COST_QUANTILE,
    DEFAULT_MIGRATION_MARGIN,
    DEFAULT_STALL_FACTOR,
    TRAINED_PREDICTOR_STALL_FACTOR,
    JustEnoughConfig,
    JustEnoughPolicy,
    JustEnoughVariant,
    make_goodserve,
    stall_factor_for,
)
from app.routing.length import OutputLengthEstimator, RunningHistoryLength, TrueLength
from app.routing.load_aware import LlumnixBalancer, LlumnixPolicy, LowestTpmPolicy
from app.routing.status import StatusEstimator


class PolicyKind(StrEnum):
    """CLI / config names of the routing policies (and GoodServe's ablations)."""

    GOODSERVE = "goodserve"
    ORACLE = "oracle"
    RANDOM = "random"
    P2C = "p2c"
    ROUND_ROBIN = "round-robin"
    LEAST_REQUEST = "least-request"
    PREFIX_CACHE = "prefix-cache"
    LOWEST_TPM = "lowest-tpm"
    PREBLE = "preble"
    LLUMNIX = "llumnix"
    SLO_PACK = "slo-pack"
    # ablations and variants: by name only, not part of `all`
    GOODSERVE_NO_MIGRATION = "goodserve-no-migration"
    GOODSERVE_HISTORY = "goodserve-history"
    GOODSERVE_LEAST_SLACK = "goodserve-least-slack"
    GOODSERVE_ADMISSION = "goodserve-admission"

    @classmethod
    def from_str(cls, name: str) -> PolicyKind:
        try:
            return cls(name.strip().lower())
        except ValueError:
            known = ", ".join(k.value for k in cls)
            raise ValueError(f"unknown policy {name!r}; known: {known}") from None


# policies that read the true output length: the simulator can reveal it, a live router cannot
SIM_ONLY = frozenset({PolicyKind.ORACLE})

ABLATIONS = frozenset({
    PolicyKind.GOODSERVE_NO_MIGRATION, PolicyKind.GOODSERVE_HISTORY,
    PolicyKind.GOODSERVE_LEAST_SLACK, PolicyKind.GOODSERVE_ADMISSION,
})


@dataclass(frozen=True)
class RoutingOptions:
    """Knobs shared by every builder; each builder reads the ones it needs."""

    seed: int = 0
    tau_iterations: int = 50  # watchdog period, in iterations of an instance
    alpha: float = 0.2  # EMA weight of the status estimator
    headroom: float = JustEnoughConfig.headroom  # just-enough slack reserve, fraction of T
    # the watchdog moves requests late by more than this fraction of their time left
    migration_margin: float = DEFAULT_MIGRATION_MARGIN
    # admitted requests' budgets are refreshed this often (iterations), moves every tau
    budget_refresh_iterations: int = DEFAULT_BUDGET_REFRESH_ITERATIONS
    # a move may cost its target up to this quantile of recent arrivals' T (1: no limit)
    migration_cost_quantile: float = DEFAULT_MIGRATION_COST_QUANTILE
    # stranding strongest instances take requests within this quantile of recent SLO
    # spans (1: no reservation)
    reservation_quantile: float = JustEnoughConfig.reservation_quantile
    # share of a newcomer's prefill estimate charged against admitted requests' slack;
    # None: what suits the length estimator (`stall_factor_for`: 0.5 for a trained
    # predictor, 1.0 for exact or label-free lengths)
    stall_factor: float | None = None
    # just-enough places by this quantile of the predicted length first, when the
    # estimator knows its spread (0.5: the point estimate alone)
    confidence_quantile: float = JustEnoughConfig.confidence_quantile
    # while a label-free length history is cold, the fastest instance with capacity to
    # spare instead of the weakest (`pick_while_cold`)
    fast_while_cold: bool = JustEnoughConfig.fast_while_cold
    # GoodServe's output-length predictor (e.g. the MoE); None -> running history
    length_factory: Callable[[], OutputLengthEstimator] | None = None

    def goodserve_length(self) -> OutputLengthEstimator:
        return self.length_factory() if self.length_factory else RunningHistoryLength()


def stall_factor_label(stall_factor: float | None) -> str:
    """How reports name the stall factor; None is chosen per length estimator."""
    if stall_factor is not None:
        return f"{stall_factor:g}"
    return (f"{TRAINED_PREDICTOR_STALL_FACTOR:g} with a trained predictor, "
            f"{DEFAULT_STALL_FACTOR:g} with exact or label-free lengths")


@dataclass(frozen=True)
class RoutingStack:
    """What a substrate needs to route: the policy and an optional watchdog."""

    policy: RoutingPolicy
    watchdog: Watchdog | None = None


Builder = Callable[[RoutingOptions], RoutingStack]


def _goodserve(
    options: RoutingOptions,
    length: OutputLengthEstimator,
    migration: bool = True,
    **config: Any,
) -> RoutingStack:
    policy, watchdog = make_goodserve(
        length, alpha=options.alpha, tau_iterations=options.tau_iterations, migration=migration,
        migration_margin=options.migration_margin,
        budget_refresh_iterations=options.budget_refresh_iterations,
        migration_cost_quantile=options.migration_cost_quantile,
        config=JustEnoughConfig(headroom=options.headroom,
                                reservation_quantile=options.reservation_quantile,
                                stall_factor=(stall_factor_for(length)
                                              if options.stall_factor is None
                                              else options.stall_factor),
                                confidence_quantile=options.confidence_quantile,
                                fast_while_cold=options.fast_while_cold, **config),
    )
    return RoutingStack(policy, watchdog)


def _oracle(options: RoutingOptions) -> RoutingStack:
    """Just-enough with the true output length and undelayed speeds (alpha = 1)."""
    oracle_options = options
    return _goodserve(oracle_options, TrueLength())


def _slo_pack(options: RoutingOptions) -> RoutingStack:
    """AIBrix slo-pack-load / llm-d least-headroom: same latency estimate, history
    predictor, pack onto the feasible instance with the least headroom; no migration."""
    status = StatusEstimator(options.alpha)
    config = JustEnoughConfig(
        variant=JustEnoughVariant.LEAST_SLACK, headroom=0.0, protect_admitted=False,
        reservation_quantile=1.0, confidence_quantile=0.5, fast_while_cold=False,
    )
    return RoutingStack(JustEnoughPolicy(status, RunningHistoryLength(), config))


def _seeded(cls: type[RoutingPolicy]) -> Builder:
    return lambda options: RoutingStack(cls(seed=options.seed))


class PolicyRegistry:
    """PolicyKind -> builder; every call builds fresh objects."""

    def __init__(self) -> None:
        self._builders: dict[PolicyKind, Builder] = {}

    def register(self, kind: PolicyKind, builder: Builder) -> None:
        self._builders[kind] = builder

    def kinds(self, include_ablations: bool = False) -> list[PolicyKind]:
        """Registered names; `all` on the CLI means these without the ablations."""
        return [k for k in self._builders if include_ablations or k not in ABLATIONS]

    def build(self, kind: PolicyKind | str, options: RoutingOptions | None = None) -> RoutingStack:
        key = kind if isinstance(kind, PolicyKind) else PolicyKind.from_str(kind)
        if key not in self._builders:
            raise ValueError(f"policy {key.value!r} is not registered")
        return self._builders[key](options or RoutingOptions())

    def get(self, kind: PolicyKind | str, **options: Any) -> RoutingPolicy:
        """Just the policy (for substrates without migration)."""
        return self.build(kind, RoutingOptions(**options)).policy


POLICY_REGISTRY = PolicyRegistry()
for _kind, _builder in {
    PolicyKind.GOODSERVE: lambda o: _goodserve(o, o.goodserve_length()),
    PolicyKind.ORACLE: _oracle,
    PolicyKind.RANDOM: _seeded(RandomPolicy),
    PolicyKind.P2C: _seeded(PowerOfTwoPolicy),
    PolicyKind.ROUND_ROBIN: _seeded(RoundRobinPolicy),
    PolicyKind.LEAST_REQUEST: _seeded(LeastRequestPolicy),
    PolicyKind.PREFIX_CACHE: _seeded(PrefixCachePolicy),
    PolicyKind.LOWEST_TPM: _seeded(LowestTpmPolicy),
    PolicyKind.PREBLE: _seeded(PreblePolicy),
    PolicyKind.LLUMNIX: lambda o: RoutingStack(
        LlumnixPolicy(seed=o.seed), LlumnixBalancer(o.tau_iterations)
    ),
    PolicyKind.SLO_PACK: _slo_pack,
    PolicyKind.GOODSERVE_NO_MIGRATION: lambda o: _goodserve(
        o, o.goodserve_length(), migration=False
    ),
    PolicyKind.GOODSERVE_HISTORY: lambda o: _goodserve(o, RunningHistoryLength()),
    PolicyKind.GOODSERVE_LEAST_SLACK: lambda o: _goodserve(
        o, o.goodserve_length(), variant=JustEnoughVariant.LEAST_SLACK
    ),
    PolicyKind.GOODSERVE_ADMISSION: lambda o: _goodserve(
        o, o.goodserve_length(), admission_control=True
    ),
}.items():
    POLICY_REGISTRY.register(_kind, _builder)


def make_policy(kind: PolicyKind | str, **options: Any) -> RoutingPolicy:
    return POLICY_REGISTRY.get(kind, **options)


def build_routing(kind: PolicyKind | str, options: RoutingOptions | None = None) -> RoutingStack:
    return POLICY_REGISTRY.build(kind, options)
