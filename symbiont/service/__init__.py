"""The base executor as a service: many clients, in other processes or hosts, one base.

server.py runs the loop (sockets, shared memory, sessions); scheduler.py holds the
per-layer queues and batching policies; stats.py the live statistics; config.py the
frozen configs. Run it with `symbiont serve-base` or `python -m symbiont.service`.
"""

from symbiont.service.config import BatchingPolicy, PolicyKind, ServiceConfig
from symbiont.service.server import ExecutorServer

__all__ = ["BatchingPolicy", "ExecutorServer", "PolicyKind", "ServiceConfig"]
