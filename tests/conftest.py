"""Shared fixtures: one Ray instance, one tiny model and one vLLM engine per session.

Engines take ~20-40 s to start on 2 cores, so every e2e test reuses them.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

SHARED_DATA_DIR = Path(__file__).resolve().parents[2] / "shared" / "data"
# every GPU kind a test may pin to, declared on the one local node
LOCAL_GPU_RESOURCES = {
    f"gpu_type:{g}": 8.0 for g in ("H800", "A800", "A40", "V100", "H100", "A100", "cpu")
}


@pytest.fixture(scope="session")
def shared_data_dir() -> Path:
    if not SHARED_DATA_DIR.is_dir():
        pytest.skip(f"shared data not found at {SHARED_DATA_DIR}")
    return SHARED_DATA_DIR


@pytest.fixture(scope="session")
def ray_session():
    """A local Ray with custom GPU-kind resources; stopped at session end."""
    import ray

    ray.init(
        num_cpus=2,
        resources=LOCAL_GPU_RESOURCES,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"VLLM_CPU_KVCACHE_SPACE": "1"}},
    )
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from app.tiny_model import build_tiny_llama

    os.environ["HF_HUB_OFFLINE"] = "1"
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def vllm_cluster_config(model_dir: Path):
    """Two real vLLM CPU engines on the tiny model (the e2e tests' one set of engines)."""
    from app.config import (
        ClusterConfig,
        EngineBackend,
        EngineConfig,
        InstanceGroup,
        SchedulerConfig,
    )

    engine = EngineConfig(
        gpu_type="cpu",
        model="tiny-llama",
        backend=EngineBackend.VLLM,
        model_path=str(model_dir),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=2048),
    )
    return ClusterConfig(name="e2e", groups=[InstanceGroup(count=2, engine=engine)])


@pytest.fixture(scope="session")
def vllm_engines(ray_session, tiny_model_dir):
    """The shared vLLM engine actors, started once; the live router reuses them by name."""
    import ray

    from deployments.cluster import launch_cluster, shutdown_engines

    handles = launch_cluster(vllm_cluster_config(tiny_model_dir), start=False, shared=True)
    ray.get([h.actor.start.remote() for h in handles], timeout=600)
    yield handles
    shutdown_engines(handles, timeout_s=120)


@pytest.fixture(scope="session")
def vllm_engine(vllm_engines):
    """One of them, for the engine-level tests."""
    return vllm_engines[0]
