"""Base weights repacked once for the CPU's matmul library, for serving (inference only).

`F.linear` on a checkpoint's `[out, in]` weight runs MKL's sgemm, which at decode batch
sizes (1-32 rows) reaches a fraction of what a core can do. oneDNN with the weight
reordered once into its blocked layout ran the same products 1.2-2.0x faster at 8-32 rows
for layers of 0.6M-4.6M weights, but costs about 12 µs more per call, so it lost on small
layers at one row (0.2-0.7x for 4K-260K weights; `python benchmarks/prepack.py`). Hence:

- a module holding a layer of at least `MIN_PACKED_WEIGHTS` weights is packed, and its
  plain weights are dropped;
- a smaller module keeps its plain weights and gets a packed copy as well (each such layer
  is under 2 MiB), used for calls of at least `packed_min_rows(weights)` rows: 2 for a
  product of 256K weights or more, up to `PACKED_MIN_ROWS` (8) for one of 64K or fewer.
  The plain product's time grows with the rows from the first, the packed one's hardly up
  to 4 rows, so the bigger the product the sooner packed wins: on an AMD EPYC with
  AVX-512, 352K weights took 27 against 38 µs at 2 rows, 65K weights 12.6 against 7.0 µs.
  The engine generated 1.14-1.17x as many tokens per second on a 4M-parameter model with
  2-4 sequences as with packed copies from 8 rows for every size (BENCHMARKS.md, issue 17,
  session 13);
- layers that clients call as one fused call (q/k/v, gate/up: `FUSED_SIBLINGS`) are packed
  together, one oneDNN product per fused call, as the plain executor runs one matmul over
  their block (decode steps of a 97.5M model 6% faster than one packed product per layer).
  A lone call on such a layer of a big module computes its siblings too and keeps its
  own columns: clients fuse these calls, so that only happens on a first call or one made
  under `torch.inference_mode`.

Results agree with the plain layout within fp32 rounding (a different summation order),
not bit for bit. A packed weight serves forward calls only: the backward product
`grad_y · W` needs the plain layout, which big modules do not keep (keeping both would
double the base's memory), so fine-tuning through a packed executor is refused with a
message.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from symbiont.base.executor import FEW_ROWS_MAX, BaseExecutor, FewRowsProduct, _Weights
from symbiont.model.layers import LayerKind
from symbiont.protocol.executor import ExecutorError, Op

# 512K weights: 768x768 won 1.2-1.6x at 8-32 rows; 256x688 lost at one row (0.6x)
MIN_PACKED_WEIGHTS = 1 << 19
# Smaller layers run packed from packed_min_rows(weights) rows: between these two
PACKED_MIN_ROWS = 8
PACKED_MIN_ROWS_FLOOR = 2
# A product of this many weights would run packed from one row (1 << 19: 512K)
PACKED_ONE_ROW_WEIGHTS = 1 << 19


def packed_min_rows(weights: int) -> int:
    """Rows from which a small product of `weights` weights runs packed: about where a
    packed call, whose time hardly grows up to 4 rows, beats the plain one, whose time
    grows with every row. 64K weights -> 8, 128K -> 4, 256K and more -> 2."""
    rows = -(-PACKED_ONE_ROW_WEIGHTS // max(1, weights))
    return max(PACKED_MIN_ROWS_FLOOR, min(PACKED_MIN_ROWS, rows))


# Sibling layers (last name parts, in module order) that clients call as one fused call
FUSED_SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def can_prepack(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether this placement has a packed layout to gain from (fp32 on a CPU with oneDNN)."""
    return (
        torch.device(device).type == "cpu"
        and dtype == torch.float32
        and torch.backends.mkldnn.is_available()
    )


@dataclass(frozen=True)
class _Packed:
    """One oneDNN product computing one or more sibling layers."""

    layers: tuple[int, ...]
    weight: torch.Tensor  # opaque blocked layout of the layers' [sum_out, in] rows
    bias: torch.Tensor | None  # [sum_out]
    widths: tuple[int, ...]  # out_features of each layer
    min_rows: int  # fewer rows run the plain weights (kept only then); 0: always packed

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        """x [n_tokens, in] -> [[n_tokens, out_l] per layer] (views of one product)."""
        y = torch.ops.mkldnn._linear_pointwise(
            x.contiguous(), self.weight, self.bias, "none", [], ""
        )
        return list(y.split_with_sizes(self.widths, dim=1)) if len(self.widths) > 1 else [y]


class PrepackedExecutor(BaseExecutor):
    """A `BaseExecutor` whose linear layers hold their weight in oneDNN's layout.

    Takes over `base`'s tensors: the plain weights of big modules are dropped."""

    def __init__(
        self,
        base: BaseExecutor,
        min_weights: int = MIN_PACKED_WEIGHTS,
        min_rows: int | Callable[[int], int] | None = packed_min_rows,
        fuse_siblings: bool = True,
        few_rows: FewRowsProduct | None = None,
    ):
        """min_rows: rows from which a small module's packed copy is used, or a function
        of the product's weights giving them; None: small modules get no packed copy;
        fuse_siblings False: one packed product per layer (how this executor packed before
        both); few_rows: computes the forward calls of fewer rows than that on the plain
        weights instead of `F.linear` (symbiont/kernels/few_rows.py), where it `fits`."""
        if not can_prepack(base.device, base.manifest.dtype):
            raise ValueError(
                f"packed weights need float32 on a CPU with oneDNN, not "
                f"{base.manifest.dtype} on {base.device}; serve without packing (--no-prepack)"
            )
        specs = base.manifest.layers
        big = _layers_to_pack(specs, min_weights)
        linear = {
            s.id
            for s in specs
            if s.kind is LayerKind.LINEAR and (min_rows is not None or s.id in big)
        }
        self._fused: dict[tuple[int, ...], _Packed] = {}  # fused calls' products
        self._home: dict[int, tuple[_Packed, int]] = {}  # layer -> its product, its place
        for layers, weight, bias in _products(base, linear, fuse_siblings):
            packed = _Packed(
                layers,
                # [sum_out, in] -> opaque blocked layout; 32 rows: a typical decode batch
                torch.ops.mkldnn._reorder_linear_weight(weight, 32),
                bias,
                tuple(specs[i].out_features for i in layers),
                0 if layers[0] in big else _rows_for(min_rows, weight.numel()),
            )
            if len(layers) > 1:
                self._fused[layers] = packed
            for place, layer in enumerate(layers):
                self._home[layer] = (packed, place)
        weights = [
            _Weights(w.kind, torch.empty(0, dtype=w.weight.dtype), w.bias) if i in big else w
            for i, w in enumerate(base._weights)
        ]
        # Plain weights may be views of one block per module (q/k/v/o; gate/up/down): a
        # module is big or small as a whole, so no kept view holds a dropped layer's rows.
        blocks = [b for b in base._blocks if not big.intersection(b.layers)]
        super().__init__(base.manifest, weights, base.device, base._experts, blocks)
        self._big = frozenset(big)
        self.few_rows = few_rows

    @property
    def packed_layers(self) -> frozenset[int]:
        """Layers whose plain weights were dropped (big modules)."""
        return self._big

    def run(self, op: Op, layer: int, x: torch.Tensor) -> torch.Tensor:
        home = self._home.get(layer)
        if home is None or (
            layer not in self._big and (op is not Op.FORWARD or x.shape[0] < home[0].min_rows)
        ):
            w = self._weights[layer]
            few = op is Op.FORWARD and w.kind is LayerKind.LINEAR
            if few and self._few_rows_fit(x, w.weight, w.bias):
                return self.few_rows(x, w.weight, w.bias)
            return super().run(op, layer, x)
        if op is not Op.FORWARD:
            raise ExecutorError(
                f"layer {layer} ({self.manifest.layers[layer].name}) holds its weight packed "
                "for inference, so this executor computes no backward calls; fine-tune "
                "against an executor started without packing (symbiont serve --no-prepack, "
                "or a serve-base)"
            )
        packed, place = home
        return packed(x)[place]

    def run_fused(self, layers: tuple[int, ...], x: torch.Tensor) -> list[torch.Tensor]:
        packed = self._fused.get(layers)
        if packed is not None and x.shape[0] >= packed.min_rows:
            return packed(x)
        run = self._runs.get(layers)
        if run is not None and self._few_rows_fit(x, run.weight, run.bias):
            return self.few_rows(x, run.weight, run.bias).split_with_sizes(run.widths, dim=1)
        return super().run_fused(layers, x)

    def direct_product(self, layers: tuple[int, ...]) -> DirectProduct | None:
        """FORWARD of `layers` (one layer, or a fused run such as q/k/v) bound to its
        weights: what `run`/`run_fused` compute, for callers that make many small calls
        (the serving engine's lean forward); None where it would never apply. Reflects
        this executor as it is now (set `few_rows` before)."""
        manifest = self.manifest
        if not layers or any(not 0 <= i < len(manifest.layers) for i in layers):
            return None
        never = DirectProduct.NEVER
        if len(layers) == 1:
            layer = layers[0]
            weights = self._weights[layer]
            packed, place = self._home.get(layer, (None, 0))
            min_rows = never if packed is None else packed.min_rows
            if layer in self._big:  # its plain weights were dropped: always packed
                min_rows = 0
            few = None
            if weights.kind is LayerKind.LINEAR and weights.weight.numel():
                few = self._bound_few_rows(weights.weight, weights.bias)
            widths = (manifest.layers[layer].out_features,)
        else:
            packed, place = self._fused.get(layers), None
            min_rows = never if packed is None else packed.min_rows
            run = self._runs.get(layers)
            few = None if run is None else self._bound_few_rows(run.weight, run.bias)
            widths = None if run is None else run.widths
        if (packed is None or min_rows == never) and few is None:
            return None
        in_features = manifest.layers[layers[0]].in_features
        return DirectProduct(in_features, packed, min_rows, place, few, widths)

    def _bound_few_rows(self, weight: torch.Tensor, bias: torch.Tensor | None):
        bound = getattr(self.few_rows, "bound", None)
        return None if bound is None else bound(weight, bias)

    def _products(self) -> list[_Packed]:
        return list({id(p): p for p, _ in self._home.values()}.values())

    def weight_tensors(self) -> list[torch.Tensor]:
        plain = [t for t in super().weight_tensors() if t.numel() > 0]
        return plain + [p.weight for p in self._products()]

    def weight_bytes(self) -> int:
        """Plain weights kept (a block's views counted once) and every packed product."""
        packed = sum(p.weight.numel() * p.weight.element_size() for p in self._products())
        return super().weight_bytes() + packed


class DirectProduct:
    """FORWARD of one layer or one fused run, its product and weights looked up once:
    `direct(x)` is `run`/`run_fused`'s result for x, bitwise (the same products on the same
    weights), or None for an x it does not take (another dtype, device or width, a
    gradient wanted, rows no product here covers), which the caller then sends as a usual
    call. In a small model's decode step the lookups and checks of a usual call cost more
    than its product (BENCHMARKS.md, issue 17, session 21)."""

    NEVER = 1 << 62  # min_rows where the packed product is never used

    __slots__ = ("in_features", "packed", "min_rows", "place", "few", "widths")

    def __init__(self, in_features, packed, min_rows, place, few, widths):
        self.in_features = in_features
        self.packed = packed  # _Packed | None
        self.min_rows = min_rows  # rows from which `packed` computes the call
        self.place = place  # int: this layer's output among packed's; None: all of them
        self.few = few  # BoundFewRows | None, for fewer than FEW_ROWS_MAX rows
        self.widths = widths  # out_features of each layer, for splitting few's output

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """x [n, in] -> [[n, out_l] per layer], or None"""
        if (
            x.dtype is not torch.float32
            or x.dim() != 2
            or x.shape[1] != self.in_features
            or x.stride(1) != 1
            or not x.is_cpu
            or x.requires_grad
        ):
            return None
        n = x.shape[0]
        if n >= self.min_rows:
            outs = self.packed(x)
            return outs if self.place is None else [outs[self.place]]
        if self.few is not None and n < FEW_ROWS_MAX:
            y = self.few(x)
            return [y] if len(self.widths) == 1 else list(y.split_with_sizes(self.widths, dim=1))
        return None


def _rows_for(min_rows: int | Callable[[int], int], weights: int) -> int:
    return min_rows(weights) if callable(min_rows) else min_rows


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


def _products(
    base: BaseExecutor, linear: set[int], fuse_siblings: bool
) -> Iterator[tuple[tuple[int, ...], torch.Tensor, torch.Tensor | None]]:
    """(layers, plain [sum_out, in] weight, bias) of each packed product: one per
    `FUSED_SIBLINGS` run of a block (its rows are adjacent there), one per other layer."""
    grouped: set[int] = set()
    for block in base._blocks if fuse_siblings else ():
        if not linear.issuperset(block.layers):
            continue
        names = [base.manifest.layers[i].name.rpartition(".")[2] for i in block.layers]
        for siblings in FUSED_SIBLINGS:
            for first in range(len(names) - len(siblings) + 1):
                if tuple(names[first : first + len(siblings)]) != siblings:
                    continue
                last = first + len(siblings) - 1
                start, end = block.rows[first][0], block.rows[last][1]
                bias = None if block.bias is None else block.bias[start:end]
                layers = block.layers[first : last + 1]
                grouped.update(layers)
                yield layers, block.weight[start:end], bias
    for layer in sorted(linear - grouped):
        w = base._weights[layer]
        yield (layer,), w.weight, w.bias
