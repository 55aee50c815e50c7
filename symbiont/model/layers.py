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

from symbiont.model.checkpoint import CheckpointError

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


# transformers subclasses of nn.Linear whose own forward computes exactly x Wᵀ + b (up to
# rounding), so the executor's F.linear replaces them faithfully.
EQUIVALENT_LINEARS = frozenset({"transformers.models.falcon.modeling_falcon.FalconLinear"})


class UnsupportedArchitecture(CheckpointError):
    """A model family whose base layers the executor cannot compute exactly."""


def find_base_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every frozen linear module, in module order.

    Refuses (UnsupportedArchitecture) a transformers model with a linear layer whose class
    computes something else than x Wᵀ + b: splitting it would give wrong numbers."""
    found = [(name, module) for name, module in model.named_modules() if is_base_layer(module)]
    for name, module in found:
        _refuse_custom_linear(model, name, module)
    return found


def _refuse_custom_linear(model: nn.Module, name: str, module: nn.Module) -> None:
    cls = type(module)
    qualified = f"{cls.__module__}.{cls.__qualname__}"
    if not cls.__module__.startswith("transformers.") or qualified in EQUIVALENT_LINEARS:
        return  # symbiont's own VirtLayers, or a layer known to compute x Wᵀ + b
    if cls.forward in (nn.Linear.forward, Conv1D.forward):
        return
    family = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
    parent = "nn.Linear" if isinstance(module, nn.Linear) else "Conv1D"
    raise UnsupportedArchitecture(
        f"model family {family!r} is not supported: its {cls.__name__} layers (e.g. {name}) "
        f"subclass {parent} with their own forward, which is not x Wᵀ + b, "
        "so a base executor running them as plain linear layers would compute wrong "
        "numbers. Missing: an executor operation for that layer's math "
        "(see docs/compatibility.md)"
    )


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
