"""The training configuration: one frozen, validated dataclass."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

SCHEDULES = ("linear", "cosine", "constant", "constant_with_warmup")

# Fields that may differ between a run and its resumption without changing the result.
RESUMABLE_CHANGES = frozenset({"eval_every", "save_every", "save_total_limit", "log_every"})


@dataclass(frozen=True)
class TrainConfig:
    """How to train. Length is `max_steps` optimizer steps if > 0, else `epochs` epochs."""

    max_steps: int = 0
    epochs: int = 1
    batch_size: int = 2
    grad_accum: int = 1
    lr: float = 2e-4
    weight_decay: float = 0.0
    warmup_steps: int = 0
    schedule: str = "linear"
    max_grad_norm: float = 1.0  # 0 disables clipping
    max_length: int = 512
    seed: int = 0
    eval_every: int = 0  # optimizer steps between eval losses; 0: only at the end
    save_every: int = 0  # optimizer steps between checkpoints; 0: only at the end
    save_total_limit: int = 2  # checkpoints kept (oldest deleted first); 0 keeps all
    log_every: int = 1  # optimizer steps between metrics records

    def __post_init__(self) -> None:
        positive = ("epochs", "batch_size", "grad_accum", "max_length", "log_every")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        non_negative = ("max_steps", "warmup_steps", "eval_every", "save_every")
        for name in non_negative + ("save_total_limit", "weight_decay", "max_grad_norm"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.schedule not in SCHEDULES:
            raise ValueError(
                f"schedule must be one of {', '.join(SCHEDULES)}; got {self.schedule!r}"
            )

    def batches_per_epoch(self, n_examples: int) -> int:
        return math.ceil(n_examples / self.batch_size)

    def total_steps(self, n_examples: int) -> int:
        """Optimizer steps in the whole run."""
        if self.max_steps:
            return self.max_steps
        return max(1, self.epochs * self.batches_per_epoch(n_examples) // self.grad_accum)

    def as_record(self) -> dict:
        return asdict(self)

    def resume_conflicts(self, saved: dict) -> list[str]:
        """Fields that differ from a checkpoint's config in ways that change the result."""
        mine = self.as_record()
        return sorted(
            f"{key}: checkpoint {saved.get(key)!r}, now {value!r}"
            for key, value in mine.items()
            if key not in RESUMABLE_CHANGES and saved.get(key) != value
        )
