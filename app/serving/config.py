"""Configuration of the live serving application (`goodserve serve`, `serve run`).

One YAML file: the `cluster` (same schema the simulator reads, so any cluster config
is also a serve config) plus optional routing, SLO and router settings.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from pydantic import AliasChoices, Field, field_validator, model_validator

from app.control.config import ControllerConfig
from app.control.controller import ControllerSettings
from app.engines.base import EngineCapabilities
from app.engines.config import (
    ClusterConfig,
    EngineBackend,
    EngineConfig,
    Frozen,
    InstanceGroup,
    SchedulerConfig,
    load_yaml_model,
)
from app.engines.factory import backend_class
from app.planning.inventory import DECODE, PREFILL, UNIFIED
from app.routing.goodserve import GoodServeConfig
from app.routing.length import OutputLengthEstimator
from app.routing.registry import SIM_ONLY, PolicyKind, RoutingOptions

MODEL_ALIAS = "goodserve"  # a `model` every server accepts, whatever it serves


class RoutingConfig(GoodServeConfig):
    """Which policy routes, GoodServe's knobs (every field of `GoodServeConfig`, at
    this level of the YAML) and its length predictor."""

    policy: str = Field("goodserve", description="a policy name from `goodserve replay`")
    seed: int = Field(0, description="seed of the policies that draw at random")
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

    @property
    def goodserve(self) -> GoodServeConfig:
        """The knobs alone, as the policy builders take them."""
        return GoodServeConfig(**{name: getattr(self, name)
                                  for name in GoodServeConfig.model_fields})

    def routing_options(
        self, length_factory: Callable[[], OutputLengthEstimator] | None = None
    ) -> RoutingOptions:
        """The registry's options for this section (GoodServe's estimator from
        `length_factory`, else the running history)."""
        return RoutingOptions(self.seed, self.goodserve, length_factory)


class AuthConfig(Frozen):
    """API keys and per-key rates. Keys live in files or the environment
    (`GOODSERVE_API_KEYS`, `GOODSERVE_ADMIN_API_KEYS`, comma-separated), never here, so
    a config written out carries none; with no key anywhere the API is open."""

    keys_file: str | None = Field(
        None, description="file of user API keys, one per line (# comments)")
    admin_keys_file: str | None = Field(
        None, description="file of admin API keys (every route, /admin/* and /v1/instances "
        "included)")
    rate_limit_rps: float | None = Field(
        None, gt=0, description="requests per second each key may send; None: unlimited")
    rate_limit_burst: int = Field(
        10, ge=1, description="requests a key may send at once before the rate applies")


class RouterAutoscaling(Frozen):
    """Ray Serve's autoscaling of the router replicas on their ongoing requests (each
    one a stream the replica relays). Defaults follow RayLLM's router: 200 ongoing
    requests per replica, within a backlog of 4,096; Serve's upscale and downscale
    delays. A replica that joins follows the status board and learns the finishes the
    board still holds; one that leaves drains its requests (`shutdown_grace_s`) and its
    budgets stop counting 3 s after its last poll."""

    min_replicas: int = Field(1, ge=1, description="replicas kept however idle (the API "
                              "needs one)")
    max_replicas: int = Field(8, ge=1, description="replicas at most")
    target_ongoing_requests: float = Field(
        200.0, gt=0, description="ongoing requests per replica Serve scales towards")
    upscale_delay_s: float = Field(30.0, ge=0, description="load above target this long "
                                   "before a replica is added")
    downscale_delay_s: float = Field(600.0, ge=0, description="load below target this "
                                     "long before a replica is removed")

    @model_validator(mode="after")
    def _ordered(self) -> RouterAutoscaling:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"router_autoscaling: min_replicas {self.min_replicas} > "
                             f"max_replicas {self.max_replicas}")
        return self

    def serve_options(self) -> dict[str, int | float]:
        """Ray Serve's `autoscaling_config` for the router deployment."""
        return {"min_replicas": self.min_replicas, "initial_replicas": self.min_replicas,
                "max_replicas": self.max_replicas,
                "target_ongoing_requests": self.target_ongoing_requests,
                "upscale_delay_s": self.upscale_delay_s,
                "downscale_delay_s": self.downscale_delay_s}


class ServeConfig(Frozen):
    """The served model's cluster and how the router treats requests."""

    cluster: ClusterConfig = Field(description="the engines the router serves over")
    served_model_name: str | tuple[str, ...] | None = Field(
        None, validation_alias=AliasChoices("served_model_name", "model_name"),
        description="the name or names clients send as `model` (vLLM's "
        "--served-model-name; `model_name` is read too): the first is the one /v1/models "
        f"lists first; default: the engines' model. `{MODEL_ALIAS}` is always accepted")
    routing: RoutingConfig = Field(
        RoutingConfig(), description="the routing policy and its knobs")
    default_slo_s: float | None = Field(
        None, gt=0, description="deadline for requests that send no slo_s; None = best effort"
    )
    session_headers: tuple[str, ...] = Field(
        ("x-session-affinity", "x-session-id", "x-amzn-sagemaker-session-id",
         "x-session-token"), description="headers that name a request's agent session "
        "when its body has no session_id, the first present taken (AIPerf's multi-turn "
        "mode, SageMaker's sticky sessions, llm-d's former header)")
    session_cookies: tuple[str, ...] = Field(
        ("llm-d-session",), description="cookies that name a request's agent session "
        "when neither its body nor a session header does (llm-d's session affinity)")
    stream_chunk_tokens: int = Field(
        1, ge=1, description="the most output tokens one streamed chunk carries: 1 sends "
        "each token in a chunk of its own, as vLLM does; more lets the tokens that reach "
        "the router together share a chunk (less work per token under load)")
    tokenizer_path: str | None = Field(
        None, description="local tokenizer directory the router tokenizes with; default: "
        "the engines' (a vLLM engine's model_path, a simulated engine's tokenizer_path)")
    tool_call_parser: str | None = Field(
        None, description="vLLM's tool parser for the model family (its "
        "`--tool-call-parser`: hermes, llama3_json, mistral, pythonic, ...); lets chat "
        "requests leave the choice to call tools to the model (tool_choice 'auto', the "
        "default with tools); None: 'auto' is refused")
    poll_interval_s: float = Field(
        0.1, gt=0, description="engine status period: the controller polls each engine once "
        "per period and every router replica follows the reports it publishes")
    num_router_replicas: int = Field(
        1, ge=1, description="router deployment replicas (Ray Serve); each routes its share")
    router_autoscaling: RouterAutoscaling | None = Field(
        None, description="let Ray Serve scale the router replicas on their ongoing "
        "requests (instead of num_router_replicas); None: a fixed count")
    ingress_replicas: int = Field(
        0, ge=0, description="replicas of an ingress deployment in front of the routers: "
        "when the router replica serving a request dies, it sends the request again, by "
        "its id, to a live one, which re-attaches it (the client sees nothing); 0: the "
        "routers take HTTP themselves and a client retries with its request id")
    ingress_tries: int = Field(
        3, ge=1, description="how many router replicas an ingress tries per request "
        "before it answers 503")
    router_resources: dict[str, float] = Field(
        default_factory=dict, description="custom Ray resources each router replica, "
        "ingress replica and the controller hold: one that only CPU nodes declare "
        "(cluster.yaml's head declares `router`) keeps them off the GPU nodes, so losing "
        "a GPU node loses engines only; empty: anywhere")
    http_port: int = Field(8000, ge=1, le=65535, description="HTTP port of the OpenAI API")
    controller: ControllerConfig | None = Field(
        None, description="resize the pools from SARA's allocation (the cluster's engines "
        "are the initial pools); None: the pools stay as configured")
    auth: AuthConfig = Field(AuthConfig(), description="API keys and per-key rate limits")
    max_request_bytes: int = Field(
        8 * 2**20, ge=1024, description="largest request body accepted (413 beyond)")
    shutdown_grace_s: float = Field(
        30.0, ge=0, description="on shutdown (SIGTERM, SIGINT), how long requests in flight "
        "may run on before their router replica is stopped")
    reply_retain_s: float = Field(
        60.0, ge=0, description="how long a router replica keeps a finished reply by its "
        "request id: a retry with the id gets it again, a stream resumes from it")
    max_retained_replies: int = Field(
        1024, ge=0, description="finished replies a router replica keeps at most (the "
        "oldest go first)")
    unread_grace_s: float = Field(
        30.0, ge=0, description="how long a reply no client reads any more is still made, "
        "so a client that reconnects with its request id gets the rest; then its "
        "generation is aborted")

    @field_validator("router_resources")
    @classmethod
    def _positive_amounts(cls, resources: dict[str, float]) -> dict[str, float]:
        bad = {name: amount for name, amount in resources.items() if not amount > 0}
        if bad:
            raise ValueError(f"resource amounts must be > 0, got {bad}")
        return resources

    @field_validator("session_headers")
    @classmethod
    def _lower_case(cls, names: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(name.lower() for name in names)  # as the router reads headers

    @model_validator(mode="after")
    def _one_model(self) -> ServeConfig:
        engines = self.cluster.engines()
        models = {(e.backend, e.model, e.model_path) for e in engines}
        if len(models) > 1:
            raise ValueError(f"cluster: every engine must serve the same model, got {models}")
        return self

    @model_validator(mode="after")
    def _replicas_fixed_or_autoscaled(self) -> ServeConfig:
        if self.router_autoscaling is not None and "num_router_replicas" in self.model_fields_set:
            raise ValueError("give num_router_replicas (a fixed count) or router_autoscaling, "
                             "not both")
        return self

    @model_validator(mode="after")
    def _kept_kv_is_simulated(self) -> ServeConfig:
        if self.cluster.keep_session_kv:
            raise ValueError("cluster.keep_session_kv runs in the simulator only: live "
                             "engines do not pin KV")
        return self

    @model_validator(mode="after")
    def _tools_need_text(self) -> ServeConfig:
        if self.tool_call_parser is not None and not self.engine_capabilities.text:
            raise ValueError(f"tool_call_parser: {self.engine_capabilities.kind} engines "
                             "generate no text to read tool calls from")
        return self

    @property
    def served_model_names(self) -> tuple[str, ...]:
        """The names a request's `model` may take, the primary first; the alias last."""
        names = self.served_model_name or self.engine_template.model
        names = (names,) if isinstance(names, str) else tuple(names)
        return names + ((MODEL_ALIAS,) if MODEL_ALIAS not in names else ())

    @property
    def engine_template(self) -> EngineConfig:
        """Any engine (they all serve the same model)."""
        return self.cluster.engines()[0]

    @property
    def controller_settings(self) -> ControllerSettings | None:
        """The controller's decision settings for this model and its pools."""
        if self.controller is None:
            return None
        roles = (PREFILL, DECODE) if self.cluster.mode == "disaggregated" else (UNIFIED,)
        return self.controller.settings(self.engine_template.model, roles)

    @property
    def engine_capabilities(self) -> EngineCapabilities:
        """What the configured engines can do (their backend says)."""
        return backend_class(self.engine_template.backend).CAPABILITIES


def default_serve_config() -> ServeConfig:
    """Llama-3.1-8B on simulated H800, A800, A40 and 2xV100 (TP2), routed by GoodServe."""
    scheduler = SchedulerConfig(max_num_seqs=64)
    groups = [
        InstanceGroup(engine=EngineConfig(gpu_type=g, tp=tp, scheduler=scheduler))
        for g, tp in (("H800", 1), ("A800", 1), ("A40", 1), ("V100", 2))
    ]
    return ServeConfig(cluster=ClusterConfig(name="local-sim", groups=groups))


def with_tokenizer(config: ServeConfig, path: str) -> ServeConfig:
    """`config` with the router and every simulated engine on the tokenizer in `path`
    (`goodserve serve --tokenizer`)."""
    groups = [g.model_copy(update={"engine": g.engine.model_copy(
        update={"tokenizer_path": path})}) if g.engine.backend == EngineBackend.SIM else g
        for g in config.cluster.groups]
    cluster = config.cluster.model_copy(update={"groups": groups})
    return config.model_copy(update={"tokenizer_path": path, "cluster": cluster})


def load_serve_config(path: str | Path) -> ServeConfig:
    return load_yaml_model(path, ServeConfig)
