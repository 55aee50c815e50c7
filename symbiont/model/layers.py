"""Which modules of a Hugging Face model are frozen base layers, and how each one computes.

Shared by both halves: the executor uses it to know which weights to hold, the client to
know which modules to replace. Dispatch is on module types, never on names, so any
architecture whose projections are `nn.Linear` or `transformers` `Conv1D` works.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

BASE_LAYER_TYPES = (nn.Linear, Conv1D)


class LayerKind(StrEnum):
    LINEAR = "linear"  # weight [out, in], y = x Wᵀ + b
    CONV1D = "conv1d"  # weight [in, out], y = x W + b (GPT-2 style)


@dataclass(frozen=True)
class LayerSpec:
    """What a client must know about one base layer; `id` is its index in the manifest."""

    id: int
    name: str  # module path in the model, e.g. "model.layers.0.self_attn.q_proj"
    kind: LayerKind
    in_features: int
    out_features: int
    has_bias: bool

    def to_dict(self) -> dict:
        return {**self.__dict__, "kind": self.kind.value}

    @classmethod
    def from_dict(cls, data: dict) -> LayerSpec:
        return cls(**{**data, "kind": LayerKind(data["kind"])})


def is_base_layer(module: nn.Module) -> bool:
    return isinstance(module, BASE_LAYER_TYPES)


def find_base_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every frozen linear module, in module order."""
    return [(name, module) for name, module in model.named_modules() if is_base_layer(module)]


def spec_of(layer_id: int, name: str, module: nn.Module) -> LayerSpec:
    if isinstance(module, Conv1D):
        return LayerSpec(
            layer_id, name, LayerKind.CONV1D, module.nx, module.nf, module.bias is not None
        )
    return LayerSpec(
        layer_id,
        name,
        LayerKind.LINEAR,
        module.in_features,
        module.out_features,
        module.bias is not None,
    )


def base_forward(
    kind: LayerKind, weight: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor
) -> torch.Tensor:
    """y = layer(x) exactly as the replaced module computes it.  x [n_tokens, in] -> [n_tokens, out]"""
    if kind is LayerKind.CONV1D:
        return torch.addmm(bias, x, weight) if bias is not None else x @ weight
    return torch.nn.functional.linear(x, weight, bias)


def base_input_grad(kind: LayerKind, weight: torch.Tensor, grad_y: torch.Tensor) -> torch.Tensor:
    """grad_x = grad_y · ∂y/∂x, which for a frozen layer is the weight alone.
    grad_y [n_tokens, out] -> [n_tokens, in]"""
    if kind is LayerKind.CONV1D:
        return grad_y.mm(weight.t())
    return grad_y.mm(weight)
