"""Test layers, and shared fixtures: one Ray, one tiny model and one vLLM engine per session.

Every test belongs to exactly one layer, named by its marker and by its directory:
`unit` (fast, no Ray, no server), `scripts` (the benchmark scripts' own logic: fast, no
Ray), `slow` (benchmark-sized, no Ray), `integration` (Ray or a real server, simulated
engines) and `e2e` (Ray Serve + vLLM CPU engines). Only `scripts` tests import
`benchmarks/`.
Engines take ~20-40 s to start on 2 cores, so every e2e test reuses them.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

LAYERS = ("unit", "scripts", "slow", "integration", "e2e")
RAY_FREE_LAYERS = ("unit", "scripts", "slow")
TESTS_DIR = Path(__file__).resolve().parent

SHARED_DATA_DIR = Path(__file__).resolve().parents[2] / "shared" / "data"
# every GPU kind a test may pin to, declared on the one local node
LOCAL_GPU_RESOURCES = {
    f"gpu_type:{g}": 8.0 for g in ("H800", "A800", "A40", "V100", "H100", "A100", "cpu")
}


def layer_error(item: pytest.Item) -> str | None:
    """Why `item` is not in exactly one layer, matching its directory; None when it is."""
    layers = sorted({m.name for m in item.iter_markers() if m.name in LAYERS})
    if len(layers) != 1:
        return f"has layer markers {layers}; it needs exactly one of {list(LAYERS)}"
    (layer,) = layers
    directory = item.path.resolve().relative_to(TESTS_DIR).parts[0]
    if directory != layer:
        return f"is marked {layer!r} but lives under tests/{directory}"
    if layer in RAY_FREE_LAYERS and "ray_session" in item.fixturenames:
        return f"uses Ray, so it is 'integration' or 'e2e', not {layer!r}"
    return None


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: an unmarked test must not hide
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    errors = [f"{item.nodeid} {error}" for item in items if (error := layer_error(item))]
    if errors:
        raise pytest.UsageError("tests outside the layers:\n  " + "\n  ".join(errors))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Every test, and the module fixtures it sets up, starts with torch on one thread.

    Code under test may set the count for the process (the predictor CLIs and benchmarks
    do); unreset, the next test's timing would depend on which test ran before it.
    """
    torch = sys.modules.get("torch")  # imported by the modules that train
    if torch is not None and torch.get_num_threads() != 1:
        torch.set_num_threads(1)


def ray_is_running() -> bool:
    ray = sys.modules.get("ray")  # never import Ray just to ask
    return ray is not None and ray.is_initialized()


@pytest.fixture(autouse=True)
def ray_free_layers_stay_ray_free(request: pytest.FixtureRequest):
    """A unit or slow test that leaves Ray running started it: it belongs to integration."""
    was_running = ray_is_running()
    yield
    layer = next((m.name for m in request.node.iter_markers() if m.name in LAYERS), None)
    if layer in RAY_FREE_LAYERS and not was_running and ray_is_running():
        pytest.fail(f"a {layer!r} test started Ray: mark it 'integration'")


@pytest.fixture(scope="session")
def shared_data_dir() -> Path:
    if not SHARED_DATA_DIR.is_dir():
        pytest.skip(f"shared data not found at {SHARED_DATA_DIR}")
    return SHARED_DATA_DIR


RAY_METRICS_PORT: list[int] = []  # the session's Ray metrics endpoint, once started


@pytest.fixture(scope="session")
def ray_session():
    """A local Ray with custom GPU-kind resources and its Prometheus endpoint on a free
    port (refreshed every half second); stopped at session end."""
    import ray

    from deployments.cluster import use_local_serve_env
    from deployments.router import free_port

    RAY_METRICS_PORT[:] = [free_port()]
    use_local_serve_env()
    ray.init(
        address="local",  # a new instance, never one a `ray start` left behind
        num_cpus=2,
        resources=LOCAL_GPU_RESOURCES,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"VLLM_CPU_KVCACHE_SPACE": "1"}},
        _metrics_export_port=RAY_METRICS_PORT[0],
        _system_config={"metrics_report_interval_ms": 500},
    )
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def ray_metrics_url(ray_session) -> str:
    """The session Ray's Prometheus endpoint."""
    return f"http://127.0.0.1:{RAY_METRICS_PORT[0]}/metrics"


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory) -> Path:
    """The tiny model's byte-level BPE alone (specials <s>=0, </s>=1), built locally."""
    from app.engines.tiny_model import TINY_MODEL_NAME, build_tokenizer
    from app.hardware.specs import get_model

    out_dir = tmp_path_factory.mktemp("tiny-tokenizer")
    build_tokenizer(out_dir, get_model(TINY_MODEL_NAME).vocab_size)
    return out_dir


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from app.engines.tiny_model import build_tiny_llama

    os.environ["HF_HUB_OFFLINE"] = "1"
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def vllm_cluster_config(model_dir: Path):
    """Two real vLLM CPU engines on the tiny model (the e2e tests' one set of engines)."""
    from app.engines.config import (
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


def vllm_pd_config(model_dir: Path, name: str, storage: Path):
    """configs/local-vllm-cpu-pd.yaml (one prefill + one decode vLLM CPU engine with the
    ExampleConnector) on `model_dir`, under cluster name `name`, KV files in `storage`."""
    from app.serving.config import load_serve_config

    base = load_serve_config(Path(__file__).resolve().parents[1] / "configs"
                             / "local-vllm-cpu-pd.yaml")
    groups = []
    for group in base.cluster.groups:
        connector = group.engine.kv_connector.model_copy(
            update={"shared_storage_path": str(storage)})
        engine = group.engine.model_copy(update={"model_path": str(model_dir),
                                                 "kv_connector": connector})
        groups.append(group.model_copy(update={"engine": engine}))
    cluster = base.cluster.model_copy(update={"name": name, "groups": groups})
    return base.model_copy(update={"cluster": cluster, "default_slo_s": 300.0})


@contextmanager
def serving(config, app_name: str) -> Iterator[str]:
    """`config`'s router application on a free port (its URL); afterwards every engine
    it started is stopped."""
    from deployments.router import serving as serve_application

    with serve_application(config, app_name) as url:
        yield url


def streamed_completion(url: str, body: dict, *, timeout: float, at_text: int = 0,
                        act=None) -> tuple[list[str], dict | None]:
    """A streamed completion's text chunks and its `goodserve` summary; `act(chunk)`
    runs when the `at_text`-th text chunk has arrived (a move, a kill)."""
    import httpx

    texts, summary = [], None
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=timeout) as reply:
        assert reply.status_code == 200, reply.read()
        for chunk in sse_chunks(reply):
            if "goodserve" in chunk:
                summary = chunk["goodserve"]
                continue
            texts.append(chunk["choices"][0]["text"])
            if act is not None and len(texts) == at_text:
                act(chunk)
    return texts, summary


def migrate_streamed(url: str, chunk: dict, timeout: float) -> str:
    """Ask the router to move the request `chunk` belongs to; the target it chose."""
    import httpx

    request_id = chunk["id"].removeprefix("cmpl-")
    move = httpx.post(url + "/admin/migrate", json={"request_id": request_id},
                      timeout=timeout)
    assert move.status_code == 200, move.text
    return move.json()["target"]


def sse_chunks(response) -> Iterator[dict]:
    """The JSON events of an OpenAI server-sent-event stream, up to `[DONE]`."""
    import json

    for line in response.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line.removeprefix("data: "))
