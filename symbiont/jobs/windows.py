"""Token-level fine-tuning (FlexLLM): one training step over a sequence cut into windows
of tokens, with the gradients of the whole-sequence step.

Forward, window by window, left to right: each window attends to the keys and values of
the windows before it through a per-layer key/value cache, where they sit as detached
leaf tensors. Backward, window by window, right to left: a window's loss and the gradients
that later windows left on its keys and values (collected from their leaves) flow back
through that window's graph alone, and the gradients its own leaves receive are handed
to the earlier windows. So fine-tuning work can be cut at any token count (a scheduler
can fit a window into an inference iteration), and the result is the whole-sequence
step's (tests/test_jobs_windows.py: within 1e-5 in fp32).

Every window's graph is kept until its backward (as a whole-sequence step keeps its
activations); the saving FlexLLM adds by pruning the graph is not done here.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

IGNORE_INDEX = -100


def windowed_backward(
    model,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    window: int,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Accumulate into the trainable parameters' `.grad` the gradients of the model's own
    causal-LM loss (mean over predicted tokens, labels shifted by one, IGNORE_INDEX
    skipped) computed window by window; returns the loss (detached).

    input_ids, labels, attention_mask: [batch, seq] (right padding only)."""
    if window < 1:
        raise ValueError(f"window must be >= 1 token, got {window}")
    _refuse_sliding_windows(model.config)
    batch, length = input_ids.shape
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    positions = (attention_mask.cumsum(-1) - 1).clamp_min(0)  # [batch, seq]
    targets = torch.cat([labels[:, 1:], labels.new_full((batch, 1), IGNORE_INDEX)], dim=1)
    count = int((targets != IGNORE_INDEX).sum())  # tokens the whole-sequence loss averages
    bounds = [(a, min(a + window, length)) for a in range(0, length, window)]
    steps = []  # per window: (loss, produced [(k, v) per layer], leaves [(k, v) per layer])
    for a, b in bounds:
        leaves = _leaves(steps)
        cache = DynamicCache(config=model.config)
        for layer, (k, v) in enumerate(leaves):
            cache.update(k, v, layer)
        out = model(
            input_ids=input_ids[:, a:b],
            attention_mask=attention_mask[:, :b],
            position_ids=positions[:, a:b],
            past_key_values=cache,
            use_cache=True,
        )
        logits = out.logits.float()  # [batch, b - a, vocab]
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]),
            targets[:, a:b].reshape(-1),
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        ) / max(count, 1)
        produced = [(layer.keys[:, :, a:b], layer.values[:, :, a:b]) for layer in cache.layers]
        steps.append((loss, produced, leaves))
    total = sum(loss.detach() for loss, _, _ in steps)
    _backward_in_reverse(steps, bounds)
    return total


def _leaves(steps) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The earlier windows' keys and values, per layer, as fresh leaf tensors."""
    if not steps:
        return []
    layers = len(steps[0][1])
    leaves = []
    for layer in range(layers):
        pair = []
        for part in (0, 1):
            pieces = [produced[layer][part] for _, produced, _ in steps]
            leaf = torch.cat([p.detach() for p in pieces], dim=-2)
            pair.append(leaf.requires_grad_(any(p.requires_grad for p in pieces)))
        leaves.append(tuple(pair))
    return leaves


def _backward_in_reverse(steps, bounds) -> None:
    # gradients that later windows put on each window's produced keys and values
    pending = [[[None, None] for _ in produced] for _, produced, _ in steps]
    for w in reversed(range(len(steps))):
        loss, produced, leaves = steps[w]
        outputs, grads = [loss], [None]
        for layer, pair in enumerate(produced):
            for part in (0, 1):
                grad = pending[w][layer][part]
                if grad is not None and pair[part].requires_grad:
                    outputs.append(pair[part])
                    grads.append(grad)
        if loss.requires_grad:
            torch.autograd.backward(outputs, grads)
        for layer, pair in enumerate(leaves):
            for part in (0, 1):
                grad = pair[part].grad
                if grad is None:
                    continue
                for u in range(w):  # hand each earlier window its slice
                    a, b = bounds[u]
                    piece = grad[:, :, a:b]
                    held = pending[u][layer][part]
                    pending[u][layer][part] = piece if held is None else held + piece
        steps[w] = None  # this window's graph is done: free it


def _refuse_sliding_windows(config) -> None:
    text = getattr(config, "get_text_config", lambda: config)()
    kinds = set(getattr(text, "layer_types", None) or ())
    if getattr(text, "sliding_window", None) or kinds - {"full_attention"}:
        raise ValueError(
            "windowed fine-tuning needs full attention in every layer (a sliding-window "
            "cache drops the keys it would send gradients to); this model has "
            f"{sorted(kinds) or 'a sliding window'}"
        )
