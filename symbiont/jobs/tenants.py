"""Tenants: who may call the server, with which key, within which limits.

The tenants file is JSON, one entry per tenant:

    {"alice": {"api_key": "sk-alice-...", "max_concurrent_jobs": 2,
               "max_file_bytes": 100000000, "requests_per_minute": 600},
     "bob":   {"api_key": "sha256:9f86d08...", ...}}

A key given as `sha256:<hex>` is stored hashed: the server hashes what a client sends
and compares digests. Every comparison is constant-time (`hmac.compare_digest`), and every
tenant's key is compared, so the time taken does not tell which tenant (if any) matched.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import os
import re
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

DEFAULT_TENANT = "default"  # the one tenant of a server started without --tenants
LIMITS = {"max_concurrent_jobs": 2, "max_file_bytes": 100_000_000, "requests_per_minute": 600}
_HEX = re.compile(r"[0-9a-fA-F]{64}")
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


@dataclass(frozen=True)
class Tenant:
    name: str
    key_digest: bytes  # sha256 of the key
    max_concurrent_jobs: int = LIMITS["max_concurrent_jobs"]
    max_file_bytes: int = LIMITS["max_file_bytes"]
    requests_per_minute: int = LIMITS["requests_per_minute"]


def load_tenants(path: str | os.PathLike) -> dict[str, Tenant]:
    """Read and validate a tenants file; ValueError naming the tenant and field at fault."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise ValueError(f"--tenants {path}: cannot read it ({err.strerror})") from None
    except json.JSONDecodeError as err:
        raise ValueError(
            f"--tenants {path}: not valid JSON ({err.msg}, line {err.lineno})"
        ) from None
    if not isinstance(data, dict) or not data:
        raise ValueError(f"--tenants {path}: expected an object of tenant name -> settings")
    tenants = {name: _tenant(path, name, entry) for name, entry in data.items()}
    digests = [t.key_digest for t in tenants.values()]
    if len(set(digests)) != len(digests):
        raise ValueError(f"--tenants {path}: two tenants share one api_key; give each its own")
    return tenants


def _tenant(path: Path, name: str, entry) -> Tenant:
    where = f"--tenants {path}: tenant {name!r}"
    if not _NAME.fullmatch(name):
        raise ValueError(f"{where}: names are 1-64 letters, digits, '-', '_' or '.'")
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: expected an object with api_key and limits")
    unknown = sorted(set(entry) - {"api_key", *LIMITS})
    if unknown:
        raise ValueError(
            f"{where}: unknown field {unknown[0]!r}; known: api_key, {', '.join(LIMITS)}"
        )
    limits = {}
    for field, default in LIMITS.items():
        value = entry.get(field, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{where}: {field} must be an integer >= 1, got {value!r}")
        limits[field] = value
    return Tenant(name, _digest(where, entry.get("api_key")), **limits)


def _digest(where: str, key) -> bytes:
    if not isinstance(key, str) or not key:
        raise ValueError(f"{where}: api_key must be a non-empty string")
    if key.startswith("sha256:"):
        hexdigest = key.removeprefix("sha256:")
        if not _HEX.fullmatch(hexdigest):
            raise ValueError(f"{where}: api_key 'sha256:<hex>' needs 64 hex digits")
        return bytes.fromhex(hexdigest)
    return hashlib.sha256(key.encode()).digest()


def authenticate(tenants: dict[str, Tenant], authorization: str) -> Tenant | None:
    """The tenant whose key is in `Authorization: Bearer <key>`, else None. Compares
    against every tenant in constant time."""
    scheme, _, key = authorization.partition(" ")
    given = hashlib.sha256(key.strip().encode("latin-1", "replace")).digest()
    found = None
    for tenant in tenants.values():
        if hmac.compare_digest(given, tenant.key_digest) and scheme.lower() == "bearer":
            found = tenant
    return found


class RateLimiter:
    """Requests per minute per tenant, over a sliding 60 s window."""

    WINDOW_S = 60.0

    def __init__(self, clock=time.monotonic):
        self._clock = clock
        self._seen: dict[str, deque[float]] = {}
        self._lock = threading.Lock()

    def admit(self, tenant: Tenant) -> float:
        """0 if the request may go ahead (and count it), else seconds until it may."""
        now = self._clock()
        with self._lock:
            seen = self._seen.setdefault(tenant.name, deque())
            while seen and seen[0] <= now - self.WINDOW_S:
                seen.popleft()
            if len(seen) >= tenant.requests_per_minute:
                return max(seen[0] + self.WINDOW_S - now, 0.001)
            seen.append(now)
            return 0.0


def retry_after(seconds: float) -> str:
    """The Retry-After header value: whole seconds, at least 1."""
    return str(max(1, math.ceil(seconds)))
