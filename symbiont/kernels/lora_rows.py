"""LoRA of tokens each on its own adapter, through symbiont's CPU kernel (`csrc/lora_rows.cpp`).

A serving step whose sequences each use another adapter must read every one's A and B in
every adapted layer, and those bytes bound it. PyTorch's `embedding_bag`, which the
engine used for this (symbiont/serve/adapters.py, `LoraRows`), streamed them at a third
to two thirds of what one core streams; the kernel reads each adapter's rows front to
back, B in blocks of 8 x 8 so that each pass over it is one stream (`block_b`;
BENCHMARKS.md, issue 17, sessions 19 and 20 for what it measured).

Indices are checked once per iteration (`RowsIndex.check`), and each call checks in O(1)
that its tensors have the shapes they were checked against: the kernel trusts its
pointers. Results agree with `embedding_bag`'s within float32 rounding (another summation
order) and do not depend on the thread count. Stacks in bfloat16 (`--lora-dtype bfloat16`)
are read at half the bytes and each weight widened exactly to float32: the sums are the
float32 sums of those weights.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from symbiont.kernels import library

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
RANK_CHUNK = 16  # ranks per chunk of the Aᵀ stack (csrc/lora_rows.cpp)
MAX_CHUNKS = 64  # the kernel's buffer: ranks up to 1024
STACK_DTYPES = (torch.float32, torch.bfloat16)  # bfloat16: widened exactly, summed in float32
B_BLOCK = 8  # B is held in blocks of 8 rows x 8 columns (csrc/lora_rows.cpp)


def block_b(b: torch.Tensor) -> torch.Tensor:
    """B [..., r, out] (r and out multiples of B_BLOCK) as the kernel reads it:
    [..., r / 8, out / 8, 8, 8], block (k, o) holding rows 8k.. and columns 8o.. (a copy)."""
    *lead, r, out = b.shape
    blocks = b.reshape(*lead, r // B_BLOCK, B_BLOCK, out // B_BLOCK, B_BLOCK)
    return blocks.transpose(-3, -2).contiguous()


def unblock_b(blocks: torch.Tensor) -> torch.Tensor:
    """`block_b`'s inverse: [..., r / 8, out / 8, 8, 8] -> B [..., r, out] (a copy)."""
    *lead, rb, ob, _, _ = blocks.shape
    return blocks.transpose(-3, -2).reshape(*lead, rb * B_BLOCK, ob * B_BLOCK)


@dataclass(frozen=True)
class RowsIndex:
    """Rows (token, slot, rank) checked against the shapes of one batch and one stack."""

    tokens: torch.Tensor  # [n_rows] int64, distinct, each < n_tokens
    slots: torch.Tensor  # [n_rows] int64, each < num_slots
    ranks: torch.Tensor  # [n_rows] int64, each <= min(16 * chunks, r_max)
    n_tokens: int
    num_slots: int
    chunks: int
    r_max: int

    @staticmethod
    def check(tokens, slots, ranks, n_tokens, num_slots, chunks, r_max) -> RowsIndex | None:
        """The rows as the kernel takes them (copies: later changes to the arguments do not
        reach them), or None where an index is out of range."""
        given = (tokens, slots, ranks)
        if not (
            all(t.dim() == 1 and t.is_cpu and not t.is_floating_point() for t in given)
            and tokens.shape[0] == slots.shape[0] == ranks.shape[0]
            and 0 < chunks <= MAX_CHUNKS
        ):
            return None
        tokens, slots, ranks = (t.to(torch.int64, copy=True).contiguous() for t in given)
        n = tokens.shape[0]
        if n and not (
            0 <= int(tokens.min()) <= int(tokens.max()) < n_tokens
            and (n == 1 or bool((tokens.diff() > 0).all()))  # distinct: threads split rows
            and 0 <= int(slots.min()) <= int(slots.max()) < num_slots
            and 0 <= int(ranks.min()) <= int(ranks.max()) <= min(RANK_CHUNK * chunks, r_max)
        ):
            return None
        return RowsIndex(tokens, slots, ranks, n_tokens, num_slots, chunks, r_max)


class LoraRowsKernel:
    """`kernel(x, y, index, a_t, b)`: y[t] += x[t] · A[s]ᵀ · B[s]ᵀ for each row of `index`."""

    def __init__(self, lib: ctypes.CDLL):
        self._fns = {torch.float32: lib.lora_rows, torch.bfloat16: lib.lora_rows_bf16}
        for fn in self._fns.values():
            fn.argtypes = [_PTR, _I64, _PTR, _PTR, _PTR, _I64, _PTR, _I64, _I64, _PTR]
            fn.argtypes += [_I64, _I64, _PTR, _I64, ctypes.c_int]
            fn.restype = None

    @staticmethod
    def load() -> LoraRowsKernel | None:
        """The kernel (built on first use), or None where the CPU kernels cannot be built
        (`library.unavailable_reason()` says why)."""
        built = library.load()
        return None if built is None else LoraRowsKernel(built.cdll)

    @staticmethod
    def fits(x: torch.Tensor, y: torch.Tensor, a_t: torch.Tensor, b: torch.Tensor) -> bool:
        """CPU tensors without gradients: x [n, in] and y [n, out] float32 with contiguous
        rows, the stacks Aᵀ [slots, chunks, in, 16] and B in blocks [slots, r_max / 8,
        out / 8, 8, 8] (`block_b`) contiguous, both float32 or both bfloat16."""
        return (
            x.is_cpu
            and y.is_cpu
            and a_t.is_cpu
            and b.is_cpu
            and not (x.requires_grad or y.requires_grad or a_t.requires_grad or b.requires_grad)
            and x.dtype == y.dtype == torch.float32
            and a_t.dtype == b.dtype
            and a_t.dtype in STACK_DTYPES
            and x.dim() == y.dim() == 2
            and a_t.dim() == 4
            and b.dim() == 5
            and b.shape[3:] == (B_BLOCK, B_BLOCK)
            and x.shape[0] == y.shape[0]
            and x.stride(-1) == 1
            and y.stride(-1) == 1
            # y's rows are written from several threads: they may not share memory, with
            # one another (an expanded tensor) or with x
            and (y.shape[0] <= 1 or y.stride(0) >= y.shape[1])
            and x.untyped_storage().data_ptr() != y.untyped_storage().data_ptr()
            and a_t.shape[1] <= MAX_CHUNKS
            and a_t.shape[2:] == (x.shape[1], RANK_CHUNK)
            and b.shape[0] == a_t.shape[0]
            and b.shape[2] * B_BLOCK == y.shape[1]
            and a_t.is_contiguous()
            and b.is_contiguous()
        )

    def __call__(
        self, x: torch.Tensor, y: torch.Tensor, index: RowsIndex, a_t: torch.Tensor, b: torch.Tensor
    ) -> None:
        """Adds each row's LoRA term into y in place. x [n_tokens, in], y [n_tokens, out],
        a_t [slots, chunks, in, 16], b [slots, r_max / 8, out / 8, 8, 8]."""
        if not self.add_if_fits(x, y, index, a_t, b):
            raise ValueError(
                f"LoRA rows: x {tuple(x.shape)}, y {tuple(y.shape)}, Aᵀ {tuple(a_t.shape)}, "
                f"B {tuple(b.shape)} do not match the rows checked for {index.n_tokens} "
                f"tokens, {index.num_slots} slots, {index.chunks} chunks, rank {index.r_max} "
                "(see LoraRowsKernel.fits and RowsIndex.check)"
            )

    def add_if_fits(
        self, x: torch.Tensor, y: torch.Tensor, index: RowsIndex, a_t: torch.Tensor, b: torch.Tensor
    ) -> bool:
        """`__call__` where the tensors fit and match the rows checked (one check, for the
        engine's every layer); False, y untouched, where they do not."""
        if not (
            x.shape[0] == index.n_tokens
            and a_t.shape[:2] == (index.num_slots, index.chunks)
            and b.shape[1] * B_BLOCK == index.r_max
            and self.fits(x, y, a_t, b)
        ):
            return False
        n_rows = index.tokens.shape[0]
        if n_rows and y.shape[1]:
            self._fns[a_t.dtype](
                x.data_ptr(), x.stride(0),
                index.tokens.data_ptr(), index.slots.data_ptr(), index.ranks.data_ptr(), n_rows,
                a_t.data_ptr(), a_t.shape[1], x.shape[1],
                b.data_ptr(), index.r_max, y.shape[1],
                y.data_ptr(), y.stride(0), torch.get_num_threads(),
            )  # fmt: skip
        return True
