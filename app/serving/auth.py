"""API keys and per-key request rates, Ray-free.

Keys come from the environment (`GOODSERVE_API_KEYS`, `GOODSERVE_ADMIN_API_KEYS`,
comma-separated) and from files the config names (one key per line, `#` comments):
the config holds paths, never keys, so a config written out or logged carries none.
With no key configured the API is open, as before. Admin keys open every route; user
keys every route but the admin ones (`/admin/*`, `/v1/instances`). Keys are compared
in constant time against every configured key (no early exit on the first match), and
only their SHA-256 digests are kept in memory after loading. The rate limit is a token
bucket per key; `now` is an argument.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

USER_KEYS_ENV = "GOODSERVE_API_KEYS"
ADMIN_KEYS_ENV = "GOODSERVE_ADMIN_API_KEYS"
BEARER = "bearer "


class Access(StrEnum):
    USER = "user"
    ADMIN = "admin"


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def parse_keys(text: str, separator: str | None = None) -> list[str]:
    """Keys from an env value (comma-separated) or a file (a key per line, # comments)."""
    if separator is not None:
        return [k.strip() for k in text.split(separator) if k.strip()]
    keys = []
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            keys.append(line)
    return keys


def read_keys_file(path: str) -> list[str]:
    """A keys file's keys; a missing or unreadable file is a configuration error that
    names the file, never its content."""
    try:
        return parse_keys(Path(path).expanduser().read_text())
    except OSError as exc:
        raise ValueError(f"cannot read API keys file {path}: {exc.strerror}") from None


@dataclass(frozen=True)
class Denied:
    """Why a request is not let in: HTTP status, OpenAI error type, message, headers."""

    status_code: int
    error_type: str
    message: str
    headers: Mapping[str, str] = field(default_factory=dict)


@dataclass
class _Bucket:
    tokens: float
    updated_s: float


@dataclass
class RateLimiter:
    """Token bucket per key: `rate_per_s` sustained, `burst` at once."""

    rate_per_s: float
    burst: float
    _buckets: dict[bytes, _Bucket] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not (self.rate_per_s > 0 and self.burst >= 1):
            raise ValueError("rate limit needs rate > 0 and burst >= 1")

    def take(self, key_digest: bytes, now: float) -> float:
        """Spend one request; 0 when allowed, else seconds until one is."""
        bucket = self._buckets.get(key_digest)
        if bucket is None:
            bucket = self._buckets[key_digest] = _Bucket(self.burst, now)
        # a clock that steps back refills nothing (and takes nothing away)
        elapsed_s = max(now - bucket.updated_s, 0.0)
        bucket.tokens = min(self.burst, bucket.tokens + elapsed_s * self.rate_per_s)
        bucket.updated_s = max(now, bucket.updated_s)
        if bucket.tokens >= 1:
            bucket.tokens -= 1
            return 0.0
        return (1 - bucket.tokens) / self.rate_per_s


class ApiKeys:
    """The configured keys (as digests) and what each may do."""

    def __init__(self, user_keys: Iterable[str], admin_keys: Iterable[str] = (),
                 limiter: RateLimiter | None = None) -> None:
        self._admin = [_digest(k) for k in admin_keys]
        self._user = [_digest(k) for k in user_keys]
        self.limiter = limiter

    @classmethod
    def load(cls, keys_file: str | None = None, admin_keys_file: str | None = None,
             environ: Mapping[str, str] = os.environ,
             limiter: RateLimiter | None = None) -> ApiKeys:
        users = parse_keys(environ.get(USER_KEYS_ENV, ""), ",")
        admins = parse_keys(environ.get(ADMIN_KEYS_ENV, ""), ",")
        if keys_file:
            users += read_keys_file(keys_file)
        if admin_keys_file:
            admins += read_keys_file(admin_keys_file)
        return cls(users, admins, limiter)

    @property
    def enabled(self) -> bool:
        return bool(self._user or self._admin)

    def _matches(self, digest: bytes, keys: list[bytes]) -> bool:
        found = False
        for known in keys:  # every key compared: the time does not tell which matched
            found |= hmac.compare_digest(digest, known)
        return found

    def check(self, authorization: str | None, access: Access, now: float) -> Denied | None:
        """None when the `Authorization` header lets the request in for `access`."""
        if not self.enabled:
            return None
        if not authorization or not authorization.lower().startswith(BEARER):
            return Denied(401, "authentication_error",
                          "missing API key: send 'Authorization: Bearer <key>'",
                          {"WWW-Authenticate": "Bearer"})
        digest = _digest(authorization[len(BEARER):].strip())
        is_admin = self._matches(digest, self._admin)
        is_user = self._matches(digest, self._user)
        if not (is_admin or is_user):
            return Denied(401, "authentication_error", "invalid API key",
                          {"WWW-Authenticate": "Bearer"})
        if access is Access.ADMIN and not is_admin:
            return Denied(403, "permission_error", "this route needs an admin API key")
        if self.limiter is not None:
            wait_s = self.limiter.take(digest, now)
            if wait_s > 0:
                return Denied(429, "rate_limit_error",
                              f"rate limit of {self.limiter.rate_per_s:g} requests/s "
                              f"exceeded; retry in {wait_s:.2f} s",
                              {"Retry-After": str(max(1, math.ceil(wait_s)))})
        return None
