"""The base executor side: frozen linear weights served to clients."""

from symbiont.executor.base import BaseExecutor
from symbiont.executor.interface import (
    Executor,
    ExecutorError,
    ExecutorUnavailable,
    Manifest,
    Op,
)

__all__ = ["BaseExecutor", "Executor", "ExecutorError", "ExecutorUnavailable", "Manifest", "Op"]
