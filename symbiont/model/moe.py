"""Mixture-of-experts blocks: which modules are expert stacks, and what a client must know.

In transformers 5 every MoE family keeps its experts as one module holding stacked
weights (`gate_up_proj [E, 2*I, H]`, `down_proj [E, H, I]`, ...) whose forward takes
`(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k])` and returns the routed,
weighted sum `[T, H]`; the router that picks `top_k_index` is a separate, small module.
The experts are frozen base weights, so the executor holds them and runs that very
module; the client keeps the router and calls the executor with its choices.

Dispatch is on that contract (the attributes and the forward signature), not on names,
so a new family with the same experts interface works unchanged.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import nn

from symbiont.model.checkpoint import CheckpointError
from symbiont.model.layers import is_base_layer

EXPERTS_FORWARD_ARGS = ("hidden_states", "top_k_index", "top_k_weights")


@dataclass(frozen=True)
class ExpertsSpec:
    """What a client must know about one experts module; `id` is its index in the manifest."""

    id: int
    name: str  # module path, e.g. "model.layers.0.mlp.experts"
    num_experts: int
    hidden: int  # token width, in and out
    weights: tuple[tuple[str, tuple[int, ...]], ...]  # (parameter, shape): gate_up_proj, ...
    after: int  # base layers before it in module order: its place in a model pass

    def to_dict(self) -> dict:
        return {**self.__dict__, "weights": [[n, list(s)] for n, s in self.weights]}

    @classmethod
    def from_dict(cls, data: dict) -> ExpertsSpec:
        weights = tuple((name, tuple(shape)) for name, shape in data["weights"])
        return cls(**{**data, "weights": weights})


def is_experts(module: nn.Module) -> bool:
    """A transformers experts stack: `num_experts`, `hidden_dim`, stacked 3-D weights and
    forward(hidden_states, top_k_index, top_k_weights)."""
    if not isinstance(getattr(module, "num_experts", None), int):
        return False
    if not isinstance(getattr(module, "hidden_dim", None), int):
        return False
    weights = list(module.named_parameters(recurse=False))
    if not weights or any(p.dim() != 3 for _, p in weights):
        return False
    try:
        names = tuple(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return False
    return names == EXPERTS_FORWARD_ARGS


def find_experts(model: nn.Module) -> list[tuple[str, nn.Module, int]]:
    """(name, module, base layers before it) of every experts stack, in module order."""
    found, linear = [], 0
    for name, module in model.named_modules():
        if is_base_layer(module):
            linear += 1
        elif is_experts(module):
            found.append((name, module, linear))
    return found


def experts_spec(experts_id: int, name: str, module: nn.Module, after: int) -> ExpertsSpec:
    weights = tuple((n, tuple(p.shape)) for n, p in module.named_parameters())
    return ExpertsSpec(experts_id, name, module.num_experts, module.hidden_dim, weights, after)


def load_experts(checkpoint, skeleton: nn.Module, name: str, device) -> nn.Module:
    """The skeleton's experts module `name` with its weights read from the checkpoint
    (through transformers' conversions: per-expert tensors stacked) and frozen."""
    # Here, not at import: the protocol imports this module, and serve-base's process
    # must not pay for transformers' model machinery (symbiont.base.plan).
    from symbiont.model.skeleton import owner_of, read_tensor, set_tensor

    module = skeleton.get_submodule(name)
    for leaf, param in list(module.named_parameters()):
        value = read_tensor(skeleton, checkpoint, f"{name}.{leaf}", device=device)
        if value.shape != param.shape:
            raise CheckpointError(
                f"{name}.{leaf} has shape {list(value.shape)} in {checkpoint.path}, the model "
                f"expects {list(param.shape)}; config.json does not match the weights"
            )
        owner, attr = owner_of(module, leaf)
        set_tensor(owner, attr, value.to(param.dtype).contiguous())
        owner._parameters[attr].requires_grad_(False)
    leftover = [n for n, b in module.named_buffers() if b.is_meta]
    if leftover:
        raise CheckpointError(f"{name} holds buffers {leftover} that symbiont cannot load yet")
    return module


def experts_forward(module: nn.Module, hidden, ids, weights) -> torch.Tensor:
    """y [T, H] of the family's own experts forward. hidden [T, H], ids/weights [T, k]"""
    with torch.no_grad():
        return module(hidden, ids, weights)


def experts_backward(module: nn.Module, hidden, ids, weights, grad_y):
    """(grad_hidden [T, H], grad_weights [T, k]) of the experts at these inputs: the
    forward is run again under autograd (the executor keeps nothing between calls)."""
    # Inputs may be inference tensors (the server loop runs in inference mode): copies
    # made outside it can enter autograd.
    with torch.inference_mode(False), torch.enable_grad():
        h = hidden.clone().requires_grad_()
        w = weights.clone().requires_grad_()
        y = module(h, ids.clone(), w)
        return torch.autograd.grad(y, (h, w), grad_y.clone())
