"""Base weights repacked once for the CPU's matmul library, for serving (inference only).

`F.linear` on a checkpoint's `[out, in]` weight runs MKL's sgemm, which at decode batch
sizes (1-32 rows) reaches a fraction of what a core can do. oneDNN with the weight
reordered once into its blocked layout ran the same products 1.2-2.0x faster at 8-32 rows
for layers of 0.6M-4.6M weights, but costs about 12 µs more per call, so it lost on small
layers (0.2-0.7x at one row for 4K-260K weights; `python benchmarks/prepack.py`). Only
modules holding a layer of at least `MIN_PACKED_WEIGHTS` weights are repacked.

Results agree with the plain layout within fp32 rounding (a different summation order),
not bit for bit. A packed weight serves forward calls only: the backward product
`grad_y · W` needs the plain layout, which is not kept (keeping both would double the base's
memory), so fine-tuning through a packed executor is refused with a message.
"""

from __future__ import annotations

import torch

from symbiont.base.executor import BaseExecutor, _Weights
from symbiont.model.layers import LayerKind
from symbiont.protocol.executor import ExecutorError, Op

# 512K weights: 768x768 won 1.2-1.6x at 8-32 rows; 256x688 lost at one row (0.6x)
MIN_PACKED_WEIGHTS = 1 << 19


def can_prepack(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether this placement has a packed layout to gain from (fp32 on a CPU with oneDNN)."""
    return (
        torch.device(device).type == "cpu"
        and dtype == torch.float32
        and torch.backends.mkldnn.is_available()
    )


class PrepackedExecutor(BaseExecutor):
    """A `BaseExecutor` whose large linear layers hold their weight in oneDNN's layout.

    Takes over `base`'s tensors: the plain weights of packed layers are dropped."""

    def __init__(self, base: BaseExecutor, min_weights: int = MIN_PACKED_WEIGHTS):
        if not can_prepack(base.device, base.manifest.dtype):
            raise ValueError(
                f"packed weights need float32 on a CPU with oneDNN, not "
                f"{base.manifest.dtype} on {base.device}; serve without packing (--no-prepack)"
            )
        chosen = _layers_to_pack(base.manifest.layers, min_weights)
        weights, self._packed = [], {}
        for layer, w in enumerate(base._weights):
            if layer in chosen:
                # [out, in] -> opaque blocked layout; 32 rows: a typical decode batch (a hint)
                self._packed[layer] = torch.ops.mkldnn._reorder_linear_weight(w.weight, 32)
                w = _Weights(w.kind, torch.empty(0, dtype=w.weight.dtype), w.bias)
            weights.append(w)
        # Plain weights may be views of one block per module (q/k/v/o; gate/up/down): a
        # module's layers are packed all or none, so no view keeps a packed one's rows alive.
        # Unpacked modules keep their blocks, so their fused calls stay one matmul; packed
        # layers of a fused call run one packed product each.
        blocks = [b for b in base._blocks if not chosen.intersection(b.layers)]
        super().__init__(base.manifest, weights, base.device, base._experts, blocks)

    @property
    def packed_layers(self) -> frozenset[int]:
        return frozenset(self._packed)

    def run(self, op: Op, layer: int, x: torch.Tensor) -> torch.Tensor:
        packed = self._packed.get(layer)
        if packed is None:
            return super().run(op, layer, x)
        if op is not Op.FORWARD:
            raise ExecutorError(
                f"layer {layer} ({self.manifest.layers[layer].name}) holds its weight packed "
                "for inference, so this executor computes no backward calls; fine-tune "
                "against an executor started without packing (symbiont serve --no-prepack, "
                "or a serve-base)"
            )
        bias = self._weights[layer].bias
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")

    def weight_tensors(self) -> list[torch.Tensor]:
        plain = [t for w in self._weights for t in (w.weight, w.bias) if t is not None]
        stacks = [p for module in self._experts for p in module.parameters()]
        return [t for t in plain if t.numel() > 0] + list(self._packed.values()) + stacks

    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.weight_tensors())


def _layers_to_pack(specs, min_weights: int) -> set[int]:
    """LINEAR layers of every module (siblings, same input width) holding a layer of at
    least `min_weights` weights."""
    modules: dict[tuple[str, int], list] = {}
    for spec in specs:
        if spec.kind is LayerKind.LINEAR:
            modules.setdefault((spec.name.rpartition(".")[0], spec.in_features), []).append(spec)
    return {
        spec.id
        for siblings in modules.values()
        if any(s.in_features * s.out_features >= min_weights for s in siblings)
        for spec in siblings
    }
