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

from symbiont.serve.decode_kernel import DecodeKernel
from symbiont.serve.kv_cache import PagedKVCache


@dataclass(frozen=True)
class PoolRows:
    """Decoding sequences whose KV blocks are aligned contiguous runs, read in place as
    rows of one strided view of every layer's pool: row r is the `kv_width` slots from
    `first + r * stride` (per KV head). Rows between the sequences' rows (other
    sequences, free blocks) are computed with a dummy query and dropped."""

    first: int  # pool slot where row 0 starts
    stride: int  # slots between consecutive rows
    n_rows: int
    index: torch.Tensor  # [n_seqs] view row of each sequence, in the group's query order
    in_order: bool = False  # index is 0, 1, ..., n_rows - 1: queries and rows coincide


@dataclass(frozen=True)
class AttnGroup:
    """Sequences whose attention runs as one batched call: every decoding sequence (one
    query each) together, or one prefill chunk. Nothing is padded on the query side, so
    queries are read in place when the group's tokens are contiguous (`span`).

    A group of decoding sequences whose contexts lie in aligned runs has `rows`: its
    context is read as a view of the pool, without a gather, and `q_pos`/`kv_len` (hence
    the mask) are per view row; rows that are no sequence attend to position 0 only.
    """

    n_seqs: int
    n_queries: int  # queries per sequence: 1 when decoding, the chunk length otherwise
    span: tuple[int, int] | None  # (first, stop) flat tokens of the group, when contiguous
    tokens: torch.Tensor | None  # [n_seqs * n_queries] flat token of each query, else None
    blocks: torch.Tensor | None  # [n_seqs * n_blocks] KV block of each context block
    # (padding -> block 0); None when the group is one chunk starting its sequence, whose
    # context is exactly its own keys
    kv_width: int  # context positions attended over: n_blocks * block_size, or n_queries
    q_pos: torch.Tensor  # [n_seqs, n_queries] absolute position of each query
    kv_len: torch.Tensor  # [n_seqs] context length after this iteration's tokens
    rows: PoolRows | None = None  # set: read in place; q_pos, kv_len are [n_rows, ...]
    start: int | None = None  # position of the first query of a one-sequence group
    # (None: read from q_pos)
    masks: dict = field(default_factory=dict)  # (window, dtype) -> mask, built once per step

    def mask(self, window: int | None, dtype: torch.dtype) -> torch.Tensor:
        """0 where a query may attend (not in the future, inside the context and the
        window), -inf elsewhere. -> [n_seqs, 1, n_queries, kv_width] additive, in `dtype`"""
        if (window, dtype) not in self.masks:
            kv_pos = torch.arange(self.kv_width, device=self.q_pos.device)
            allowed = kv_pos[None, None, :] <= self.q_pos[:, :, None]  # causal
            allowed &= kv_pos[None, None, :] < self.kv_len[:, None, None]
            if window is not None:
                allowed &= kv_pos[None, None, :] > self.q_pos[:, :, None] - window
            mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
            self.masks[(window, dtype)] = mask.masked_fill_(~allowed, float("-inf"))[:, None]
        return self.masks[(window, dtype)]


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
    decode_kernel: DecodeKernel | None = None  # decoding attention on a CPU, else SDPA


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
