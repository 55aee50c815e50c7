"""Reaching a base executor in another process or on another host.

`connect(url)` returns an `Executor` backed by a `symbiont serve-base` process: tensors go
as raw ZeroMQ frames (TCP or IPC) or, on the same host, through shared memory.
"""

from symbiont.transport.client import ClientConfig, Mode, RemoteExecutor, connect, open_executor

__all__ = ["ClientConfig", "Mode", "RemoteExecutor", "connect", "open_executor"]
