"""Fuzzing the published API: schemathesis generates requests from `/openapi.json`
(valid bodies and invalid ones: wrong types, missing fields, edge values) for every
route, sent over HTTP to the router on fast simulated engines. No reply may be a 5xx,
every rejection is a 4xx with an OpenAI-style error body, and the server is healthy
afterwards.

Schemathesis' own runner sends through `requests`, which fails next to the
urllib3-future that grafana-client's HTTP stack installs; the cases are therefore
drawn from schemathesis' strategies (hypothesis) and sent with httpx."""

from __future__ import annotations

import json
from collections import Counter

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.core import NotSet

from app.engines.config import ClusterConfig, EngineConfig, InstanceGroup
from app.serving.config import ServeConfig
from tests.conftest import serving

pytestmark = pytest.mark.integration

EXAMPLES_PER_MODE = 250  # per route with a body and mode (the bodiless GETs give one each)
MODEL = "goodserve"


@pytest.fixture(scope="module")
def fuzz_url(ray_session):
    """Two engines running 1000x faster than real time, so generated requests with
    large `max_tokens` end quickly."""
    engines = [EngineConfig(gpu_type=gpu, time_scale=0.001) for gpu in ("H800", "A40")]
    config = ServeConfig(cluster=ClusterConfig(
        name="fuzz", groups=[InstanceGroup(engine=e) for e in engines]))
    with serving(config, "fuzz") as url:
        yield url


def send(client: httpx.Client, case) -> tuple[int, bytes]:
    kwargs: dict = {"params": case.query or None, "headers": dict(case.headers or {})}
    if isinstance(case.body, bytes | str):  # negative mode: a body that is not JSON
        kwargs["content"] = case.body
        kwargs["headers"].setdefault("Content-Type", case.media_type or "application/json")
    elif not isinstance(case.body, NotSet):
        kwargs["content"] = json.dumps(case.body).encode()
        kwargs["headers"]["Content-Type"] = "application/json"
    response = client.request(case.method, case.formatted_path, **kwargs)
    return response.status_code, response.content


# what simulated engines refuse (no text to constrain, no token probabilities)
SIMULATION_REFUSES = ("logprobs", "top_logprobs", "response_format", "structured_outputs",
                      "tools", "tool_choice")


def served_model(case):
    """Half the generated bodies name the served model and leave out what simulated
    engines refuse, so they get past those checks and through routing to the engines
    (a random name is a 404)."""
    if isinstance(case.body, dict) and "model" in case.body and len(str(case.body)) % 2:
        case.body["model"] = MODEL
        for name in SIMULATION_REFUSES:
            case.body.pop(name, None)
    return case


def test_generated_requests_get_no_server_error_and_openai_errors(fuzz_url):
    document = httpx.get(fuzz_url + "/openapi.json", timeout=30).json()
    assert document["paths"]["/v1/completions"]["post"]["requestBody"]["required"]
    schema = schemathesis.openapi.from_dict(document)
    outcomes: Counter[tuple[str, int]] = Counter()
    problems: list[str] = []
    with httpx.Client(base_url=fuzz_url, timeout=120) as client:
        for result in schema.get_all_operations():
            operation = result.ok()
            modes = [GenerationMode.POSITIVE]
            if operation.body:
                modes.append(GenerationMode.NEGATIVE)
            for mode in modes:
                @settings(max_examples=EXAMPLES_PER_MODE, deadline=None, database=None,
                          suppress_health_check=list(HealthCheck))
                @given(case=operation.as_strategy(generation_mode=mode).map(served_model))
                def exchange(case) -> None:
                    status, content = send(client, case)
                    outcomes[case.operation.label, status] += 1
                    if status >= 500:
                        problems.append(f"{status} {case.operation.label}: {case.body!r:.300}")
                    elif status >= 400:
                        error = json.loads(content).get("error", {})
                        if not (error.get("message") and error.get("type")):
                            problems.append(f"not an OpenAI error: {content[:200]!r}")

                exchange()
    total = sum(outcomes.values())
    assert total >= 1000, outcomes
    assert not problems, problems[:10]
    statuses = Counter(status for _, status in outcomes.elements())
    assert statuses[200] > 50 and sum(n for s, n in statuses.items() if s >= 400) > 500
    assert httpx.get(fuzz_url + "/health", timeout=30).status_code == 200
