"""Policy registry keyed by enum: the config or CLI name chooses the implementation.

A name builds a `RoutingStack`: the routing policy plus, for policies that move
requests (GoodServe and its variants, Llumnix), the watchdog that shares its state.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
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
from app.routing.fleet import FleetConfig, RouterFleet
from app.routing.goodserve import (
    GoodServeConfig,
    JustEnoughPolicy,
    JustEnoughVariant,
    make_goodserve,
)
from app.routing.kv_router import KvRouterPolicy
from app.routing.length import OutputLengthEstimator, RunningHistoryLength, TrueLength
from app.routing.load_aware import LlumnixBalancer, LlumnixPolicy, LowestTpmPolicy
from app.routing.predicted_latency import PredictedLatencyPolicy
from app.routing.session_affinity import SessionAffinityPolicy
from app.routing.session_length import SessionHistoryLength
from app.routing.status import StatusEstimator


class PolicyKind(StrEnum):
    """CLI / config names of the routing policies (and GoodServe's ablations)."""

    GOODSERVE = "goodserve"
    GOODSERVE_EXACT = "goodserve-exact-lengths"
    RANDOM = "random"
    P2C = "p2c"
    ROUND_ROBIN = "round-robin"
    LEAST_REQUEST = "least-request"
    PREFIX_CACHE = "prefix-cache"
    LOWEST_TPM = "lowest-tpm"
    PREBLE = "preble"
    LLUMNIX = "llumnix"
    SLO_PACK = "slo-pack"
    LLM_D = "llm-d"  # llm-d predicted-latency routing (per-request TTFT/TPOT SLOs)
    SESSION_AFFINITY = "session-affinity"  # consistent hash on the session id
    DYNAMO_KV = "dynamo-kv"  # Dynamo KV router cost
    # ablations and variants: by name only, not part of `all`
    GOODSERVE_NO_MIGRATION = "goodserve-no-migration"
    GOODSERVE_HISTORY = "goodserve-history"
    GOODSERVE_LEAST_SLACK = "goodserve-least-slack"
    GOODSERVE_ADMISSION = "goodserve-admission"
    GOODSERVE_SESSION_LENGTHS = "goodserve-session-lengths"
    GOODSERVE_PAPER = "goodserve-paper"  # the paper's algorithm, every addition off

    @classmethod
    def from_str(cls, name: str) -> PolicyKind:
        key = name.strip().lower()
        try:
            return cls(RENAMED.get(key, key))
        except ValueError:
            known = ", ".join(k.value for k in cls)
            raise ValueError(f"unknown policy {name!r}; known: {known}") from None


# earlier names still accepted on the command line and in configs
RENAMED = {"oracle": PolicyKind.GOODSERVE_EXACT.value}

# policies that read the true output length: the simulator can reveal it, a live router cannot
SIM_ONLY = frozenset({PolicyKind.GOODSERVE_EXACT})

ABLATIONS = frozenset({
    PolicyKind.GOODSERVE_NO_MIGRATION, PolicyKind.GOODSERVE_HISTORY,
    PolicyKind.GOODSERVE_LEAST_SLACK, PolicyKind.GOODSERVE_ADMISSION,
    PolicyKind.GOODSERVE_SESSION_LENGTHS, PolicyKind.GOODSERVE_PAPER,
})


@dataclass(frozen=True)
class RoutingOptions:
    """What every builder may read: the seed, GoodServe's knobs (the baselines that
    share a knob - Llumnix's period tau, slo-pack's EMA alpha - read it there too) and
    GoodServe's length estimator."""

    seed: int = 0
    goodserve: GoodServeConfig = GoodServeConfig()
    # GoodServe's output-length predictor (e.g. the MoE); None -> running history
    length_factory: Callable[[], OutputLengthEstimator] | None = None

    def goodserve_length(self) -> OutputLengthEstimator:
        return self.length_factory() if self.length_factory else RunningHistoryLength()


@dataclass(frozen=True)
class RoutingStack:
    """What a substrate needs to route: the policy, an optional watchdog, and the
    status estimator the policy learns into when it has one (what the live router
    exports as each instance's q_g, p_g, d_g)."""

    policy: RoutingPolicy
    watchdog: Watchdog | None = None
    estimator: StatusEstimator | None = None


Builder = Callable[[RoutingOptions], RoutingStack]


def _goodserve(
    options: RoutingOptions, length: OutputLengthEstimator, **overrides: Any
) -> RoutingStack:
    """GoodServe with the options' knobs, less any the variant fixes (`overrides`)."""
    config = options.goodserve.model_copy(update=overrides)
    policy, watchdog = make_goodserve(length, config)
    return RoutingStack(policy, watchdog, policy.status)


def _paper(options: RoutingOptions) -> RoutingStack:
    """GoodServe as the paper has it: the options' length estimator and knobs with
    every addition beyond the paper off (`GoodServeConfig.paper_algorithm`)."""
    paper = replace(options, goodserve=options.goodserve.paper_algorithm())
    return _goodserve(paper, paper.goodserve_length())


def _exact_lengths(options: RoutingOptions) -> RoutingStack:
    """GoodServe given the true output length (simulator only): every knob as
    configured, the stall factor resolved for exact lengths."""
    return _goodserve(options, TrueLength())


def _slo_pack(options: RoutingOptions) -> RoutingStack:
    """AIBrix slo-pack-load / llm-d least-headroom: same latency estimate, history
    predictor, pack onto the feasible instance with the least headroom; no migration."""
    status = StatusEstimator(options.goodserve.alpha)
    config = GoodServeConfig(
        alpha=options.goodserve.alpha, variant=JustEnoughVariant.LEAST_SLACK, headroom=0.0,
        protect_admitted=False, reservation_quantile=1.0, confidence_quantile=0.5,
        fast_while_cold=False, stall_factor=1.0, triage=False,
    )
    return RoutingStack(JustEnoughPolicy(status, RunningHistoryLength(), config),
                        estimator=status)


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

    def get(self, kind: PolicyKind | str, seed: int = 0) -> RoutingPolicy:
        """Just the policy, at the default knobs (for substrates without migration)."""
        return self.build(kind, RoutingOptions(seed=seed)).policy


POLICY_REGISTRY = PolicyRegistry()
for _kind, _builder in {
    PolicyKind.GOODSERVE: lambda o: _goodserve(o, o.goodserve_length()),
    PolicyKind.GOODSERVE_EXACT: _exact_lengths,
    PolicyKind.RANDOM: _seeded(RandomPolicy),
    PolicyKind.P2C: _seeded(PowerOfTwoPolicy),
    PolicyKind.ROUND_ROBIN: _seeded(RoundRobinPolicy),
    PolicyKind.LEAST_REQUEST: _seeded(LeastRequestPolicy),
    PolicyKind.PREFIX_CACHE: _seeded(PrefixCachePolicy),
    PolicyKind.LOWEST_TPM: _seeded(LowestTpmPolicy),
    PolicyKind.PREBLE: _seeded(PreblePolicy),
    PolicyKind.LLUMNIX: lambda o: RoutingStack(
        LlumnixPolicy(seed=o.seed), LlumnixBalancer(o.goodserve.tau_iterations)
    ),
    PolicyKind.SLO_PACK: _slo_pack,
    PolicyKind.LLM_D: _seeded(PredictedLatencyPolicy),
    PolicyKind.SESSION_AFFINITY: lambda o: RoutingStack(SessionAffinityPolicy()),
    PolicyKind.DYNAMO_KV: _seeded(KvRouterPolicy),
    PolicyKind.GOODSERVE_NO_MIGRATION: lambda o: _goodserve(
        o, o.goodserve_length(), max_migrations_per_request=0
    ),
    PolicyKind.GOODSERVE_HISTORY: lambda o: _goodserve(o, RunningHistoryLength()),
    PolicyKind.GOODSERVE_LEAST_SLACK: lambda o: _goodserve(
        o, o.goodserve_length(), variant=JustEnoughVariant.LEAST_SLACK
    ),
    PolicyKind.GOODSERVE_ADMISSION: lambda o: _goodserve(
        o, o.goodserve_length(), admission_control=True
    ),
    PolicyKind.GOODSERVE_SESSION_LENGTHS: lambda o: _goodserve(o, SessionHistoryLength()),
    PolicyKind.GOODSERVE_PAPER: _paper,
}.items():
    POLICY_REGISTRY.register(_kind, _builder)


def make_policy(kind: PolicyKind | str, seed: int = 0) -> RoutingPolicy:
    return POLICY_REGISTRY.get(kind, seed)


def build_routing(kind: PolicyKind | str, options: RoutingOptions | None = None,
                  fleet: FleetConfig | None = None) -> RoutingStack:
    """The policy stack of `kind`; with a `fleet` of several routers, that many replicas
    (seeded apart, each with its own state) behind one `RouterFleet`."""
    if fleet is None or fleet.num_routers == 1:
        return POLICY_REGISTRY.build(kind, options)
    options = options or RoutingOptions()
    stacks = [POLICY_REGISTRY.build(kind, replace(options, seed=options.seed + k))
              for k in range(fleet.num_routers)]
    router = RouterFleet([(s.policy, s.watchdog) for s in stacks], fleet, options.seed)
    return RoutingStack(router, router.watchdog)
