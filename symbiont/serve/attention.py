"""Attention over flattened tokens of many sequences, reading and writing the paged KV cache.

Registered with transformers' `AttentionInterface` as `symbiont_paged`, so the model's
own attention modules (projections, rotary embeddings, head layout) run unchanged and
only the core `softmax(q kᵀ) v` is ours. The model is called with batch size 1 and all
tokens of the iteration side by side; per-sequence boundaries come from the step
context. Math follows transformers' eager attention: scores in the query dtype, softmax
in float32.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface

from symbiont.serve.context import AttnGroup, current_context

ATTN_IMPLEMENTATION = "symbiont_paged"


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
    k_pool, v_pool = ctx.kv_cache.pools(module.layer_idx, key[0].transpose(0, 1))
    k_pool.index_copy_(0, ctx.slot_mapping, key[0].transpose(0, 1))  # [n_tokens, kv_heads, hd]
    v_pool.index_copy_(0, ctx.slot_mapping, value[0].transpose(0, 1))
    q = query[0].transpose(0, 1)  # [n_tokens, heads, head_dim]
    out = torch.empty_like(q)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    for group in ctx.attn_groups:  # at most two: decoding sequences, prefill chunks
        rows = _group_attention(group, q, k_pool, v_pool, scale, sliding_window, softcap)
        out.index_copy_(0, group.q_tokens, rows)
    return out[None], None  # [1, n_tokens, heads, head_dim], no attention weights


def _group_attention(
    group: AttnGroup,
    q: torch.Tensor,  # [n_tokens, heads, hd]
    k_pool: torch.Tensor,  # [slots, kv_heads, hd]
    v_pool: torch.Tensor,
    scale: float,
    window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """-> [n_valid, heads, hd]: attention output of the group's real query rows.

    Grouped-query attention without copying K/V per head: the query heads sharing a KV
    head are stacked along the query axis (head h uses KV head h // (heads / kv_heads),
    as transformers' `repeat_kv` does)."""
    n_seqs, max_q = group.q_index.shape
    heads, kv_heads, hd = q.shape[1], k_pool.shape[1], q.shape[2]
    share = heads // kv_heads
    qg = q[group.q_index].permute(0, 2, 1, 3)  # [n_seqs, heads, max_q, hd]
    qg = qg.reshape(n_seqs, kv_heads, share * max_q, hd)
    k = k_pool[group.kv_slots].transpose(1, 2)  # [n_seqs, kv_heads, max_kv, hd]
    v = v_pool[group.kv_slots].transpose(1, 2)
    scores = torch.matmul(qg, k.transpose(2, 3)) * scale  # [n_seqs, kv_heads, share*max_q, max_kv]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.view(n_seqs, kv_heads, share, max_q, -1)
    scores = scores.masked_fill(~group.mask(window)[:, :, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    rows = torch.matmul(probs.view(n_seqs, kv_heads, share * max_q, -1), v)
    rows = rows.view(n_seqs, heads, max_q, hd).transpose(1, 2)  # [n_seqs, max_q, heads, hd]
    return rows.reshape(n_seqs * max_q, heads, hd)[group.q_valid]


def register_attention() -> str:
    """Make `symbiont_paged` known to transformers (idempotent); returns its name."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)
    return ATTN_IMPLEMENTATION
