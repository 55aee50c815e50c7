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
    step = WindowedStep(model, input_ids, labels, attention_mask)
    while not step.forward_done:
        step.forward(window)
    while not step.done:
        step.backward()
    return step.loss


class WindowedStep:
    """One training step over a batch, advanced a window at a time by whoever schedules it
    (the co-serving worker, symbiont/jobs/coserve.py): `forward(n)` runs the next n
    positions of every row; once the whole batch is forwarded, each `backward()` runs the
    backward of the last window not yet done. Tokens are counted as rows x positions.

    `scale` multiplies the loss whose gradients are accumulated (1 / gradient
    accumulation); `loss` is the unscaled loss of the windows forwarded so far. `plan`
    fixes the positions of every forward window (the last one shorter): a scheduler then
    runs whole planned windows only, so the step's result is a function of the batch and
    the plan, not of when slots came (exact resume, symbiont/jobs/coserve.py)."""

    def __init__(
        self,
        model,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        scale: float = 1.0,
        plan: int | None = None,
    ):
        _refuse_sliding_windows(model.config)
        if plan is not None and plan < 1:
            raise ValueError(f"a window plan needs >= 1 position per window, got {plan}")
        self.model, self.input_ids, self.scale = model, input_ids, scale
        self.batch, self.length = input_ids.shape
        # positions per forward window, fixed (None: the scheduler cuts each window to fit):
        # the windows, hence the float rounding of the step, then do not depend on timing
        self.plan = None
        if plan is not None:  # balanced: ceil(length / plan) windows of equal positions
            windows = -(-self.length // plan)
            self.plan = -(-self.length // windows)
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        self.attention_mask = attention_mask
        self.positions = (attention_mask.cumsum(-1) - 1).clamp_min(0)  # [batch, seq]
        ignore = labels.new_full((self.batch, 1), IGNORE_INDEX)
        self.targets = torch.cat([labels[:, 1:], ignore], dim=1)  # [batch, seq]
        self.count = int((self.targets != IGNORE_INDEX).sum())  # tokens the loss averages
        self.bounds: list[tuple[int, int]] = []  # [a, b) positions of each forwarded window
        # per window: (loss, produced [(k, v) per layer], leaves [(k, v) per layer])
        self.steps: list = []
        self.pending: list = []  # per window: key/value gradients later windows left for it
        self.loss = torch.zeros(())
        self._next_backward: int | None = None  # window whose backward runs next

    @property
    def forwarded(self) -> int:
        """Positions (per row) forwarded so far."""
        return self.bounds[-1][1] if self.bounds else 0

    @property
    def forward_done(self) -> bool:
        return self.forwarded >= self.length

    @property
    def done(self) -> bool:
        return self._next_backward is not None and self._next_backward < 0

    def next_forward_tokens(self) -> int:
        """Tokens of the next planned forward window (0 without a plan or when forwarded)."""
        if self.plan is None or self.forward_done:
            return 0
        return self.batch * min(self.plan, self.length - self.forwarded)

    def next_backward_tokens(self) -> int:
        """Tokens of the window whose backward runs next (0 while forwarding or when done)."""
        if self._next_backward is None or self.done:
            return 0
        a, b = self.bounds[self._next_backward]
        return self.batch * (b - a)

    def backward_tokens_left(self) -> int:
        """Tokens of the windows whose backward has not run."""
        if self._next_backward is None or self.done:
            return 0
        return self.batch * self.bounds[self._next_backward][1]

    def forward(self, positions: int | None = None) -> int:
        """Forward the next `positions` positions (fewer at the end; default: the plan's);
        returns the tokens run."""
        if positions is None:
            if self.plan is None:
                raise ValueError("forward() without positions needs a window plan")
            positions = self.plan
        if positions < 1:
            raise ValueError(f"a window needs >= 1 position, got {positions}")
        if self.forward_done:
            raise RuntimeError("the batch is already forwarded; run backward()")
        a = self.forwarded
        b = min(a + positions, self.length)
        leaves = _leaves(self.steps)
        cache = DynamicCache(config=self.model.config)
        for layer, (k, v) in enumerate(leaves):
            cache.update(k, v, layer)
        out = self.model(
            input_ids=self.input_ids[:, a:b],
            attention_mask=self.attention_mask[:, :b],
            position_ids=self.positions[:, a:b],
            past_key_values=cache,
            use_cache=True,
        )
        logits = out.logits.float()  # [batch, b - a, vocab]
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]),
            self.targets[:, a:b].reshape(-1),
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        ) / max(self.count, 1)
        produced = [(layer.keys[:, :, a:b], layer.values[:, :, a:b]) for layer in cache.layers]
        self.steps.append((loss, produced, leaves))
        self.pending.append([[None, None] for _ in produced])
        self.bounds.append((a, b))
        self.loss = self.loss + loss.detach()
        if self.forward_done:
            self._next_backward = len(self.steps) - 1
        return self.batch * (b - a)

    def backward(self) -> int:
        """The backward of the last window not yet done; returns its tokens."""
        if not self.forward_done:
            raise RuntimeError("backward runs once the whole batch is forwarded")
        if self.done:
            raise RuntimeError("every window's backward has run")
        w = self._next_backward
        tokens = self.next_backward_tokens()
        _backward_window(self.steps, self.pending, self.bounds, w, self.scale)
        self.steps[w] = self.pending[w] = None  # this window's graph is done: free it
        self._next_backward = w - 1
        return tokens


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


def _backward_window(steps, pending, bounds, w: int, scale: float) -> None:
    """Window w's loss and the key/value gradients later windows left for it flow back
    through its graph alone; the gradients its own leaves receive go to earlier windows."""
    loss, produced, leaves = steps[w]
    outputs, grads = [loss * scale], [None]
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


def _refuse_sliding_windows(config) -> None:
    text = getattr(config, "get_text_config", lambda: config)()
    kinds = set(getattr(text, "layer_types", None) or ())
    if getattr(text, "sliding_window", None) or kinds - {"full_attention"}:
        raise ValueError(
            "windowed fine-tuning needs full attention in every layer (a sliding-window "
            "cache drops the keys it would send gradients to); this model has "
            f"{sorted(kinds) or 'a sliding window'}"
        )
