"""Endpoint URLs: which schemes are served, and which ones stay on this host."""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

SCHEMES = ("tcp", "ipc")
LOOPBACK_NAMES = {"localhost", "ip6-localhost"}


def check_url(url: str) -> None:
    """Refuse anything but tcp://HOST:PORT and ipc:///path, saying what to write instead."""
    if not isinstance(url, str) or urlsplit(url).scheme not in SCHEMES:
        raise ValueError(
            f"unsupported executor URL {url!r}: use tcp://HOST:PORT or ipc:///path/to/socket"
        )


def is_loopback(url: str) -> bool:
    """True for ipc:// endpoints and tcp:// on a loopback address (same host only)."""
    parts = urlsplit(url)
    if parts.scheme == "ipc":
        return True
    host = (parts.hostname or "").lower()
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # "*", a host or interface name: not provably loopback
