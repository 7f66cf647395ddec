"""The deployment files a platform team applies: cluster.yaml passes Ray's own cluster
launcher validation, and the KubeRay RayService carries what the application needs.

KubeRay's CRD schema is not published on the package registries this project builds
from, so the manifest is parsed and checked field by field against the application
(import path, serve config, GPU-kind resources, metrics port, Ray version)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import ray
import yaml

from app.serving.config import load_serve_config
from deployments.cluster import NODE_HEALTH_CHECK

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def test_cluster_yaml_passes_rays_cluster_launcher_validation():
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    validate_config(prepare_config(config))  # what `ray up` runs first
    head = " ".join(config["head_start_ray_commands"])
    assert "--metrics-export-port=8080" in head
    assert "--metrics-export-port=8080" in " ".join(config["worker_start_ray_commands"])
    assert system_config(head) == NODE_HEALTH_CHECK  # what the node-loss tests run with
    broken = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    broken["available_node_types"]["head"]["resources"] = "GPU: 1"
    with pytest.raises(Exception, match="is not of type 'object'"):
        validate_config(prepare_config(broken))


def system_config(command: str) -> dict:
    """`ray start --system-config='{...}'`'s JSON."""
    return json.loads(command.split("--system-config=", 1)[1].split("'")[1])


def gpu_units(params: dict) -> dict[str, float]:
    """KubeRay's `resources` start parameter: a JSON object inside a quoted string."""
    if "resources" not in params:
        return {}
    return json.loads(json.loads(params["resources"]))


def test_kuberay_rayservice_deploys_the_app_on_its_gpu_kinds():
    manifest = yaml.safe_load((ROOT / "configs" / "kuberay-rayservice.yaml").read_text())
    assert manifest["apiVersion"] == "ray.io/v1" and manifest["kind"] == "RayService"
    spec = manifest["spec"]
    (application,) = yaml.safe_load(spec["serveConfigV2"])["applications"]
    assert application["import_path"] == "app.main:build"
    config = load_serve_config(ROOT / application["args"]["config"])
    cluster = spec["rayClusterConfig"]
    assert cluster["rayVersion"] == ray.__version__
    head = cluster["headGroupSpec"]
    assert head["rayStartParams"]["metrics-export-port"] == "8080"
    assert head["rayStartParams"]["num-gpus"] == "0"  # the router runs on the head
    assert json.loads(head["rayStartParams"]["system-config"]) == NODE_HEALTH_CHECK
    ports = {p["containerPort"] for p in head["template"]["spec"]["containers"][0]["ports"]}
    assert {6379, 8000, 8080} <= ports
    capacity: dict[str, float] = {}
    for group in cluster["workerGroupSpecs"]:
        assert group["rayStartParams"]["metrics-export-port"] == "8080"
        (container,) = group["template"]["spec"]["containers"]
        units = gpu_units(group["rayStartParams"])
        (name, amount), = units.items()
        assert name.startswith("gpu_type:")
        assert container["resources"]["limits"]["nvidia.com/gpu"] == amount  # one unit a GPU
        assert {m["mountPath"] for m in container["volumeMounts"]} == {"/models"}
        capacity[name] = capacity.get(name, 0) + amount * group["maxReplicas"]
    need: dict[str, int] = {}
    for engine in config.cluster.engines():
        assert engine.model_path.startswith("/models/")
        need[engine.resource_name] = need.get(engine.resource_name, 0) + engine.tp
    assert all(need[name] <= capacity.get(name, 0) for name in need), (need, capacity)


def test_the_example_scrape_config_finds_nodes_through_rays_discovery_file():
    config = yaml.safe_load((ROOT / "deployments" / "prometheus-cluster.yml").read_text())
    (job,) = config["scrape_configs"]
    assert job["file_sd_configs"][0]["files"] == ["/tmp/ray/prom_metrics_service_discovery.json"]
