"""The base executor: holds each frozen linear weight once and runs it for any client."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from symbiont.model.checkpoint import Checkpoint
from symbiont.model.layers import (
    LayerKind,
    base_forward,
    base_input_grad,
    find_base_layers,
    spec_of,
)
from symbiont.model.moe import (
    experts_backward,
    experts_forward,
    experts_spec,
    find_experts,
    load_experts,
)
from symbiont.model.skeleton import build_skeleton, checkpoint_key, resolve_dtype
from symbiont.protocol.executor import Executor, Manifest, Op, check_call
from symbiont.protocol.experts import check_experts_call


@dataclass(frozen=True)
class _Weights:
    kind: LayerKind
    weight: torch.Tensor  # [out, in] for LINEAR, [in, out] for CONV1D, as the checkpoint stores it
    bias: torch.Tensor | None  # [out]


class BaseExecutor(Executor):
    """Frozen base layers of one checkpoint, served in-process.

    Stateless per call: forward computes `x Wᵀ + b`, backward computes `grad_y W`; nothing
    of a call is kept afterwards, so clients need not run in lockstep.
    """

    def __init__(
        self,
        manifest: Manifest,
        weights: list[_Weights],
        device: torch.device,
        experts: list[torch.nn.Module] = (),
    ):
        self._manifest = manifest
        self._weights = weights
        self.device = device
        self._experts = list(experts)  # the models' own experts modules, weights loaded

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | str | None = None,
    ) -> BaseExecutor:
        """Load only the frozen linear weights (lm_head included) of a local checkpoint."""
        checkpoint = Checkpoint.open(path)
        dtype = resolve_dtype(checkpoint, dtype)
        device = torch.device(device)
        skeleton = build_skeleton(checkpoint.config, dtype)
        specs, weights = [], []
        for layer_id, (name, module) in enumerate(find_base_layers(skeleton)):
            spec = spec_of(layer_id, name, module)
            specs.append(spec)
            weights.append(
                _read_weights(
                    checkpoint, skeleton, spec.name, spec.kind, spec.has_bias, dtype, device
                )
            )
        experts = find_experts(skeleton)
        stacks = [load_experts(checkpoint, skeleton, name, device) for name, _, _ in experts]
        manifest = Manifest(
            checkpoint.fingerprint,
            dtype,
            tuple(specs),
            experts=tuple(experts_spec(i, *found) for i, found in enumerate(experts)),
        )
        return cls(manifest, weights, device, stacks)

    @property
    def manifest(self) -> Manifest:
        return self._manifest

    def call(self, op: Op, layer: int, x: torch.Tensor) -> torch.Tensor:
        check_call(self._manifest, op, layer, x)
        if torch.is_autocast_enabled(self.device.type):
            # A client's autocast must not leak in: base layers run in the executor's
            # dtype, forward and backward alike, as they do over any remote transport.
            with torch.autocast(self.device.type, enabled=False), torch.no_grad():
                return self._run_on_device(op, layer, x)
        if torch.is_grad_enabled():  # entering no_grad costs more than the check
            with torch.no_grad():
                return self._run_on_device(op, layer, x)
        return self._run_on_device(op, layer, x)

    def _run_on_device(self, op: Op, layer: int, x: torch.Tensor) -> torch.Tensor:
        if x.device == self.device:
            return self.run(op, layer, x)
        return self.run(op, layer, x.to(self.device)).to(x.device)

    def run(self, op: Op, layer: int, x: torch.Tensor) -> torch.Tensor:
        """The math of one (already validated) call on this executor's device."""
        w = self._weights[layer]
        if op is Op.FORWARD:
            return base_forward(w.kind, w.weight, w.bias, x)
        return base_input_grad(w.kind, w.weight, x)

    def call_experts(self, op, experts, hidden, ids, weights, grad_y=None):
        check_experts_call(self._manifest, op, experts, hidden, ids, weights, grad_y)
        tensors = [hidden, ids, weights] + ([] if grad_y is None else [grad_y])
        with torch.autocast(self.device.type, enabled=False):  # as over any transport
            out = self.run_experts(op, experts, *(t.to(self.device) for t in tensors))
        return tuple(t.to(hidden.device) for t in out)

    def run_experts(self, op, experts, hidden, ids, weights, grad_y=None):
        """The math of one (already validated) experts call on this executor's device."""
        module = self._experts[experts]
        if hidden.shape[0] == 0:  # nothing routed: the experts' kernels need a token
            empty = (hidden, weights) if op is Op.EXPERTS_BACKWARD else (hidden,)
            return tuple(torch.zeros_like(t) for t in empty)
        if op is Op.EXPERTS_FORWARD:
            return (experts_forward(module, hidden, ids, weights),)
        return experts_backward(module, hidden, ids, weights, grad_y)

    def weight_tensors(self) -> list[torch.Tensor]:
        """Every tensor this executor holds (for memory accounting and tests)."""
        stacks = [p for module in self._experts for p in module.parameters()]
        return [t for w in self._weights for t in (w.weight, w.bias) if t is not None] + stacks

    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.weight_tensors())


def _read_weights(checkpoint, skeleton, name, kind, has_bias, dtype, device) -> _Weights:
    weight = checkpoint.read(
        checkpoint_key(skeleton, checkpoint, f"{name}.weight"), dtype=dtype, device=device
    )
    bias = None
    if has_bias:
        bias = checkpoint.read(
            checkpoint_key(skeleton, checkpoint, f"{name}.bias"), dtype=dtype, device=device
        )
    return _Weights(kind, weight.contiguous(), bias)
