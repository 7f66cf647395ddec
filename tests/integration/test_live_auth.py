"""API keys over HTTP through Ray Serve: every route but /health needs a key when keys
are configured, admin routes an admin key, each key its own rate, and no key reaches
a log or a config written out."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from app.engines.config import ClusterConfig, EngineConfig, InstanceGroup
from app.serving.config import AuthConfig, ServeConfig
from tests.conftest import serving

pytestmark = pytest.mark.integration

# Each test has its own keys, so each starts with full buckets in any order (the tests
# run shuffled and the rate limit is per key).
USER, ADMIN = "sk-user-7f3a9c2e51", "sk-admin-0b8d4e6a17"  # the routes test
LIMITED, OTHER = "sk-limited-5c1e9a", "sk-other-3d9b27"  # the rate test
LOG_USER, LOG_ADMIN = "sk-loguser-8e2f41", "sk-logadmin-6a0c93"  # the log test
SECRETS = (USER, ADMIN, LIMITED, OTHER, LOG_USER, LOG_ADMIN, "sk-wrong-but-secret")


@pytest.fixture(scope="module")
def auth_url(ray_session, tmp_path_factory):
    directory = tmp_path_factory.mktemp("keys")
    (directory / "users").write_text(f"{USER}\n{LIMITED}\n{OTHER}\n{LOG_USER}\n")
    (directory / "admins").write_text(f"# operators\n{ADMIN}\n{LOG_ADMIN}\n")
    auth = AuthConfig(keys_file=str(directory / "users"),
                      admin_keys_file=str(directory / "admins"),
                      rate_limit_rps=0.5, rate_limit_burst=3)
    config = ServeConfig(cluster=ClusterConfig(name="auth", groups=[
        InstanceGroup(engine=EngineConfig(gpu_type="H800"))]), auth=auth)
    assert USER not in config.model_dump_json()  # paths only
    with serving(config, "auth") as url:
        yield url


def call(url: str, method: str, path: str, key: str | None, **json: object) -> httpx.Response:
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    completion = {"model": "goodserve", "prompt": "hello there", "max_tokens": 4}
    body = json if path == "/admin/migrate" else completion | json
    return httpx.request(method, url + path, headers=headers, timeout=60,
                         json=body if method == "POST" else None)


def test_routes_need_a_key_and_admin_routes_an_admin_key(auth_url):
    assert call(auth_url, "GET", "/health", None).status_code == 200
    for method, path in (("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                         ("GET", "/v1/models"), ("GET", "/v1/instances"),
                         ("POST", "/admin/migrate")):
        for key in (None, "sk-wrong"):
            reply = call(auth_url, method, path, key)
            assert reply.status_code == 401, (method, path, reply.text)
            assert reply.json()["error"]["type"] == "authentication_error"
            assert reply.headers["www-authenticate"] == "Bearer"
    assert call(auth_url, "POST", "/v1/completions", USER).status_code == 200
    assert call(auth_url, "GET", "/v1/models", USER).status_code == 200
    for method, path in (("GET", "/v1/instances"), ("POST", "/admin/migrate")):
        assert call(auth_url, method, path, USER).status_code == 403
    assert call(auth_url, "GET", "/v1/instances", ADMIN).status_code == 200
    missing = call(auth_url, "POST", "/admin/migrate", ADMIN, request_id="gone")
    assert missing.status_code == 404  # let in; nothing to move
    assert call(auth_url, "POST", "/v1/completions", ADMIN).status_code == 200


def test_each_key_has_its_own_rate_and_a_429_says_when_to_retry(auth_url):
    codes = [call(auth_url, "GET", "/v1/models", LIMITED).status_code for _ in range(5)]
    assert codes[:3] == [200, 200, 200] and 429 in codes[3:]
    limited = call(auth_url, "GET", "/v1/models", LIMITED)
    assert limited.status_code == 429 and int(limited.headers["retry-after"]) >= 1
    assert limited.json()["error"]["type"] == "rate_limit_error"
    assert call(auth_url, "GET", "/v1/models", OTHER).status_code == 200  # its own bucket


def test_no_key_appears_in_the_session_logs(auth_url, ray_session):
    """Its own keys go through every outcome here (admitted, admin, refused for the
    rate, invalid), and the scan must find the requests' own log lines, so it reads the
    logs they went to; the other tests' keys are scanned for too, in whatever order the
    tests ran."""
    assert call(auth_url, "POST", "/v1/completions", LOG_USER).status_code == 200
    assert call(auth_url, "GET", "/v1/instances", LOG_ADMIN).status_code == 200
    codes = [call(auth_url, "GET", "/v1/models", LOG_USER).status_code for _ in range(4)]
    assert 429 in codes
    call(auth_url, "POST", "/v1/completions", "sk-wrong-but-secret")
    logs = Path(ray_session._private.worker.global_worker.node.get_logs_dir_path())
    deadline_s = time.monotonic() + 30
    while True:  # Serve writes its access log lines a moment after the replies
        texts = {path: path.read_text(errors="ignore")
                 for path in logs.rglob("*") if path.is_file()}
        if any("/v1/instances" in text for text in texts.values()):
            break
        assert time.monotonic() < deadline_s, "no log line of the requests was found"
        time.sleep(0.5)
    for path, text in texts.items():
        for secret in SECRETS:
            assert secret not in text, f"{secret} in {path}"
