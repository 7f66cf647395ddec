"""API keys: who gets in, to which routes, how fast; keys never leak into errors."""

from __future__ import annotations

import pytest

from app.serving.auth import (
    ADMIN_KEYS_ENV,
    USER_KEYS_ENV,
    Access,
    ApiKeys,
    RateLimiter,
    parse_keys,
)

pytestmark = pytest.mark.unit

USER, ADMIN = "sk-user-123456", "sk-admin-abcdef"


def test_no_keys_configured_leaves_the_api_open():
    keys = ApiKeys.load(environ={})
    assert not keys.enabled
    assert keys.check(None, Access.ADMIN, 0.0) is None


def test_user_and_admin_keys_from_the_environment_and_files(tmp_path):
    users = tmp_path / "users.txt"
    users.write_text("# team A\nsk-file-user  \n\n")
    keys = ApiKeys.load(keys_file=str(users), environ={
        USER_KEYS_ENV: f" {USER} ,, ", ADMIN_KEYS_ENV: ADMIN})
    for key in (USER, "sk-file-user"):
        assert keys.check(f"Bearer {key}", Access.USER, 0.0) is None
        denied = keys.check(f"Bearer {key}", Access.ADMIN, 0.0)
        assert denied.status_code == 403 and denied.error_type == "permission_error"
    assert keys.check(f"bearer {ADMIN}", Access.ADMIN, 0.0) is None  # scheme is case-blind
    assert keys.check(f"Bearer {ADMIN}", Access.USER, 0.0) is None


@pytest.mark.parametrize("header", [None, "", "Basic abc", "Bearer", f"Bearer {USER}x",
                                    f"Token {USER}", "Bearer sk-admin"])
def test_a_missing_or_wrong_key_is_a_401_that_does_not_echo_it(header):
    keys = ApiKeys([USER], [ADMIN])
    denied = keys.check(header, Access.USER, 0.0)
    assert denied is not None and denied.status_code == 401
    assert denied.error_type == "authentication_error"
    assert denied.headers == {"WWW-Authenticate": "Bearer"}
    assert "sk-" not in denied.message  # no key, right or wrong, is echoed


def test_a_missing_keys_file_is_an_error_naming_the_file(tmp_path):
    with pytest.raises(ValueError, match="cannot read API keys file .*nope"):
        ApiKeys.load(keys_file=str(tmp_path / "nope"), environ={})


def test_keys_are_kept_only_as_digests():
    keys = ApiKeys([USER], [ADMIN])
    assert USER not in repr(vars(keys)) and ADMIN not in repr(vars(keys))


def test_rate_limit_per_key_answers_429_with_retry_after():
    keys = ApiKeys([USER, "sk-other"], limiter=RateLimiter(rate_per_s=2.0, burst=3))
    header = f"Bearer {USER}"
    assert [keys.check(header, Access.USER, 10.0) for _ in range(3)] == [None] * 3
    denied = keys.check(header, Access.USER, 10.0)
    assert denied.status_code == 429 and denied.error_type == "rate_limit_error"
    assert denied.headers == {"Retry-After": "1"}
    assert keys.check("Bearer sk-other", Access.USER, 10.0) is None  # its own bucket
    assert keys.check(header, Access.USER, 10.5) is None  # 0.5 s buys one at 2/s
    assert keys.check(header, Access.USER, 10.5).status_code == 429
    assert keys.check(header, Access.USER, 20.0) is None  # refilled, capped at the burst


def test_parse_keys_splits_env_values_and_files():
    assert parse_keys("a, b,,c ", ",") == ["a", "b", "c"]
    assert parse_keys("a\n # comment\nb # trailing\n") == ["a", "b"]


def test_serve_refuses_to_start_on_an_unreadable_keys_file(tmp_path):
    from typer.testing import CliRunner

    from app.cli import cli

    config = tmp_path / "serve.yaml"
    config.write_text("cluster: {groups: [{engine: {gpu_type: A40}}]}\n"
                      f"auth: {{keys_file: {tmp_path / 'missing-keys'}}}\n")
    result = CliRunner().invoke(cli, ["serve", "--config", str(config)])
    assert result.exit_code == 2
    assert "cannot read API keys file" in result.output and "missing-keys" in result.output


def test_a_clock_that_steps_back_takes_no_tokens_away():
    limiter = RateLimiter(rate_per_s=1.0, burst=2)
    assert limiter.take(b"k", 100.0) == 0.0
    assert limiter.take(b"k", 99.0) == 0.0  # 1 s back: the second token is still there
    assert limiter.take(b"k", 99.5) > 0  # empty; and no refill until the clock passes 100
    assert limiter.take(b"k", 101.0) == 0.0
