"""PEFT adapters: the one reader and validator of adapter folders (`read_adapter` ->
`AdapterSpec`), and PEFT configs built from `symbiont finetune` flags.

Names load on first use, so `METHODS` and `AdapterFlags` (for the CLI's flags) come
without importing torch.
"""

from __future__ import annotations

from symbiont.util.lazy import lazy_exports

_EXPORTS = {
    "AdapterError": "symbiont.adapters.spec",
    "AdapterSpec": "symbiont.adapters.spec",
    "TensorInfo": "symbiont.adapters.spec",
    "read_adapter": "symbiont.adapters.spec",
    "validate_config": "symbiont.adapters.spec",
    "AdapterFlags": "symbiont.adapters.flags",
    "build_peft_config": "symbiont.adapters.peft_config",
    "load_peft_config": "symbiont.adapters.peft_config",
    "CONFIG_FILE": "symbiont.adapters.names",
    "METHODS": "symbiont.adapters.names",
    "WEIGHTS_FILE": "symbiont.adapters.names",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
