"""Decode and prefill-chunk attention of our own on a CPU, built once with the machine's
C++ compiler.

PyTorch's CPU `scaled_dot_product_attention` runs a decode step (one query per sequence)
through its flash kernel, which handles each (sequence, head) as a tiny matrix product
and reads K/V at about half the bandwidth a plain stream gets (BENCHMARKS.md, issue 17,
session 13). `symbiont/kernels/csrc/decode_attention.cpp` does the same math as one loop per (sequence,
KV head): it reads each K and V row once for all the query heads that share it, and keeps
its accumulators in registers. One layer's decode attention ran 1.8-2.8x faster than
SDPA on one core and 1.8-3.3x on two (`python benchmarks/decode_attention.py --layers 8`).

The kernels are C++ without PyTorch headers in symbiont's CPU kernel library
(symbiont/kernels/: `csrc/decode_attention.cpp` and `csrc/chunk_attention.cpp`, built once
with the machine's compiler, cached under `$SYMBIONT_HOME/kernels`, called through
`ctypes`, which releases the GIL), on the threads of torch's own OpenMP runtime.

A prefill chunk (`DecodeKernel.chunk`, `kernels/csrc/chunk_attention.cpp`) attends through the
same library: tiles of 32 queries (16 without AVX-512) of one head work through their keys
64 at a time with scores and output held keys- and dims-by-queries, so the online softmax
is element-wise across vectors; causal and window limits are computed, not read from a
mask. A chunk's attention ran 2.0-2.5x faster than SDPA's (in blocks of
queries) on one core (BENCHMARKS.md, issue 17, session 17).

Where it cannot be built (no compiler, a compiler too old for `__builtin_shufflevector`:
GCC 12 or clang), `load()` returns None and says why in `unavailable_reason()`; the engine
then uses SDPA, as it does for anything the kernel does not cover (not float32, not on a
CPU, soft-capped logits). `symbiont serve --no-decode-kernel` always uses SDPA. Results
agree with SDPA within float32 rounding, not bit for bit (another summation order, and a
polynomial exp good to about 1 ulp).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from symbiont.kernels import library


class DecodeKernel:
    """`kernel(q, k, v, mask, scale)`: softmax(q kᵀ · scale + mask) v for one query per
    sequence, where `applies` says the tensors fit it."""

    def __init__(self, lib: ctypes.CDLL, path: Path):
        self.path = path
        self.lib = lib  # also holds the kernels of layer_ops.py
        self._fn = lib.decode_attention
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self._fn.argtypes = [ptr, i64, i64, i64] * 3 + [ptr, i64, ptr] + [i64] * 5
        self._fn.argtypes += [ctypes.c_float, ptr, ctypes.c_int]
        self._fn.restype = None
        self._chunk = lib.chunk_attention
        self._chunk.argtypes = [ptr, i64, i64] * 4 + [i64] * 6 + [ctypes.c_float, ptr, ctypes.c_int]
        self._chunk.restype = ctypes.c_int
        self._chunk_scratch = lib.chunk_attention_scratch
        self._chunk_scratch.argtypes = [i64]
        self._chunk_scratch.restype = i64

    @staticmethod
    def applies(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor) -> bool:
        """Whether the kernel computes this call: float32 on a CPU, head dims contiguous,
        no gradient wanted (the kernel has no backward)."""
        return (
            q.device.type == "cpu"
            and q.dtype == k.dtype == mask.dtype == torch.float32
            and q.stride(-1) == 1
            and k.stride(-1) == 1
            and not (q.requires_grad or k.requires_grad)
        )

    def __call__(
        self,
        q: torch.Tensor,  # [n, kv_heads, share, hd]: query heads grouped by their KV head
        k: torch.Tensor,  # [n, kv_heads, L, hd], any strides but the last
        v: torch.Tensor,  # [n, kv_heads, L, hd], any strides but the last
        mask: torch.Tensor,  # [n, 1, 1, L] additive: 0 or -inf
        scale: float,
    ) -> torch.Tensor:  # [n, kv_heads, share, hd]
        n, kv_heads, share, hd = q.shape
        width = k.shape[2]
        if k.shape != (n, kv_heads, width, hd) or v.shape != k.shape:
            raise ValueError(
                f"decode kernel: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
            )
        if v.stride(-1) != 1:
            v = v.contiguous()
        rows = mask.reshape(n, width)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        threads = max(1, torch.get_num_threads())
        out = q.new_empty(n, kv_heads, share, hd)
        scratch = q.new_empty(threads * share * ((width + 15) // 16 * 16))  # rows of whole vectors
        self._fn(
            q.data_ptr(), *q.stride()[:3],
            k.data_ptr(), *k.stride()[:3],
            v.data_ptr(), *v.stride()[:3],
            rows.data_ptr(), rows.stride(0),
            out.data_ptr(), n, kv_heads, share, width, hd,
            scale, scratch.data_ptr(), threads,
        )  # fmt: skip
        return out

    @staticmethod
    def chunk_applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
        """Whether `chunk` computes this call: float32 on a CPU, head dims contiguous and
        a multiple of 8, no gradient wanted (the kernel has no backward)."""
        return (
            q.device.type == "cpu"
            and q.dtype == k.dtype == v.dtype == torch.float32
            and q.shape[-1] % 8 == 0
            and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
            and not (q.requires_grad or k.requires_grad or v.requires_grad)
        )

    def chunk(
        self,
        q: torch.Tensor,  # [heads, m, hd]: one prefill chunk's queries
        k: torch.Tensor,  # [kv_heads, >= start + m, hd]: its context, then its own keys
        v: torch.Tensor,  # [kv_heads, >= start + m, hd]
        start: int,  # position of the chunk's first query
        window: int | None,  # sliding window: a query sees keys after its position - window
        scale: float,
    ) -> torch.Tensor:  # [m, heads, hd]
        """Causal attention of one chunk: query i (position start + i) attends keys
        j <= start + i (and j > start + i - window)."""
        heads, m, hd = q.shape
        kv_heads = k.shape[0]
        if window is not None and window < 1:  # the engine's mask would hide every key
            raise ValueError(f"chunk kernel: sliding window {window}; it must be at least 1")
        if (
            k.shape[1] < start + m
            or v.shape[:2] != k.shape[:2]
            or k.shape[2] != hd
            or v.shape[2] != hd
            or heads % kv_heads
        ):
            raise ValueError(
                f"chunk kernel: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                f"start {start}"
            )
        threads = max(1, torch.get_num_threads())
        out = q.new_empty(m, heads, hd)
        scratch = q.new_empty(threads * self._chunk_scratch(hd))
        failed = self._chunk(
            q.data_ptr(), *q.stride()[:2],
            k.data_ptr(), *k.stride()[:2],
            v.data_ptr(), *v.stride()[:2],
            out.data_ptr(), *out.stride()[:2],
            heads, kv_heads, m, hd, start, window or 0,
            scale, scratch.data_ptr(), threads,
        )  # fmt: skip
        if failed:
            raise ValueError(f"chunk kernel: head_dim {hd} is no multiple of 8")
        return out


def load() -> DecodeKernel | None:
    """The kernels, built on the first call of this process (cached on disk), or None
    where they cannot be built: `unavailable_reason()` then says why."""
    built = library.load()
    return None if built is None else _kernel_of(built)


def unavailable_reason() -> str | None:
    """Why `load()` returned None (None when it returned the kernels or was not called)."""
    return library.unavailable_reason()


@functools.cache
def _kernel_of(built: library.Library) -> DecodeKernel:
    return DecodeKernel(built.cdll, built.path)
