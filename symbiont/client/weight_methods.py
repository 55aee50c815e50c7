"""HRA, SHiRA and DeLoRA on a split client: their use of the base weight rewritten as calls
of the base layer, exact by linearity.

peft computes these three with W itself; the client has no W, so:

- HRA: F.linear(x, W·H, b) = x Hᵀ Wᵀ + b = base(x Hᵀ): the reflections go on the input.
- SHiRA: F.linear(x, W + ΔW, b) = base(x) + x ΔWᵀ (peft's own path for quantized bases
  that cannot merge).
- DeLoRA: its fixed ‖W_{:,j}‖ (column norms, read once when the adapter is created) come
  from forward calls whose inputs are rows of the identity (they return columns of W plus
  the bias), reduced to norms in chunks and dropped; cached per layer as a property of the
  frozen base. That shows W to the client once, which is fine: the base is public to its
  clients.

Each peft layer class gets these paths only where its base layer is a VirtLayer, and only
while the adapter is active and unmerged; everything else runs peft's own code.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from peft.tuners.delora import layer as peft_delora
from peft.tuners.hra import layer as peft_hra
from peft.tuners.shira import layer as peft_shira
from torch import nn

from symbiont.client.virt import VirtLayer
from symbiont.protocol.executor import Op

_ROWS_PER_CALL = 256  # identity rows per forward call while reading column norms


def _split(module) -> bool:
    """Does this adapter layer compute through the executor right now?"""
    return (
        isinstance(module.get_base_layer(), VirtLayer)
        and not module.disable_adapters
        and not module.merged
    )


def _hra_forward(self, original, x, *args, **kwargs):
    if not _split(self):
        return original(self, x, *args, **kwargs)
    previous_dtype = x.dtype
    reflections = torch.eye(self.in_features, device=x.device)  # H [in, in], as peft builds it
    for adapter in self.active_adapters:
        if adapter in self.hra_u:
            delta = self.get_delta_weight(adapter)
            reflections = torch.mm(reflections.to(delta.dtype), delta)
    x = self._cast_input_dtype(x, reflections.dtype)
    return self.base_layer(x @ reflections.t(), *args, **kwargs).to(previous_dtype)


def _shira_forward(self, original, x, *args, **kwargs):
    if not _split(self):
        return original(self, x, *args, **kwargs)
    result = self.base_layer(x, *args, **kwargs)
    delta = torch.zeros(self.out_features, self.in_features).to(result)  # ΔW [out, in]
    for adapter in self.active_adapters:
        if adapter in self.shira_weight:
            delta += self.get_delta_weight(adapter)
    return result + F.linear(x, delta)


def base_column_norms(layer: VirtLayer) -> torch.Tensor:
    """‖W_{:,j}‖ for every input column j of the frozen layer [in]; cached."""
    cached = getattr(layer, "_column_norms", None)
    if cached is None:
        width = layer.spec.in_features
        parts = []
        with torch.no_grad():
            for start in range(0, width, _ROWS_PER_CALL):
                rows = min(_ROWS_PER_CALL, width - start)
                basis = torch.zeros(rows, width, dtype=layer.wire_dtype, device=layer.weight.device)
                basis[:, start : start + rows].fill_diagonal_(1)
                columns = layer.call_executor(Op.FORWARD, basis)  # [rows, out] = W[:, j]ᵀ + b
                if layer.bias is not None:
                    columns = columns - layer.bias.to(columns.dtype)
                parts.append(torch.linalg.vector_norm(columns, dim=1))
        cached = torch.cat(parts)
        layer._column_norms = cached
    return cached


def _delora_reset(self, original, adapter_name, init_weights=True, delora_lambda=15.0):
    """peft's reset_delora_parameters, line for line, with the column norms of W from
    the executor."""
    if not isinstance(self.get_base_layer(), VirtLayer):
        return original(self, adapter_name, init_weights, delora_lambda)
    if adapter_name not in self.delora_A:
        return None
    nn.init.kaiming_uniform_(self.delora_A[adapter_name], a=math.sqrt(5))
    if init_weights is True:
        nn.init.zeros_(self.delora_B[adapter_name])
    else:
        nn.init.kaiming_uniform_(self.delora_B[adapter_name], a=math.sqrt(5))
    self.delora_lambda[adapter_name].data.fill_(float(delora_lambda))
    base = self.get_base_layer()
    # a copy: the cache is the layer's, each adapter's buffer its own (peft's is too)
    self.delora_w_norm[adapter_name] = base_column_norms(base).to(base.weight.dtype).clone()
    return None


_installed = False


def install() -> None:
    """Give peft's HRA, SHiRA and DeLoRA linear layers the split paths (idempotent)."""
    global _installed
    if _installed:
        return
    for cls, name, path in (
        (peft_hra.HRALinear, "forward", _hra_forward),
        (peft_shira.Linear, "forward", _shira_forward),
        (peft_delora.DeloraLayer, "reset_delora_parameters", _delora_reset),
    ):
        setattr(cls, name, functools.partialmethod(path, getattr(cls, name)))
    _installed = True
