"""The adapter flags of `symbiont finetune`, importable without torch (the CLI builds its
flags from this dataclass); `peft_config.build_peft_config` turns them into a PEFT config."""

from __future__ import annotations

import math
from dataclasses import dataclass

from symbiont.adapters.names import METHODS

# The AdapterFlags fields each method reads (`peft_config._build`); a flag given for a
# method that does not read it would be dropped without a word
USES = {
    "lora": {"r", "alpha", "dropout", "target"},
    "dora": {"r", "alpha", "dropout", "target"},
    "adalora": {"r", "alpha", "target"},
    "ia3": {"target"},
    "loha": {"r", "alpha", "target"},
    "lokr": {"r", "alpha", "target"},
    "vera": {"r", "target"},
    "prefix": {"virtual_tokens"},
    "prompt": {"virtual_tokens"},
}


def unused_by(method: str, given: set[str]) -> list[str]:
    """The fields in `given` that `method` does not read, sorted."""
    return sorted(given - USES.get(method, given))


@dataclass(frozen=True)
class AdapterFlags:
    """The adapter flags of `symbiont finetune` (an adapter folder is an `AdapterSpec`)."""

    method: str = "lora"
    r: int = 16
    alpha: float | None = None  # LoRA-style scaling numerator; default 2 * r
    dropout: float = 0.0
    target: str | None = None  # "all-linear", comma-separated module names, or None (PEFT default)
    virtual_tokens: int = 16  # prefix / prompt tuning

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown method {self.method!r}; choose one of {', '.join(METHODS)}")
        if self.r < 1 or self.virtual_tokens < 1:
            raise ValueError("r and virtual_tokens must be >= 1")
        if not 0 <= self.dropout < 1:  # also false for NaN
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if self.alpha is not None and not math.isfinite(self.alpha):
            raise ValueError(f"alpha must be a finite number, got {self.alpha}")
        if self.alpha == 0:
            raise ValueError(
                "alpha is 0: the adapter's scale is alpha / r, so it would change nothing; "
                "leave --alpha out (default 2 * r) or give it a non-zero value"
            )
