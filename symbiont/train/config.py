"""The training configuration: one frozen, validated dataclass."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

SCHEDULES = ("linear", "cosine", "constant", "constant_with_warmup")

# Fields that may differ between a run and its resumption without changing the result.
RESUMABLE_CHANGES = frozenset({"eval_every", "save_every", "save_total_limit", "log_every"})


@dataclass(frozen=True)
class TrainConfig:
    """How to train. Length is `max_steps` optimizer steps if > 0, else `epochs` epochs.

    Each field is also a flag of `symbiont finetune` (help text in its metadata)."""

    max_steps: int = field(
        default=0, metadata={"help": "optimizer steps to run; 0 runs --epochs epochs"}
    )
    epochs: int = field(default=1, metadata={"help": "epochs when --max-steps is 0"})
    batch_size: int = field(default=2, metadata={"help": "examples per micro-batch"})
    grad_accum: int = field(default=1, metadata={"help": "micro-batches per optimizer step"})
    lr: float = field(default=2e-4, metadata={"help": "AdamW learning rate"})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay"})
    warmup_steps: int = field(default=0, metadata={"help": "linear warm-up steps"})
    schedule: str = field(
        default="linear",
        metadata={"help": "learning-rate schedule after warm-up", "choices": SCHEDULES},
    )
    max_grad_norm: float = field(
        default=1.0, metadata={"help": "clip the gradient norm to this (0 disables clipping)"}
    )
    max_length: int = field(default=512, metadata={"help": "truncate examples to this many tokens"})
    seed: int = field(default=0, metadata={"help": "seed for adapter init and data order"})
    eval_every: int = field(
        default=0,
        metadata={"help": "optimizer steps between eval losses (0: only at the end)"},
    )
    save_every: int = field(
        default=0,
        metadata={"help": "optimizer steps between checkpoints (0: only at the end)"},
    )
    save_total_limit: int = field(
        default=2,
        metadata={"help": "checkpoints kept, oldest deleted first (0 keeps all)"},
    )
    log_every: int = field(
        default=1, metadata={"help": "optimizer steps between records in metrics.jsonl"}
    )

    def __post_init__(self) -> None:
        positive = ("epochs", "batch_size", "grad_accum", "max_length", "log_every")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        non_negative = ("max_steps", "warmup_steps", "eval_every", "save_every")
        for name in non_negative + ("save_total_limit", "weight_decay", "max_grad_norm"):
            if not getattr(self, name) >= 0:  # also false for NaN
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("lr", "weight_decay", "max_grad_norm"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)}")
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
        micro = self.epochs * self.batches_per_epoch(n_examples)
        if micro % self.grad_accum:
            # a step is grad_accum whole micro-batches: the run would end short of or past
            # the epochs asked for (0.75 or 2 epochs for 1, say) without a word
            raise ValueError(
                f"--epochs {self.epochs} of {n_examples} examples is {micro} micro-batches of "
                f"--batch-size {self.batch_size}, which --grad-accum {self.grad_accum} does "
                f"not divide; pick a --grad-accum dividing {micro}, or give --max-steps"
            )
        return micro // self.grad_accum

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
