"""Base products computed by oneDNN on the plain weights (`serve-base --matmul onednn`).

`F.linear` and `mm` on a CPU call MKL's sgemm. On the AMD EPYC (AVX-512) machines these
benchmarks ran on, sgemm reached about 100 GFLOP/s on one core for the products of a
fine-tuning step (64-256 rows), while oneDNN's linear on the very same weights, with no
copy and no repacking, reached 150-240 GFLOP/s, 1.7-2.5x MKL's (`python
benchmarks/onednn_matmul.py`). Probably MKL takes a generic code path on a CPU it does
not tune for, while oneDNN generates its kernels for the CPU it finds. Forward calls
(`x Wᵀ + b`) and backward calls (`grad_y W`, oneDNN's linear on the weight's transposed
view) of ONEDNN_MIN_ROWS rows and ONEDNN_MIN_MACS multiply-adds or more run there; smaller
ones stay torch's (at one row oneDNN was 0.34-1.5x torch's, and small layers lose to its
fixed costs), or, where symbiont's CPU kernels are built, forward calls of fewer than 8
rows go to its few-rows kernel (symbiont/kernels/few_rows.py; serving clients decode a row
per sequence). Unlike packed weights (`symbiont/base/prepack.py`) this serves
fine-tuning, and it costs no memory.

Results agree with torch's within fp32 rounding (another summation order), not bit for
bit, so a job through such an executor computes what a vanilla job computes within that
rounding, not exactly; `--matmul torch` (the default) keeps every product bitwise the
vanilla one. Where MKL is tuned for the CPU the two may be about as fast: measure
(`benchmarks/onednn_matmul.py` prints the ratio) before choosing.
"""

from __future__ import annotations

import torch

from symbiont.base.executor import FEW_ROWS_MAX, BaseExecutor, FewRowsProduct
from symbiont.model.layers import LayerKind
from symbiont.protocol.executor import Op

MATMULS = ("torch", "onednn")
# Calls of fewer rows stay torch's: at one row oneDNN was 0.34-1.5x torch's (a backward on
# the transposed view the slowest), from 8 rows 1.05-3.1x (benchmarks/onednn_matmul.py)
ONEDNN_MIN_ROWS = 8
# ...and fewer rows than that go to the few-rows kernel where it is given
assert FEW_ROWS_MAX == ONEDNN_MIN_ROWS, "the few-rows kernel takes what oneDNN leaves"
# ...and products of fewer multiply-adds (rows x weights) stay torch's too: for small layers
# oneDNN's fixed cost per call, and about 0.3 ms to build its kernel for each new shape
# (fine-tuning batches change length), outweigh its gain (128x128 weights: 0.5x at 16
# rows, 1.1x at 64, 1.75x at 256; 768x768: 1.7x at 16)
ONEDNN_MIN_MACS = 1 << 21


def can_use_onednn(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether oneDNN computes this placement's products: float32 on a CPU with oneDNN."""
    return (
        torch.device(device).type == "cpu"
        and dtype == torch.float32
        and torch.backends.mkldnn.is_available()
    )


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """x Wᵀ + b by oneDNN. x [n, in], weight [out, in] (any strides) -> [n, out]"""
    if bias is not None:
        bias = bias.contiguous()  # oneDNN reads a strided bias as if it were contiguous
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")


class OneDnnExecutor(BaseExecutor):
    """A `BaseExecutor` whose linear products (forward and backward) run on oneDNN.

    Takes over `base`'s tensors as they are: no copy, no new layout. Experts stacks (MoE)
    still run the model's own expert modules, on torch."""

    products = "onednn"

    def __init__(self, base: BaseExecutor, few_rows: FewRowsProduct | None = None):
        """few_rows: computes forward calls of fewer than FEW_ROWS_MAX (= ONEDNN_MIN_ROWS)
        rows of LINEAR layers instead of torch (symbiont/kernels/few_rows.py: MKL's
        products of a few rows are slow on AMD EPYC)."""
        if not can_use_onednn(base.device, base.manifest.dtype):
            dtype = str(base.manifest.dtype).removeprefix("torch.")
            raise ValueError(
                f"--matmul onednn computes float32 on a CPU with oneDNN, not {dtype} on "
                f"{base.device}; use --matmul torch (or --dtype float32 on the CPU)"
            )
        super().__init__(base.manifest, base._weights, base.device, base._experts, base._blocks)
        self.few_rows = few_rows

    def run(self, op: Op, layer: int, x: torch.Tensor) -> torch.Tensor:
        w = self._weights[layer]
        if not _pays(x.shape[0], w.weight.numel()):
            few = op is Op.FORWARD and w.kind is LayerKind.LINEAR
            if few and self._few_rows_fit(x, w.weight, w.bias):
                return self.few_rows(x, w.weight, w.bias)
            return super().run(op, layer, x)
        if op is Op.FORWARD:  # LINEAR: x Wᵀ + b; CONV1D (weight [in, out]): x W + b
            weight = w.weight if w.kind is LayerKind.LINEAR else w.weight.t()
            return onednn_linear(x, weight, w.bias)
        # grad_x = grad_y W (LINEAR) or grad_y Wᵀ (CONV1D): a linear on the other layout
        weight = w.weight.t() if w.kind is LayerKind.LINEAR else w.weight
        return onednn_linear(x, weight, None)

    splits = True

    def column_blocks(self, op: Op, layers: tuple[int, ...]) -> str | None:
        """ "rows" where the output's columns are rows of the stored weight (a forward of
        LINEAR layers or of a run of one block, a backward of a CONV1D layer), "columns"
        where they are its columns (the other single layers), None for fused layers that
        are not one block."""
        if len(layers) > 1:
            return "rows" if layers in self._runs else None
        linear = self._weights[layers[0]].kind is LayerKind.LINEAR
        return "rows" if linear is (op is Op.FORWARD) else "columns"

    def run_columns(
        self, op: Op, layers: tuple[int, ...], x: torch.Tensor, start: int, end: int
    ) -> torch.Tensor:
        """Columns [start, end) of one (already validated) call's output, as `run` (one
        layer) or `run_fused` (a run of layers, their outputs side by side) computes it,
        for calls `column_blocks` takes: a lone client's large products are split this
        way over serve-base's idle workers (symbiont/base/server.py).
        x [n, in] for FORWARD, [n, out] for BACKWARD -> [n, end - start]"""
        if len(layers) > 1:
            run = self._runs[layers]
            weight, bias = run.weight[start:end], _rows(run.bias, start, end)
        else:
            w = self._weights[layers[0]]
            rows = self.column_blocks(op, layers) == "rows"
            # LINEAR's weight is [out, in], CONV1D's [in, out]: forward uses it as [out, in]
            weight = w.weight[start:end] if rows else w.weight[:, start:end].t()
            bias = _rows(w.bias, start, end) if op is Op.FORWARD else None
        if weight.stride(-1) != 1:
            # A strided block of the weight's columns: oneDNN takes its reference path
            # there (~700x slower than the whole weight), torch's product does not
            return torch.nn.functional.linear(x, weight, bias)
        if op is Op.FORWARD and self._few_rows_fit(x, weight, bias):
            return self.few_rows(x, weight, bias)
        if _pays(x.shape[0], weight.numel()):
            return onednn_linear(x, weight, bias)
        return torch.nn.functional.linear(x, weight, bias)

    def run_fused(self, layers: tuple[int, ...], x: torch.Tensor) -> list[torch.Tensor]:
        run = self._runs.get(layers)
        if run is not None and self._few_rows_fit(x, run.weight, run.bias):
            return self.few_rows(x, run.weight, run.bias).split_with_sizes(run.widths, dim=1)
        if run is None or not _pays(x.shape[0], run.weight.numel()):
            return super().run_fused(layers, x)
        y = onednn_linear(x, run.weight, run.bias)  # [n_tokens, sum_out]
        return y.split_with_sizes(run.widths, dim=1)  # views, one per layer


def _rows(bias: torch.Tensor | None, start: int, end: int) -> torch.Tensor | None:
    return None if bias is None else bias[start:end]


def _pays(rows: int, weights: int) -> bool:
    """Whether oneDNN computes a call of `rows` rows on a layer of `weights` weights."""
    return rows >= ONEDNN_MIN_ROWS and rows * weights >= ONEDNN_MIN_MACS
