"""The per-layer solver: a linear layer's delta made 2:4 sparse and 2- or 4-bit.

Given `Δ = W_ft - W_base` ([out, in]) and the Hessian `H = X Xᵀ / n` of the layer's
calibration inputs ([in, in]), find a sparse, quantised `Δ̃` minimising
`‖Δ X - Δ̃ X‖²` (DeltaZip eq. 1). The optimal-brain-surgeon sweep of SparseGPT/GPTQ: walk
the input columns left to right, fix each column to its quantised (or pruned) value and
spread the error over the columns not yet fixed through the inverse Hessian's Cholesky
factor, in blocks of `block_size` columns whose updates to the rest are applied lazily.
The 2:4 mask is chosen inside the sweep, every 4 columns, by the OBS saliency
`w² / [H⁻¹]_jj²` of the weights as updated so far.

Quantisation is asymmetric min-max over a group of columns of one row (or the whole row):
`value = scale · (code - zero)` with `code` in [0, 2^bits), an integer `zero` (so a pruned
weight, 0, is exactly representable) and `scale` rounded to bfloat16 before use, so the
packed format reproduces the solver's values bit for bit.

`round_to_nearest` is the baseline of the same format: magnitude 2:4 mask, codes rounded
independently, no error feedback.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from symbiont.delta.config import CompressConfig, Sparsity

SCALE_DTYPE = torch.bfloat16  # bf16 keeps tiny delta scales out of fp16's subnormal range


@dataclass(frozen=True)
class QuantizedLayer:
    """A solved layer in dense form (what `packing` stores compactly)."""

    codes: torch.Tensor  # [out, in] uint8 in [0, 2^bits); pruned positions hold `zero`
    kept: torch.Tensor  # [out, in] bool: True where the value is stored (all True if dense)
    scale: torch.Tensor  # [out, groups] bfloat16
    zero: torch.Tensor  # [out, groups] uint8
    bits: int
    group_size: int  # 0: one group per row

    def dense(self) -> torch.Tensor:
        """Δ̃ as fp32 [out, in]: zeros where pruned."""
        return dequantize(self.codes, self.kept, self.scale, self.zero, self.group_size)


def dequantize(
    codes: torch.Tensor,
    kept: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    group_size: int,
) -> torch.Tensor:
    """fp32 [out, in] from codes [out, in] and per-group scale/zero [out, groups]."""
    columns = codes.shape[1]
    scale_cols = _per_column(scale.float(), group_size, columns)
    zero_cols = _per_column(zero.float(), group_size, columns)
    values = scale_cols * (codes.float() - zero_cols)
    return torch.where(kept, values, torch.zeros((), dtype=values.dtype))


def _per_column(per_group: torch.Tensor, group_size: int, columns: int) -> torch.Tensor:
    """[out, groups] -> [out, columns]: each column gets its group's value."""
    if group_size == 0:
        return per_group.expand(-1, columns)
    return per_group.repeat_interleave(group_size, dim=1)[:, :columns]


def group_count(columns: int, group_size: int) -> int:
    return 1 if group_size == 0 else -(-columns // group_size)


def quant_params(w: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric min-max grid of each row of w [out, n] -> scale [out] (bf16), zero [out]."""
    maxq = 2**bits - 1
    low = w.min(dim=1).values.clamp(max=0)  # the range always holds 0 (pruned weights)
    high = w.max(dim=1).values.clamp(min=0)
    empty = (low == 0) & (high == 0)
    low, high = torch.where(empty, -1.0, low), torch.where(empty, 1.0, high)
    scale = ((high - low) / maxq).to(SCALE_DTYPE)
    scale = torch.where(scale.float() > 0, scale, torch.finfo(SCALE_DTYPE).tiny)
    zero = torch.round(-low / scale.float()).clamp(0, maxq)
    return scale, zero.to(torch.uint8)


def quantize_codes(
    w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int
) -> torch.Tensor:
    """Codes of w [out, k] on the grid of scale/zero [out, 1] (or broadcastable)."""
    maxq = 2**bits - 1
    return torch.clamp(torch.round(w / scale.float()) + zero.float(), 0, maxq)


def values_of(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """The same float ops as `dequantize`, so solver and unpacked values agree exactly."""
    return scale.float() * (codes - zero.float())


def solve_obs(delta: torch.Tensor, hessian: torch.Tensor, config: CompressConfig) -> QuantizedLayer:
    """Δ [out, in] and H [in, in] -> the OBS-optimal sparse quantised Δ̃."""
    rows, columns = delta.shape
    _check_columns(columns, config)
    w = delta.detach().float().clone()
    hinv = _inverse_hessian_factor(hessian, w, config.damp)  # [in, in] upper Cholesky of H⁻¹
    with one_thread():
        state = _SweepState.start(w, config)
    for start in range(0, columns, config.block_size):
        end = min(start + config.block_size, columns)
        with one_thread():
            errors = _solve_block(w, hinv, start, end, state, config)  # [out, end - start]
        w[:, end:] -= errors @ hinv[start:end, end:]  # the lazy update of later columns
    return state.result(config)


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """The column sweep is hundreds of tiny ops per block: waking a thread pool for each
    costs more than the op (10-30x slower on busy cores), so it runs on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def round_to_nearest(delta: torch.Tensor, config: CompressConfig) -> QuantizedLayer:
    """The same format without calibration: magnitude 2:4 mask, independent rounding."""
    rows, columns = delta.shape
    _check_columns(columns, config)
    w = delta.detach().float()
    kept = torch.ones_like(w, dtype=torch.bool)
    if config.sparsity == Sparsity.TWO_FOUR:
        kept = _two_four_mask(w.abs())
    groups = group_count(columns, config.group_size)
    scale = torch.empty(rows, groups, dtype=SCALE_DTYPE)
    zero = torch.empty(rows, groups, dtype=torch.uint8)
    codes = torch.empty(rows, columns, dtype=torch.uint8)
    width = config.group_size or columns
    for g in range(groups):
        cols = slice(g * width, (g + 1) * width)
        s, z = quant_params(w[:, cols], config.bits)
        scale[:, g], zero[:, g] = s, z
        group_codes = quantize_codes(w[:, cols], s[:, None], z[:, None], config.bits)
        codes[:, cols] = torch.where(kept[:, cols], group_codes, z[:, None].float()).to(torch.uint8)
    return QuantizedLayer(codes, kept, scale, zero, config.bits, config.group_size)


def _check_columns(columns: int, config: CompressConfig) -> None:
    if config.sparsity == Sparsity.TWO_FOUR and columns % 4:
        raise ValueError(
            f"2:4 sparsity needs a multiple of 4 input columns, this layer has {columns}; "
            "use --sparsity none"
        )


def _two_four_mask(saliency: torch.Tensor) -> torch.Tensor:
    """[out, 4k] saliency -> bool mask keeping the 2 most salient of every 4 columns."""
    rows, columns = saliency.shape
    grouped = saliency.reshape(rows, columns // 4, 4)
    top = grouped.topk(2, dim=2).indices
    kept = torch.zeros_like(grouped, dtype=torch.bool).scatter_(2, top, True)
    return kept.reshape(rows, columns)


def _inverse_hessian_factor(hessian: torch.Tensor, w: torch.Tensor, damp: float) -> torch.Tensor:
    """Upper Cholesky factor of (H + λI)⁻¹, λ = damp · mean diag(H).

    Inputs that are always zero on the calibration data (a dead column) carry no
    information: their H diagonal is set to 1 and their delta to 0, as GPTQ does."""
    h = hessian.detach().float().clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    h.diagonal().add_(damp * torch.mean(torch.diag(h)))
    try:
        lower = torch.linalg.cholesky(h)
        inverse = torch.cholesky_inverse(lower)
        return torch.linalg.cholesky(inverse, upper=True)
    except torch.linalg.LinAlgError as err:
        raise ValueError(
            f"the calibration Hessian is not positive definite even with damping {damp}; "
            "raise --damp or give more calibration text (--calib, --calib-samples)"
        ) from err


@dataclass
class _SweepState:
    """What the column sweep has fixed so far."""

    codes: torch.Tensor  # [out, in] uint8
    kept: torch.Tensor  # [out, in] bool
    scale: torch.Tensor  # [out, groups] bf16
    zero: torch.Tensor  # [out, groups] uint8
    row_scale: torch.Tensor | None  # [out] bf16 while a group is open
    row_zero: torch.Tensor | None

    @classmethod
    def start(cls, w: torch.Tensor, config: CompressConfig) -> _SweepState:
        rows, columns = w.shape
        groups = group_count(columns, config.group_size)
        state = cls(
            torch.empty(rows, columns, dtype=torch.uint8),
            torch.ones(rows, columns, dtype=torch.bool),
            torch.empty(rows, groups, dtype=SCALE_DTYPE),
            torch.empty(rows, groups, dtype=torch.uint8),
            None,
            None,
        )
        if config.group_size == 0:  # per row: the grid of the whole (unupdated) row, as GPTQ
            state.open_group(0, w, config)
        return state

    def open_group(self, group: int, w_group: torch.Tensor, config: CompressConfig) -> None:
        self.row_scale, self.row_zero = quant_params(w_group, config.bits)
        self.scale[:, group], self.zero[:, group] = self.row_scale, self.row_zero

    def result(self, config: CompressConfig) -> QuantizedLayer:
        return QuantizedLayer(
            self.codes, self.kept, self.scale, self.zero, config.bits, config.group_size
        )


def _solve_block(
    w: torch.Tensor,
    hinv: torch.Tensor,
    start: int,
    end: int,
    state: _SweepState,
    config: CompressConfig,
) -> torch.Tensor:
    """Fix columns [start, end) of w in place; returns the scaled errors [out, end-start]."""
    block = w[:, start:end].clone()  # [out, count], updated as columns are fixed
    h_block = hinv[start:end, start:end]
    errors = torch.zeros_like(block)
    two_four = config.sparsity == Sparsity.TWO_FOUR
    for i in range(end - start):
        column = start + i
        if config.group_size and column % config.group_size == 0:
            state.open_group(
                column // config.group_size, w_group_of(w, block, start, column, config), config
            )
        if two_four and i % 4 == 0:  # choose this quad's mask from the weights updated so far
            saliency = block[:, i : i + 4] ** 2 / torch.diag(h_block)[i : i + 4] ** 2
            state.kept[:, column : column + 4] = _two_four_mask(saliency)
        kept = state.kept[:, column]
        scale, zero = state.row_scale, state.row_zero
        codes = quantize_codes(block[:, i], scale, zero, config.bits)
        codes = torch.where(kept, codes, zero.float())  # pruned: the code of exactly 0
        state.codes[:, column] = codes.to(torch.uint8)
        fixed = values_of(codes, scale, zero)
        error = (block[:, i] - fixed) / h_block[i, i]
        block[:, i:] -= error[:, None] * h_block[i, i:][None, :]
        errors[:, i] = error
    w[:, start:end] = block
    return errors


def w_group_of(
    w: torch.Tensor, block: torch.Tensor, start: int, column: int, config: CompressConfig
) -> torch.Tensor:
    """The current (error-updated) weights of the group that begins at `column`.

    Columns inside the block are read from `block` (updated in this block's sweep), the
    rest of the group from `w` (updated by the lazy block updates)."""
    end = column + config.group_size
    inside = block[:, column - start : end - start]
    beyond = w[:, start + block.shape[1] : end] if end > start + block.shape[1] else None
    return inside if beyond is None else torch.cat([inside, beyond], dim=1)
