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
    if url.startswith("tcp://") and not _has_port(url.removeprefix("tcp://")):
        raise ValueError(
            f"executor URL {url!r} has no port: write tcp://HOST:PORT (tcp://HOST:* to "
            "listen on a free one)"
        )
    port = url.rpartition(":")[2]
    if url.startswith("tcp://") and port != "*" and int(port) > 65535:
        # (ZeroMQ took 99999 as 99999 - 65536 = 34463, and said so nowhere)
        raise ValueError(f"executor URL {url!r}: the port must be 1-65535 (or * for a free one)")
    if url == "ipc://" or url.startswith("ipc://") and not url.removeprefix("ipc://"):
        raise ValueError(f"executor URL {url!r} has no path: write ipc:///path/to/socket")


def _has_port(address: str) -> bool:
    """HOST:PORT, [IPV6]:PORT, or with * for the port."""
    host, sep, port = address.rpartition(":")
    return bool(sep and host and (port == "*" or port.isdigit()) and not host.endswith(":"))


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
