"""DoRA on a split client: the row norms of W + s·BA without the base weight on the client.

DoRA rescales each output row i of a LoRA-adapted layer by m_i / ‖W_i + s(BA)_i‖. The
client never holds W, so it expands the square:

    ‖W_i + s(BA)_i‖² = ‖W_i‖² + 2s·Σ_k B_ik (W Aᵀ)_ik + s²·‖(BA)_i‖²

- ‖W_i‖² is a property of the frozen base: computed once per layer and cached (an [out]
  vector). It comes from ordinary backward calls with grad_y = rows of the identity, which
  return rows of W in chunks that are reduced to their squared norms and dropped. That
  shows W to the client once, which is fine (the base is public to its clients) and needs
  no new executor operation; it moves out x in numbers once per adapted layer.
- W Aᵀ is one forward call on A's r rows per step (minus the bias the forward adds).
- ‖(BA)_i‖² = B_i (A Aᵀ) B_iᵀ is the adapter's own, computed locally in O(out·r² + r²·in).

PEFT detaches the whole norm (DoRA paper, section 4.3: it is treated as a constant), so it
is computed here without gradient too; the magnitude, A and B get exactly PEFT's
gradients. peft's `DoraLinearLayer` is given these two methods for layers whose base is a
VirtLayer; every other layer runs peft's own code.
"""

from __future__ import annotations

import functools

import torch
from peft.tuners.lora import dora as peft_dora
from torch import nn

from symbiont.client.virt import VirtLayer
from symbiont.protocol.executor import Op

_ROWS_PER_CALL = 256  # identity rows per backward call while reading ‖W_i‖²


def base_row_norms_squared(layer: VirtLayer) -> torch.Tensor:
    """‖W_i‖² for every output row i of the frozen layer, float64 [out]; cached."""
    cached = getattr(layer, "_row_norms_squared", None)
    if cached is None:
        out = layer.spec.out_features
        parts = []
        with torch.no_grad():
            for start in range(0, out, _ROWS_PER_CALL):
                rows = min(_ROWS_PER_CALL, out - start)
                basis = torch.zeros(rows, out, dtype=layer.wire_dtype, device=layer.weight.device)
                basis[:, start : start + rows].fill_diagonal_(1)
                w_rows = layer.call_executor(Op.BACKWARD, basis)  # [rows, in] = W[start:start+rows]
                parts.append(w_rows.double().square().sum(dim=1))
        cached = torch.cat(parts)
        layer._row_norms_squared = cached
    return cached


def dora_weight_norm(
    layer: VirtLayer, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float
) -> torch.Tensor:
    """‖W_i + s(BA)_i‖ for every output row i, as peft's `get_weight_norm` computes it
    (with no gradient), from the executor.  lora_a [r, in], lora_b [out, r] -> [out]"""
    with torch.no_grad():
        a, b = lora_a.detach(), lora_b.detach()
        w_sq = base_row_norms_squared(layer).to(a.device)
        w_at = layer.call_executor(Op.FORWARD, a.to(layer.wire_dtype))  # [r, out] = A Wᵀ + b
        if layer.bias is not None:
            w_at = w_at - layer.bias.to(w_at.dtype)
        a64, b64 = a.double(), b.double()
        cross = (b64 * w_at.double().t()).sum(dim=1)  # Σ_k B_ik (W Aᵀ)_ik
        delta_sq = ((b64 @ (a64 @ a64.t())) * b64).sum(dim=1)  # ‖(BA)_i‖²
        squared = w_sq + 2 * scaling * cross + scaling**2 * delta_sq
        return squared.clamp_min(0).sqrt().to(lora_a.dtype)


def _update_layer(self, original, *, base_layer, lora_A, lora_B, scaling, place_on_cpu=False):
    """peft's DoRA init: the magnitude starts at the row norms of W + s·BA."""
    if not isinstance(base_layer, VirtLayer):
        return original(
            self,
            base_layer=base_layer,
            lora_A=lora_A,
            lora_B=lora_B,
            scaling=scaling,
            place_on_cpu=place_on_cpu,
        )
    weight_norm = dora_weight_norm(base_layer, lora_A, lora_B, scaling)
    if place_on_cpu:
        weight_norm = weight_norm.to("cpu")
    self.weight = nn.Parameter(weight_norm, requires_grad=True)
    return None


def _forward(
    self,
    original,
    x,
    *,
    lora_A,
    lora_B,
    scaling,
    base_layer,
    base_result=None,
    adapter_name="default",
):
    """peft's DoRA forward, line for line, with the norm from the executor and W x from
    the base layer (an executor call) where peft would multiply by W itself."""
    if not isinstance(base_layer, VirtLayer):
        return original(
            self,
            x,
            lora_A=lora_A,
            lora_B=lora_B,
            scaling=scaling,
            base_layer=base_layer,
            base_result=base_result,
            adapter_name=adapter_name,
        )
    magnitude = self.weight
    weight_norm = dora_weight_norm(base_layer, lora_A.weight, lora_B.weight, scaling)
    weight_norm = weight_norm.to(x.dtype).detach()  # peft treats the norm as a constant
    mag_norm_scale = (magnitude / weight_norm).view(1, -1)
    lora_result = lora_B(lora_A(x))
    if base_result is None:  # dropout on x in training: peft computes W x on the dropped x
        base_result = base_layer(x)
    if base_layer.bias is not None:
        base_result = base_result - base_layer.bias  # W x: the scale applies without bias
    return (mag_norm_scale - 1) * base_result + mag_norm_scale * lora_result * scaling


_installed = False


def install() -> None:
    """Give peft's DoraLinearLayer the split paths (idempotent; other layers unchanged)."""
    global _installed
    if _installed:
        return
    layer = peft_dora.DoraLinearLayer
    layer.update_layer = functools.partialmethod(_update_layer, layer.update_layer)
    layer.forward = functools.partialmethod(_forward, layer.forward)
    _installed = True
