"""Grafana dashboards as code: panels and their PromQL, the JSON Grafana imports,
provisioning through Grafana's HTTP API (`grafana-client`), and a matplotlib
rendering straight from Prometheus for a look without Grafana.

`goodserve dashboards generate` writes `deployments/grafana/*.json` (committed; a test
keeps them equal to what this module generates), `push` provisions a folder, the
Prometheus datasource and the dashboards, `render` draws the panels to PNG. Every
expression runs as-is in Prometheus (fixed rate windows, no Grafana macros), so a
test can execute each one against a real Prometheus.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

__all__ = ["DASHBOARDS", "Dashboard", "Panel", "Query", "dashboard_json", "push", "render",
           "write_dashboards"]

GRAFANA_DIR = Path(__file__).resolve().parent / "grafana"
FOLDER_UID = "goodserve"
FOLDER_TITLE = "GoodServe"
DATASOURCE_UID = "goodserve-prometheus"
DATASOURCE_NAME = "GoodServe Prometheus"
SCHEMA_VERSION = 39


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str = ""


@dataclass(frozen=True)
class Panel:
    title: str
    queries: tuple[Query, ...]
    unit: str = "short"
    description: str = ""


@dataclass(frozen=True)
class Dashboard:
    uid: str
    title: str
    description: str
    panels: tuple[Panel, ...]

    @property
    def file_name(self) -> str:
        return f"{self.uid}.json"


def _rate(series: str, selector: str = "", window: str = "1m") -> str:
    return f"rate(ray_goodserve_{series}{{{selector}}}[{window}])"


def _sum(expr: str, by: str = "") -> str:
    return f"sum by ({by}) ({expr})" if by else f"sum({expr})"


MET = 'outcome="met"'


def _quantile(q: float, histogram: str, by: str = "", window: str = "5m") -> str:
    groups = ", ".join(x for x in ("le", by) if x)
    return (f"histogram_quantile({q}, sum by ({groups}) "
            f"(rate(ray_goodserve_{histogram}_bucket[{window}])))")


def _per_gpu(gauge: str, how: str = "avg") -> Query:
    """An instance gauge per GPU type; every router replica reports each instance, so
    an instance's series are first reduced to one."""
    return Query(f"{how} by (gpu_type) (max by (instance, gpu_type) "
                 f"(ray_goodserve_instance_{gauge}))", "{{gpu_type}}")


SLO = Dashboard("goodserve-slo", "GoodServe - SLOs and goodput",
                "Requests finished within their deadline, and how close the rest came", (
    Panel("Goodput (requests met per second)", (
        Query(_sum(_rate("requests_total", MET)), "met"),), "reqps"),
    Panel("SLO attainment (met / finished with a deadline, 5 min)", (
        Query(_sum(_rate("requests_total", MET, "5m")) + " / "
              + _sum(_rate("requests_total", 'outcome=~"met|missed"', "5m")), "attainment"),),
        "percentunit"),
    Panel("Requests by outcome", (
        Query(_sum(_rate("requests_total"), "outcome"), "{{outcome}}"),), "reqps"),
    Panel("Rejections by reason", (
        Query(_sum(_rate("requests_total", 'outcome="rejected"', "5m"), "reason"),
              "{{reason}}"),), "reqps"),
    Panel("Latency vs deadline", (
        Query(_quantile(0.5, "request_latency_seconds"), "latency p50"),
        Query(_quantile(0.99, "request_latency_seconds"), "latency p99"),
        Query(_quantile(0.5, "request_deadline_seconds"), "deadline p50"),
        Query(_quantile(0.5, "ttft_seconds"), "TTFT p50")), "s"),
    Panel("Deadline slack at finish (p50: time left when met, time late when missed)", (
        Query(_quantile(0.5, "deadline_slack_seconds", "outcome"), "{{outcome}}"),), "s"),
    Panel("Token goodput (output tokens of met requests per second)", (
        Query(_sum(_rate("goodput_tokens_total")), "goodput"),
        Query(_sum(_rate("output_tokens_total")), "all output")), "short"),
    Panel("Prompt tokens per second, and the share the engines had cached", (
        Query(_sum(_rate("prompt_tokens_total")), "prompt tokens"),
        Query(_sum(_rate("cached_prompt_tokens_total", window="5m")) + " / "
              + _sum(_rate("prompt_tokens_total", window="5m")), "cached share")), "short"),
))

FLEET = Dashboard("goodserve-fleet", "GoodServe - fleet by GPU type",
                  "Load and the status estimator's view of each GPU type", (
    Panel("Running requests", (_per_gpu("running", "sum"),)),
    Panel("Waiting requests", (_per_gpu("waiting", "sum"),)),
    Panel("Queueing delay q_g (estimated)", (_per_gpu("queue_delay_seconds"),), "s"),
    Panel("Prefill time per token p_g (estimated)", (
        _per_gpu("prefill_seconds_per_token"),), "s"),
    Panel("Decode time per token d_g (estimated)", (
        _per_gpu("decode_seconds_per_token"),), "s"),
    Panel("KV cache in use", (_per_gpu("kv_usage"),), "percentunit"),
    Panel("Engine iterations per second", (_per_gpu("iterations_per_second", "sum"),)),
    Panel("Healthy instances", (_per_gpu("healthy", "sum"),)),
))

ROUTING = Dashboard("goodserve-routing", "GoodServe - routing, prediction, migration",
                    "Where requests go, how long deciding takes, how good the predicted "
                    "lengths are, and what moved", (
    Panel("Placements by GPU type", (
        Query(_sum(_rate("routing_decisions_total"), "gpu_type"), "{{gpu_type}}"),),
        "reqps"),
    Panel("Routing decision time", (
        Query(_quantile(0.5, "routing_decision_seconds"), "p50"),
        Query(_quantile(0.99, "routing_decision_seconds"), "p99")), "s"),
    Panel("Arrival to placement (tokenizing, prediction and policy)", (
        Query(_quantile(0.5, "routing_arrival_to_placement_seconds"), "p50"),
        Query(_quantile(0.99, "routing_arrival_to_placement_seconds"), "p99")), "s"),
    Panel("Prediction time per request", (
        Query(_quantile(0.5, "prediction_seconds"), "p50"),
        Query(_quantile(0.99, "prediction_seconds"), "p99")), "s"),
    Panel("Output-length error |predicted - actual|", (
        Query(_quantile(0.5, "output_length_error_tokens"), "p50"),
        Query(_quantile(0.9, "output_length_error_tokens"), "p90")), "short"),
    Panel("Predicted / actual output length", (
        Query(_quantile(0.1, "output_length_ratio"), "p10"),
        Query(_quantile(0.5, "output_length_ratio"), "p50"),
        Query(_quantile(0.9, "output_length_ratio"), "p90")), "short"),
    Panel("Migrations by reason and path", (
        Query("sum by (reason, path) (increase(ray_goodserve_migrations_total[5m]))",
              "{{reason}} {{path}}"),), "short"),
    Panel("Move time to the target's first token, by path", (
        Query(_quantile(0.5, "move_seconds", "path"), "p50 {{path}}"),
        Query(_quantile(0.99, "move_seconds", "path"), "p99 {{path}}")), "s"),
    Panel("KV bytes per move, by path", (
        Query(_quantile(0.5, "move_kv_bytes", "path"), "p50 {{path}}"),
        Query(_quantile(0.99, "move_kv_bytes", "path"), "p99 {{path}}")), "bytes"),
    Panel("KV hand-off (prefill to decode)", (
        Query(_quantile(0.5, "kv_transfer_seconds"), "p50"),
        Query(_quantile(0.99, "kv_transfer_seconds"), "p99")), "s"),
    Panel("KV bytes handed off per second", (
        Query(_sum(_rate("kv_transfer_bytes_total")), "bytes/s"),), "Bps"),
))

POOLS = Dashboard("goodserve-pools", "GoodServe - pools and cost",
                  "What the SARA controller wants, what runs, and what it costs", (
    Panel("Target vs held engines per pool", (
        Query("max by (role, gpu_type) (ray_goodserve_pool_target_engines)",
              "target {{role}} {{gpu_type}}"),
        Query('sum by (role, gpu_type) (ray_goodserve_pool_engines{state!="draining"})',
              "held {{role}} {{gpu_type}}")), "short"),
    Panel("Engines by state", (
        Query("sum by (state) (ray_goodserve_pool_engines)", "{{state}}"),), "short"),
    Panel("Cost vs budget (USD per hour)", (
        Query("max(ray_goodserve_pool_cost_per_hour)", "held"),
        Query("max(ray_goodserve_pool_target_cost_per_hour)", "target"),
        Query("max(ray_goodserve_pool_budget_per_hour)", "budget")), "currencyUSD"),
    Panel("Request rate: observed, forecast, sized for", (
        Query("max by (kind) (ray_goodserve_pool_rate_rps)", "{{kind}}"),), "reqps"),
    Panel("Binding constraint", (
        Query("max by (constraint) (ray_goodserve_pool_binding_constraint)",
              "{{constraint}}"),), "short"),
    Panel("Plan changes", (
        Query("sum by (action) (increase(ray_goodserve_plan_changes_total[5m]))",
              "{{action}}"),), "short"),
))

DASHBOARDS = (SLO, FLEET, ROUTING, POOLS)


def dashboard_json(dashboard: Dashboard) -> dict[str, Any]:
    """The dashboard model Grafana imports (timeseries panels, two per row, a
    datasource variable so it works with any Prometheus datasource)."""
    panels = []
    for i, panel in enumerate(dashboard.panels):
        panels.append({
            "id": i + 1,
            "type": "timeseries",
            "title": panel.title,
            "description": panel.description,
            "gridPos": {"x": 12 * (i % 2), "y": 8 * (i // 2), "w": 12, "h": 8},
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "fieldConfig": {"defaults": {"unit": panel.unit}, "overrides": []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
            "targets": [{"refId": chr(ord("A") + j), "expr": q.expr, "legendFormat": q.legend,
                         "datasource": {"type": "prometheus", "uid": "${datasource}"}}
                        for j, q in enumerate(panel.queries)],
        })
    return {
        "uid": dashboard.uid,
        "title": dashboard.title,
        "description": dashboard.description,
        "tags": ["goodserve"],
        "timezone": "browser",
        "schemaVersion": SCHEMA_VERSION,
        "refresh": "10s",
        "time": {"from": "now-30m", "to": "now"},
        "templating": {"list": [{
            "name": "datasource", "label": "Prometheus", "type": "datasource",
            "query": "prometheus", "current": {"text": DATASOURCE_NAME, "value": DATASOURCE_UID},
        }]},
        "panels": panels,
    }


def write_dashboards(directory: Path = GRAFANA_DIR) -> list[Path]:
    """Write every dashboard's JSON into `directory`; the paths written."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for dashboard in DASHBOARDS:
        path = directory / dashboard.file_name
        path.write_text(json.dumps(dashboard_json(dashboard), indent=2) + "\n")
        paths.append(path)
    return paths


def all_queries() -> list[tuple[str, str, str]]:
    """(dashboard uid, panel title, expression) for every query of every dashboard."""
    return [(d.uid, p.title, q.expr) for d in DASHBOARDS for p in d.panels for q in p.queries]


# ---- provisioning --------------------------------------------------------------------------
def push(url: str, token: str, prometheus_url: str) -> dict[str, str]:
    """Provision the folder, the Prometheus datasource and every dashboard in the
    Grafana at `url`, creating what is missing and updating what is there (running it
    twice changes nothing the second time); what happened to each, by name."""
    from grafana_client import GrafanaApi
    from grafana_client.client import GrafanaClientError

    api = GrafanaApi.from_url(url, credential=token)
    done: dict[str, str] = {}

    def missing(get: Any, uid: str) -> bool:
        try:
            get(uid)
        except GrafanaClientError as exc:
            if exc.status_code == 404:
                return True
            raise
        return False

    if missing(api.folder.get_folder, FOLDER_UID):
        api.folder.create_folder(FOLDER_TITLE, uid=FOLDER_UID)
        done["folder"] = "created"
    else:
        done["folder"] = "present"
    datasource = {"uid": DATASOURCE_UID, "name": DATASOURCE_NAME, "type": "prometheus",
                  "access": "proxy", "url": prometheus_url, "isDefault": False,
                  "jsonData": {"httpMethod": "POST"}}
    if missing(api.datasource.get_datasource_by_uid, DATASOURCE_UID):
        api.datasource.create_datasource(datasource)
        done["datasource"] = "created"
    else:
        api.datasource.update_datasource_by_uid(DATASOURCE_UID, datasource)
        done["datasource"] = "updated"
    for dashboard in DASHBOARDS:
        api.dashboard.update_dashboard({"dashboard": dashboard_json(dashboard),
                                        "folderUid": FOLDER_UID, "overwrite": True,
                                        "message": "provisioned by goodserve"})
        done[dashboard.uid] = "saved"
    return done


# ---- rendering -----------------------------------------------------------------------------
def query_range(prometheus_url: str, expr: str, start_s: float, end_s: float,
                step_s: float) -> list[dict[str, Any]]:
    """Prometheus' range query: a list of {"metric": labels, "values": [[t, v], ...]}."""
    response = httpx.get(f"{prometheus_url.rstrip('/')}/api/v1/query_range", timeout=30,
                         params={"query": expr, "start": start_s, "end": end_s,
                                 "step": step_s})
    response.raise_for_status()
    body = response.json()
    if body.get("status") != "success":
        raise RuntimeError(f"Prometheus refused {expr!r}: {body.get('error')}")
    return body["data"]["result"]


def _legend(template: str, labels: dict[str, str]) -> str:
    text = template
    for key, value in labels.items():
        text = text.replace("{{" + key + "}}", value)
    return text or ",".join(f"{k}={v}" for k, v in labels.items() if not k.startswith("__"))


def render(prometheus_url: str, out: Path, minutes: float = 15.0,
           dashboards: Sequence[Dashboard] = DASHBOARDS, end_s: float | None = None
           ) -> list[Path]:
    """Draw each dashboard's panels over the last `minutes` from Prometheus, one PNG per
    dashboard (a grid, two panels per row); the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    end = time.time() if end_s is None else end_s
    start = end - minutes * 60
    step = max(minutes * 60 / 240, 1.0)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for dashboard in dashboards:
        rows = math.ceil(len(dashboard.panels) / 2)
        fig, axes = plt.subplots(rows, 2, figsize=(13, 3.2 * rows), squeeze=False)
        for ax, panel in zip(axes.flat, dashboard.panels, strict=False):
            for query in panel.queries:
                for series in query_range(prometheus_url, query.expr, start, end, step):
                    times = [(float(t) - end) / 60 for t, _ in series["values"]]
                    values = [float(v) for _, v in series["values"]]
                    ax.plot(times, values, label=_legend(query.legend, series["metric"]))
            ax.set_title(panel.title, fontsize=9)
            ax.set_xlabel("minutes before now", fontsize=8)
            ax.set_ylabel(panel.unit, fontsize=8)
            ax.tick_params(labelsize=7)
            if ax.lines:
                ax.legend(fontsize=7)
            else:
                ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        for ax in axes.flat[len(dashboard.panels):]:
            ax.set_visible(False)
        fig.suptitle(dashboard.title)
        fig.tight_layout()
        path = out / f"{dashboard.uid}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        paths.append(path)
    return paths
