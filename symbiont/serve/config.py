"""Configuration of the serving engine: one frozen, validated dataclass."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Capacity and scheduling limits of one serving engine.

    Memory is preallocated at these maxima (adapter stacks, KV blocks), so raising them
    costs memory up front, never on the hot path.
    """

    max_running: int = 32  # sequences decoding or prefilling in one iteration
    max_batched_tokens: int = 256  # tokens (decode + prefill chunks) in one iteration
    max_queue: int = 256  # waiting requests beyond which new ones are refused (HTTP 429)
    block_size: int = 16  # tokens per KV-cache block
    num_blocks: int = 1024  # KV-cache blocks shared by all sequences
    max_adapters: int = 32  # adapter slots resident at once (slot 0 = no adapter is extra)
    max_lora_rank: int = 64  # LoRA ranks up to this are served; lower ranks are zero-padded
    max_model_len: int | None = None  # prompt + output tokens; None = the model's limit

    def __post_init__(self) -> None:
        for name in (
            "max_running",
            "max_batched_tokens",
            "block_size",
            "num_blocks",
            "max_adapters",
            "max_lora_rank",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_queue < 0:
            raise ValueError(f"EngineConfig.max_queue must be >= 0, got {self.max_queue}")
        if self.max_batched_tokens < self.max_running:
            raise ValueError(
                f"EngineConfig.max_batched_tokens ({self.max_batched_tokens}) must be at least "
                f"max_running ({self.max_running}) so every running sequence can decode each "
                "iteration; raise max_batched_tokens or lower max_running"
            )

    @property
    def num_slots(self) -> int:
        """Adapter slots including slot 0, which means "no adapter"."""
        return self.max_adapters + 1

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size
