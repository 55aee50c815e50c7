"""symbiont: one frozen base LLM shared by many tenants through split execution.

The names below are imported on first use, so `import symbiont` (and `symbiont --help`)
stays cheap: torch and transformers load only when a command needs them.
"""

from __future__ import annotations

from symbiont.util.lazy import lazy_exports

_EXPORTS = {
    "BaseExecutor": "symbiont.base.executor",
    "CheckpointError": "symbiont.model.checkpoint",
    "Executor": "symbiont.protocol.executor",
    "ExecutorError": "symbiont.protocol.executor",
    "ExecutorUnavailable": "symbiont.protocol.executor",
    "MaskConfig": "symbiont.client.masking",
    "connect": "symbiont.client.remote",
    "default_model": "symbiont.model.default",
    "load_client": "symbiont.client.loader",
}

__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
