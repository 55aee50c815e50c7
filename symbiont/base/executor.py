"""The base executor: holds each frozen linear weight once and runs it for any client.

Linear layers that are siblings of one module with the same input width (an attention
block's q/k/v/o, a gated MLP's gate/up) are stored back to back in one `[sum_out, in]`
block, each layer's weight a row-slice view of it: no extra memory, and a fused call on
layers fed one input (`forward_fused`) is one matmul over a contiguous run of the block.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Protocol

import torch

from symbiont.model.checkpoint import Checkpoint
from symbiont.model.layers import (
    LayerKind,
    LayerSpec,
    base_forward,
    base_input_grad,
    find_base_layers,
    spec_of,
)
from symbiont.protocol.executor import Executor, Manifest, Op, check_call, validate_fused
from symbiont.protocol.experts import check_experts_call

# A row-slice view may start a block only where an unsliced weight could: at 64 bytes, so
# GEMM kernels see the same alignment (and give the same bits) as on a weight of its own.
_BLOCK_ALIGN_BYTES = 64


@dataclass(frozen=True)
class LoadPlan:
    """What a dense base's executor reads from its checkpoint: each layer's keys, and which
    layers share a block. Making it needs transformers (the model's skeleton and its key
    conversion mapping); carrying it out needs only the safetensors files, so `serve-base`
    makes it in a child process and its own process never imports transformers' models
    (about 90 MB of memory per executor; `symbiont.base.plan`)."""

    manifest: Manifest
    groups: tuple[tuple[int, ...], ...]  # layer ids stored back to back in one block
    keys: tuple[tuple[str, str | None], ...]  # per layer id: (weight key, bias key or None)
    experts: bool = False  # MoE experts stacks: they run the model's own modules

    def to_dict(self) -> dict:
        return {
            "manifest": self.manifest.to_dict(),
            "groups": [list(g) for g in self.groups],
            "keys": [list(k) for k in self.keys],
            "experts": self.experts,
        }

    @classmethod
    def from_dict(cls, data: dict) -> LoadPlan:
        return cls(
            Manifest.from_dict(data["manifest"]),
            tuple(tuple(g) for g in data["groups"]),
            tuple((w, b) for w, b in data["keys"]),
            bool(data["experts"]),
        )

    @classmethod
    def make(cls, path: str | os.PathLike, dtype: torch.dtype | str | None = None) -> LoadPlan:
        """The plan for the checkpoint folder `path` (imports transformers)."""
        return _plan(Checkpoint.open(path), dtype)[0]


# Forward calls of fewer rows than this may go to a few-rows product (`few_rows`)
FEW_ROWS_MAX = 8


class FewRowsProduct(Protocol):
    """`F.linear(x, weight, bias)` for a few rows by a kernel of its own (symbiont's CPU
    kernel: symbiont/kernels/few_rows.py); `fits` says which tensors it takes."""

    def fits(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool: ...

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor: ...


@dataclass(frozen=True)
class _Weights:
    kind: LayerKind
    weight: torch.Tensor  # [out, in] for LINEAR, [in, out] for CONV1D, as the checkpoint stores it
    bias: torch.Tensor | None  # [out]


@dataclass(frozen=True)
class _Block:
    """Sibling LINEAR layers stored back to back: their weights are row slices of `weight`."""

    layers: tuple[int, ...]  # layer ids in row order (module order)
    rows: tuple[tuple[int, int], ...]  # [start, end) rows of each layer in `weight`
    weight: torch.Tensor  # [sum_out, in]
    bias: torch.Tensor | None  # [sum_out], when every layer has one


@dataclass(frozen=True)
class _Run:
    """Layers that form a contiguous run of one block: one matmul computes them all."""

    weight: torch.Tensor  # [sum_out, in] rows of the block (a view)
    bias: torch.Tensor | None  # [sum_out]
    widths: tuple[int, ...]  # out_features of each layer, in the run's order
    in_features: int


def _runs_of(block: _Block) -> dict[tuple[int, ...], _Run]:
    """Every contiguous run of two or more layers of `block` (views made once, at load)."""
    runs = {}
    for first in range(len(block.layers)):
        for last in range(first + 1, len(block.layers)):
            start, end = block.rows[first][0], block.rows[last][1]
            runs[block.layers[first : last + 1]] = _Run(
                block.weight[start:end],
                None if block.bias is None else block.bias[start:end],
                tuple(e - s for s, e in block.rows[first : last + 1]),
                block.weight.shape[1],
            )
    return runs


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
        blocks: list[_Block] = (),
    ):
        self._manifest = manifest
        self._weights = weights
        self.device = device
        self._experts = list(experts)  # the models' own experts modules, weights loaded
        self._blocks = list(blocks)
        self._runs = {layers: r for b in self._blocks for layers, r in _runs_of(b).items()}

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | str | None = None,
    ) -> BaseExecutor:
        """Load only the frozen linear weights (lm_head included) of a local checkpoint."""
        from symbiont.model.moe import load_experts

        checkpoint = Checkpoint.open(path)
        plan, skeleton, experts = _plan(checkpoint, dtype)
        device = torch.device(device)
        stacks = [load_experts(checkpoint, skeleton, name, device) for name, _, _ in experts]
        return cls._carry_out(checkpoint, plan, device, stacks)

    @classmethod
    def from_plan(
        cls, path: str | os.PathLike, plan: LoadPlan, *, device: str | torch.device = "cpu"
    ) -> BaseExecutor:
        """Load a dense base as `plan` (made by `LoadPlan.make` for this folder) says,
        without importing transformers' models."""
        if plan.experts:
            raise ValueError("a base with experts stacks loads with from_pretrained")
        checkpoint = Checkpoint.open(path)
        if checkpoint.fingerprint != plan.manifest.fingerprint:
            raise ValueError(f"the plan was made for another checkpoint than {path}")
        return cls._carry_out(checkpoint, plan, torch.device(device), [])

    @classmethod
    def _carry_out(cls, checkpoint, plan: LoadPlan, device, stacks) -> BaseExecutor:
        manifest = plan.manifest
        specs, dtype = manifest.layers, manifest.dtype
        blocks = [_alloc_block([specs[i] for i in g], dtype, device) for g in plan.groups]
        block_of = {layer: b for b in blocks for layer in b.layers}
        weights = [
            _read_weights(
                checkpoint, plan.keys[spec.id], spec, dtype, device, block_of.get(spec.id)
            )
            for spec in specs
        ]
        return cls(manifest, weights, device, stacks, blocks)

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

    fuses_calls = True  # forward_fused is one matmul over layers stored back to back
    products = "torch"  # what computes the products (serve-base --matmul)
    # Where set (serving executors, serve-base --matmul onednn; never the default, whose
    # products are bitwise the vanilla model's), forward calls of fewer than FEW_ROWS_MAX
    # rows that subclasses would give torch go to this kernel instead
    few_rows: FewRowsProduct | None = None

    def _few_rows_fit(self, x: torch.Tensor, weight: torch.Tensor, bias) -> bool:
        """Whether `few_rows` computes the forward product x weightᵀ + bias."""
        return (
            self.few_rows is not None
            and x.shape[0] < FEW_ROWS_MAX
            and self.few_rows.fits(x, weight, bias)
        )

    def forward_fused(self, layers: tuple[int, ...], x: torch.Tensor) -> list[torch.Tensor]:
        """FORWARD of every layer of `layers` on the same x [n_tokens, in] in one call:
        one matmul when they are a contiguous run of one block (q/k/v, gate/up), else
        one per layer. -> [[n_tokens, out_l] per layer]; views of one tensor when fused."""
        run = self._runs.get(layers)
        if (
            run is None
            or x.dim() != 2
            or x.shape[1] != run.in_features
            or (x.dtype != self._manifest.dtype)
        ):  # a known run needs only x checked; anything else the full check
            validate_fused(self._manifest, layers, x)
        if torch.is_autocast_enabled(self.device.type):  # as in `call`
            with torch.autocast(self.device.type, enabled=False), torch.no_grad():
                return self._fused_on_device(layers, x)
        if torch.is_grad_enabled():
            with torch.no_grad():
                return self._fused_on_device(layers, x)
        return self._fused_on_device(layers, x)

    def _fused_on_device(self, layers: tuple[int, ...], x: torch.Tensor) -> list[torch.Tensor]:
        if x.device == self.device:
            return self.run_fused(layers, x)
        return [y.to(x.device) for y in self.run_fused(layers, x.to(self.device))]

    def run_fused(self, layers: tuple[int, ...], x: torch.Tensor) -> list[torch.Tensor]:
        """The math of one (already validated) fused forward on this executor's device."""
        run = self._runs.get(layers)
        if run is None:
            return [self.run(Op.FORWARD, layer, x) for layer in layers]
        y = torch.nn.functional.linear(x, run.weight, run.bias)  # [n_tokens, sum_out]
        return y.split_with_sizes(run.widths, dim=1)  # views, one per layer

    # Whether serve-base may split a call's product in parts (by rows of x, or by columns
    # through `run_columns`) and compute them at once: only OneDnnExecutor's, whose
    # products are within fp32 rounding of torch's anyway; the default's stay whole,
    # bitwise the vanilla model's
    splits = False

    def column_blocks(self, op: Op, layers: tuple[int, ...]) -> str | None:
        """How `run_columns` computes blocks of this call's output columns: from blocks of
        the weight's rows ("rows"), from strided blocks of its columns ("columns"), or
        not at all (None)."""
        return None

    def run_columns(self, op, layers, x, start, end) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} does not split its products")

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
        from symbiont.model.moe import experts_backward, experts_forward

        if op is Op.EXPERTS_FORWARD:
            return (experts_forward(module, hidden, ids, weights),)
        return experts_backward(module, hidden, ids, weights, grad_y)

    def weight_tensors(self) -> list[torch.Tensor]:
        """Every tensor this executor holds (for memory accounting and tests): the
        blocks, their runs and each layer's weight and bias (views into a block)."""
        blocks = [t for b in self._blocks for t in (b.weight, b.bias) if t is not None]
        runs = [t for r in self._runs.values() for t in (r.weight, r.bias) if t is not None]
        return blocks + runs + self._layer_tensors()

    def _layer_tensors(self) -> list[torch.Tensor]:
        stacks = [p for module in self._experts for p in module.parameters()]
        return [t for w in self._weights for t in (w.weight, w.bias) if t is not None] + stacks

    def weight_bytes(self) -> int:
        """Bytes of weights held; a block's views are counted once, as their block."""
        return sum(t.numel() * t.element_size() for t in self._layer_tensors())


def sibling_groups(specs: list[LayerSpec], dtype: torch.dtype) -> list[list[LayerSpec]]:
    """Layers to store back to back: LINEAR siblings (one parent module) with the same
    input width and all or none with a bias, at least two, and rows that keep each view
    as aligned as a weight of its own."""
    groups: dict[tuple, list[LayerSpec]] = {}
    for spec in specs:
        if spec.kind is not LayerKind.LINEAR:
            continue
        parent = spec.name.rpartition(".")[0]
        groups.setdefault((parent, spec.in_features, spec.has_bias), []).append(spec)
    row_bytes = dtype.itemsize
    return [
        group
        for (_, width, _), group in groups.items()
        if len(group) > 1 and width * row_bytes % _BLOCK_ALIGN_BYTES == 0
    ]


def _alloc_block(group: list[LayerSpec], dtype: torch.dtype, device: torch.device) -> _Block:
    """An uninitialised block for `group`; `_read_weights` fills each layer's rows."""
    rows, start = [], 0
    for spec in group:
        rows.append((start, start + spec.out_features))
        start += spec.out_features
    like = dict(dtype=dtype, device=device)
    weight = torch.empty(start, group[0].in_features, **like)  # [sum_out, in]
    bias = torch.empty(start, **like) if group[0].has_bias else None
    return _Block(tuple(s.id for s in group), tuple(rows), weight, bias)


def _plan(checkpoint: Checkpoint, dtype) -> tuple[LoadPlan, object, list]:
    """(plan, the model's skeleton, its experts stacks as `find_experts` lists them)."""
    from symbiont.model.moe import experts_spec, find_experts
    from symbiont.model.skeleton import build_skeleton, checkpoint_key, resolve_dtype

    dtype = resolve_dtype(checkpoint, dtype)
    skeleton = build_skeleton(checkpoint.config, dtype)
    specs = [spec_of(i, name, m) for i, (name, m) in enumerate(find_base_layers(skeleton))]

    def key(spec: LayerSpec, suffix: str) -> str:
        return checkpoint_key(skeleton, checkpoint, f"{spec.name}.{suffix}")

    keys = [(key(s, "weight"), key(s, "bias") if s.has_bias else None) for s in specs]
    experts = find_experts(skeleton)
    manifest = Manifest(
        checkpoint.fingerprint,
        dtype,
        tuple(specs),
        experts=tuple(experts_spec(i, *found) for i, found in enumerate(experts)),
    )
    groups = tuple(tuple(s.id for s in g) for g in sibling_groups(specs, dtype))
    return LoadPlan(manifest, groups, tuple(keys), bool(experts)), skeleton, experts


def _read_weights(checkpoint, keys, spec: LayerSpec, dtype, device, block) -> _Weights:
    """A layer's weights from the checkpoint: its own tensors, or its rows of `block`.
    keys: (weight key, bias key or None)."""

    def read(suffix: str) -> torch.Tensor:
        key = keys[0] if suffix == "weight" else keys[1]
        return checkpoint.read(key, dtype=dtype, device=device)

    if block is None:
        return _Weights(
            spec.kind, read("weight").contiguous(), read("bias") if spec.has_bias else None
        )
    start, end = block.rows[block.layers.index(spec.id)]
    weight = block.weight[start:end]
    weight.copy_(read("weight"))
    bias = None
    if block.bias is not None:
        bias = block.bias[start:end]
        bias.copy_(read("bias"))
    return _Weights(spec.kind, weight, bias)
