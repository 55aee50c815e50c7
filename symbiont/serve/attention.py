"""Attention over flattened tokens of many sequences, reading and writing the paged KV cache.

Registered with transformers' `AttentionInterface` as `symbiont_paged`, so the model's
own attention modules (projections, rotary embeddings, head layout) run unchanged and
only the core `softmax(q kᵀ) v` is ours. The model is called with batch size 1 and all
tokens of the iteration side by side; per-sequence boundaries come from the step
context's attention groups (`AttnGroup`): the decoding sequences (split in two, below)
and one per prefill chunk.

Per layer and group, one `scaled_dot_product_attention` call with the additive mask the
group built once for the step. Where the context comes from:
- decoding sequences whose blocks are aligned contiguous runs (the allocator's first
  choice, kv_cache.py): read in place, as rows of one strided view of the head-major pool
  `[rows, kv_heads, kv_width, head_dim]`; their queries are scattered into the view's
  rows and rows that are no sequence are dropped after (`PoolRows`). No per-layer copy.
- a continued prefill chunk whose sequence is on a run: read in place too (one row);
- other decoding sequences and continued chunks (scattered blocks of a fragmented pool):
  gathered from the pool a whole KV block at a time (one `index_select`);
- a chunk that starts its sequence: its own keys (causal SDPA, no gather, no mask).
On a CPU in float32, a prefill chunk attends through a kernel of our own
(`kernels/csrc/chunk_attention.cpp`, `DecodeKernel.chunk`: causal and windowed limits computed,
not read from a mask; 2.0-2.5x faster than SDPA on one core). Where it does not apply (no
compiler, another dtype or head dim), a long chunk (CHUNK_BLOCKS_MIN tokens or more)
attends in blocks of queries through SDPA, each over the keys up to its last query,
under the group's mask.
Decoding queries (one per sequence) of the query heads sharing a KV head are stacked on
the query axis (`[n, kv_heads, heads / kv_heads, head_dim]`), so each K/V head is read
once, not once per query head; chunks use SDPA's `enable_gqa`. On a CPU in float32,
decoding sequences run through a kernel of our own (`decode_kernel.py`, the step
context's `decode_kernel`) instead of SDPA. Logit soft-capping
(Gemma 2), which SDPA cannot express, takes the eager path: scores in the query dtype,
softmax in float32, as transformers' eager attention.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from symbiont.serve.context import AttnGroup, PoolRows, current_context
from symbiont.serve.decode_kernel import DecodeKernel

ATTN_IMPLEMENTATION = "symbiont_paged"
# A prefill chunk this long attends CHUNK_BLOCK queries at a time (`_chunk_in_blocks`), on
# a CPU: first chunks ran 1.05-1.55x faster so from 192 to 1024 tokens on one core, about
# even at 128 (0.96-1.09x). GPU kernels were not measured, so they keep one call.
CHUNK_BLOCKS_MIN = 192
CHUNK_BLOCK = 64


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, heads, n_tokens, head_dim]
    key: torch.Tensor,  # [1, kv_heads, n_tokens, head_dim]
    value: torch.Tensor,  # [1, kv_heads, n_tokens, head_dim]
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    ctx = current_context()
    if ctx is None:
        raise RuntimeError(
            f"attention implementation {ATTN_IMPLEMENTATION!r} runs only inside the serving "
            "engine; call model.set_attn_implementation('sdpa') to use the model elsewhere"
        )
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError("attention sinks (s_aux) are not supported by the serving engine")
    like = key[0].transpose(0, 1)  # [n_tokens, kv_heads, hd]
    k_pool, v_pool = ctx.kv_cache.head_major(module.layer_idx, like)  # [kv_heads, slots, hd]
    k_pool.index_copy_(1, ctx.slot_mapping, key[0])
    v_pool.index_copy_(1, ctx.slot_mapping, value[0])
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    q, k, v = query[0], key[0], value[0]  # [heads | kv_heads, n_tokens, hd]
    block = ctx.kv_cache.block_size
    groups = ctx.attn_groups
    kernel = ctx.decode_kernel
    if len(groups) == 1 and groups[0].span == (0, q.shape[1]):  # the whole batch, in order
        rows = _group_attention(
            groups[0], q, k, v, k_pool, v_pool, block, scale, sliding_window, softcap, kernel
        )
        return rows[None], None  # [1, n_tokens, heads, hd], no attention weights
    out = q.new_empty(q.shape[1], q.shape[0], q.shape[2])  # [n_tokens, heads, hd]
    for group in groups:
        rows = _group_attention(
            group, q, k, v, k_pool, v_pool, block, scale, sliding_window, softcap, kernel
        )
        if group.span is not None:
            out[group.span[0] : group.span[1]] = rows
        else:
            out.index_copy_(0, group.tokens, rows)
    return out[None], None  # [1, n_tokens, heads, head_dim], no attention weights


def _group_attention(
    group: AttnGroup,
    q: torch.Tensor,  # [heads, n_tokens, hd]
    k: torch.Tensor,  # [kv_heads, n_tokens, hd]: this iteration's keys
    v: torch.Tensor,
    k_pool: torch.Tensor,  # [kv_heads, slots, hd]
    v_pool: torch.Tensor,
    block: int,
    scale: float,
    window: int | None,
    softcap: float | None,
    kernel: DecodeKernel | None = None,
) -> torch.Tensor:
    """-> [n_seqs * n_queries, heads, hd]: the group's attention output, in its token order."""
    heads, hd = q.shape[0], q.shape[2]
    n, m = group.n_seqs, group.n_queries
    if group.rows is not None and m == 1:
        return _pool_rows_attention(
            group, group.rows, q, k_pool, v_pool, scale, window, softcap, kernel
        )
    qg = _rows(q, group).view(heads, n, m, hd).transpose(0, 1)  # [n, heads, m, hd]
    own_keys = group.blocks is None and group.rows is None
    if group.rows is not None:  # a continued chunk on a run: its context, in place
        kg = _row_view(k_pool, group.rows, group.kv_width)  # [1, kv_heads, kv_width, hd]
        vg = _row_view(v_pool, group.rows, group.kv_width)
    elif own_keys:  # a first chunk: its context is exactly its own keys
        kg = _rows(k, group).view(-1, n, m, hd).transpose(0, 1)  # [n, kv_heads, m, hd]
        vg = _rows(v, group).view(-1, n, m, hd).transpose(0, 1)
    else:
        kg, vg = _gather(k_pool, group, block), _gather(v_pool, group, block)
    if softcap is None and n == 1 and m > 1 and kernel is not None:  # one chunk, on a CPU
        qc, kc, vc = qg[0], kg[0], vg[0]  # [heads | kv_heads, ..., hd]
        if kernel.chunk_applies(qc, kc, vc):
            start = group.start if group.start is not None else int(group.q_pos[0, 0])
            return kernel.chunk(qc, kc, vc, start, window, scale)  # [m, heads, hd]
    if softcap is not None:
        out = _eager(qg, kg, vg, group.mask(window, qg.dtype), scale, softcap)
    elif n == 1 and m >= CHUNK_BLOCKS_MIN and q.device.type == "cpu":  # one long chunk
        start = group.start if group.start is not None else int(group.q_pos[0, 0])
        out = _chunk_in_blocks(qg, kg, vg, group.mask(window, qg.dtype), start, scale)
    elif own_keys and window is None:  # causal over its own keys: no mask needed
        out = F.scaled_dot_product_attention(
            qg, kg, vg, is_causal=True, scale=scale, enable_gqa=True
        )
    elif m == 1:  # decoding: query heads sharing a KV head stacked on the query axis
        folded = qg.reshape(n, kg.shape[1], -1, hd)  # [n, kv_heads, heads / kv_heads, hd]
        out = _decode(folded, kg, vg, group.mask(window, qg.dtype), scale, kernel)
        return out.reshape(n, heads, hd)
    else:
        mask = group.mask(window, qg.dtype)
        out = F.scaled_dot_product_attention(
            qg, kg, vg, attn_mask=mask, scale=scale, enable_gqa=True
        )
    return out.transpose(1, 2).reshape(n * m, heads, hd)  # [n, m, heads, hd] flattened


def _decode(
    q: torch.Tensor,  # [n, kv_heads, heads / kv_heads, hd]: one query per sequence
    k: torch.Tensor,  # [n, kv_heads, kv_width, hd]
    v: torch.Tensor,
    mask: torch.Tensor,  # [n, 1, 1, kv_width] additive
    scale: float,
    kernel: DecodeKernel | None,
) -> torch.Tensor:
    """Decoding sequences' attention -> [n, kv_heads, heads / kv_heads, hd]: our CPU
    kernel where it applies (decode_kernel.py), else SDPA."""
    if kernel is not None and kernel.applies(q, k, mask):
        return kernel(q, k, v, mask, scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def _chunk_in_blocks(
    q: torch.Tensor,  # [1, heads, m, hd]: one prefill chunk
    k: torch.Tensor,  # [1, kv_heads, >= start + m, hd]: its context, then its own keys
    v: torch.Tensor,
    mask: torch.Tensor,  # [1, 1, m, k's width] additive
    start: int,  # position of the chunk's first query
    scale: float,
) -> torch.Tensor:
    """A long chunk's attention CHUNK_BLOCK queries at a time, each block over the keys up
    to its last query -> [1, heads, m, hd]. The same math as one masked call: PyTorch's
    CPU kernel computes whole 512-key blocks, so one call over a chunk spends up to half
    its work on the masked keys after each query (BENCHMARKS.md, issue 17, session 13)."""
    m = q.shape[2]
    out = torch.empty_like(q)
    for first in range(0, m, CHUNK_BLOCK):
        stop = min(m, first + CHUNK_BLOCK)
        keys = start + stop
        out[:, :, first:stop] = F.scaled_dot_product_attention(
            q[:, :, first:stop],
            k[:, :, :keys],
            v[:, :, :keys],
            attn_mask=mask[:, :, first:stop, :keys],
            scale=scale,
            enable_gqa=True,
        )
    return out


def _pool_rows_attention(
    group: AttnGroup,
    rows: PoolRows,
    q: torch.Tensor,  # [heads, n_tokens, hd]
    k_pool: torch.Tensor,  # [kv_heads, slots, hd]
    v_pool: torch.Tensor,
    scale: float,
    window: int | None,
    softcap: float | None,
    kernel: DecodeKernel | None = None,
) -> torch.Tensor:
    """Decoding sequences read in place from the pool -> [n_seqs, heads, hd]."""
    heads, hd = q.shape[0], q.shape[2]
    kv_heads = k_pool.shape[0]
    qr = _rows(q, group).transpose(0, 1)  # [n_seqs, heads, hd]
    if not rows.in_order:  # rows that are no sequence keep a zero query
        qr = q.new_zeros(rows.n_rows, heads, hd).index_copy_(0, rows.index, qr)
    kr = _row_view(k_pool, rows, group.kv_width)  # [n_rows, kv_heads, kv_width, hd]
    vr = _row_view(v_pool, rows, group.kv_width)
    mask = group.mask(window, q.dtype)  # [n_rows, 1, 1, kv_width]
    if softcap is not None:
        out = _eager(qr[:, :, None], kr, vr, mask, scale, softcap)  # [n_rows, heads, 1, hd]
    else:
        folded = qr.reshape(rows.n_rows, kv_heads, heads // kv_heads, hd)
        out = _decode(folded, kr, vr, mask, scale, kernel)
    out = out.reshape(rows.n_rows, heads, hd)
    return out if rows.in_order else out.index_select(0, rows.index)


def _row_view(pool: torch.Tensor, rows: PoolRows, width: int) -> torch.Tensor:
    """[kv_heads, slots, hd] -> [n_rows, kv_heads, width, hd], a view (no copy): row r is
    slots first + r * stride ... + width - 1 of every KV head."""
    kv_heads, hd = pool.shape[0], pool.shape[2]
    return pool.as_strided(
        (rows.n_rows, kv_heads, width, hd),
        (rows.stride * hd, pool.stride(0), hd, 1),
        pool.storage_offset() + rows.first * hd,
    )


def _rows(x: torch.Tensor, group: AttnGroup) -> torch.Tensor:
    """[h, n_tokens, hd] -> [h, n_seqs * n_queries, hd]: the group's tokens (a view when
    they are contiguous)."""
    if group.span is not None:
        return x[:, group.span[0] : group.span[1]]
    return x.index_select(1, group.tokens)


def _gather(pool: torch.Tensor, group: AttnGroup, block: int) -> torch.Tensor:
    """[kv_heads, slots, hd] -> [n_seqs, kv_heads, n_blocks * block, hd]: each sequence's
    context, copied a whole block (kv_heads stretches of block x hd values) at a time."""
    kv_heads, hd = pool.shape[0], pool.shape[2]
    blocks = pool.view(kv_heads, -1, block, hd).index_select(1, group.blocks)
    return blocks.view(kv_heads, group.n_seqs, -1, hd).transpose(0, 1)


def _eager(
    q: torch.Tensor,  # [n, heads, m, hd]
    k: torch.Tensor,  # [n, kv_heads, L, hd]
    v: torch.Tensor,
    mask: torch.Tensor,  # [n, 1, m, L] additive
    scale: float,
    softcap: float,
) -> torch.Tensor:
    """transformers' eager attention with logit soft-capping -> [n, heads, m, hd].

    Grouped-query attention without copying K/V per head: the query heads sharing a KV
    head are stacked along the query axis (head h uses KV head h // (heads / kv_heads),
    as transformers' `repeat_kv` does)."""
    n, heads, m, hd = q.shape
    kv_heads = k.shape[1]
    share = heads // kv_heads
    qs = q.reshape(n, kv_heads, share * m, hd)
    scores = torch.matmul(qs, k.transpose(2, 3)) * scale  # [n, kv_heads, share * m, L]
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.view(n, kv_heads, share, m, -1) + mask[:, :, None]
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(probs.view(n, kv_heads, share * m, -1), v)
    return out.view(n, heads, m, hd)


def register_attention() -> str:
    """Make `symbiont_paged` known to transformers (idempotent); returns its name."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)
    return ATTN_IMPLEMENTATION
