"""Per-iteration batch metadata, reached by the attention function and adapter layers.

The engine builds one `StepContext` per iteration and enters it with `use_context`;
layers read it with `current_context()`. Hugging Face `forward` signatures stay as they
are (STYLE practice 4). The context is thread-local so engines in different threads
never see each other's batches.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from symbiont.serve.kv_cache import PagedKVCache


@dataclass(frozen=True)
class AttnGroup:
    """Sequences whose queries are padded to one length for one batched attention.

    Decoding sequences (1 query each) form one group and prefill chunks another, so
    padding stays small while the number of attention calls per layer is constant.
    """

    q_index: torch.Tensor  # [n_seqs, max_q] flat token index of each query (padding -> 0)
    q_valid: torch.Tensor  # [n_seqs * max_q] bool: which padded query rows are real
    q_tokens: torch.Tensor  # [n_valid] flat token index of each real query, in padded order
    kv_slots: torch.Tensor  # [n_seqs, max_kv] KV-cache slot of each context position (padding -> 0)
    q_pos: torch.Tensor  # [n_seqs, max_q] absolute position of each query
    kv_len: torch.Tensor  # [n_seqs] context length after this iteration's tokens
    masks: dict = field(
        default_factory=dict
    )  # sliding window (or None) -> [n_seqs, 1, max_q, max_kv]

    def mask(self, window: int | None) -> torch.Tensor:
        """True where a query may attend: same sequence, not in the future, inside the window.
        -> [n_seqs, 1, max_q, max_kv] bool"""
        if window not in self.masks:
            kv_pos = torch.arange(self.kv_slots.shape[1], device=self.kv_slots.device)
            allowed = kv_pos[None, None, :] <= self.q_pos[:, :, None]  # causal
            allowed &= kv_pos[None, None, :] < self.kv_len[:, None, None]
            if window is not None:
                allowed &= kv_pos[None, None, :] > self.q_pos[:, :, None] - window
            self.masks[window] = allowed[:, None]
        return self.masks[window]


@dataclass(frozen=True)
class LoraBucket:
    """LoRA tokens of the slots whose rank rounds up to `rank`, grouped by slot.

    Semantics, for every slot s in `slots`: `y[tokens of s] += x[tokens of s] @ A[s] @ B[s]`
    (B already scaled). Tokens are gathered into `[n_groups, max_group_len]` so a layer
    runs one `bmm` pair per bucket; buckets (powers of two up to max_lora_rank) keep a
    rank-8 adapter from being padded to rank 64, and there are at most log2(r_max) + 1.
    """

    rank: int  # slots' ranks round up to this; stacks are sliced to it
    slots: torch.Tensor  # [n_groups] adapter slot of each group
    index: torch.Tensor  # [n_groups, max_group_len] flat token index (padding -> 0)
    rows: torch.Tensor  # [n_valid] row of each real token in the flattened padded layout
    tokens: torch.Tensor  # [n_valid] flat token index of each real row


@dataclass(frozen=True)
class AdapterBatch:
    """Which adapter slot each token uses, prepared once per iteration for every layer."""

    token_slots: torch.Tensor  # [n_tokens] adapter slot per token, 0 = none
    lora: tuple[LoraBucket, ...]  # empty when no token uses LoRA
    has_ia3: bool
    has_dora: bool = False  # some token's slot holds a DoRA adapter


@dataclass(frozen=True)
class StepContext:
    """Everything a layer needs to know about the current iteration's flattened batch."""

    kv_cache: PagedKVCache
    slot_mapping: torch.Tensor  # [n_tokens] KV-cache slot where each new token's K/V go
    attn_groups: tuple[AttnGroup, ...]
    adapters: AdapterBatch
    keep_rows: torch.Tensor | None = None  # [n_keep] flat rows the output layer sees


_local = threading.local()


@contextmanager
def use_context(ctx: StepContext) -> Iterator[StepContext]:
    previous = getattr(_local, "ctx", None)
    _local.ctx = ctx
    try:
        yield ctx
    finally:
        _local.ctx = previous


def current_context() -> StepContext | None:
    """The iteration being run in this thread, or None outside the engine."""
    return getattr(_local, "ctx", None)
