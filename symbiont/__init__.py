"""symbiont: one frozen base LLM shared by many tenants through split execution."""

from symbiont.checkpoint import CheckpointError
from symbiont.client import load_client
from symbiont.default_model import default_model
from symbiont.executor import BaseExecutor, Executor, ExecutorError
from symbiont.transport import connect

__all__ = [
    "BaseExecutor",
    "CheckpointError",
    "Executor",
    "ExecutorError",
    "connect",
    "default_model",
    "load_client",
]
__version__ = "0.1.0"
