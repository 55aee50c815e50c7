"""RMSNorm (with the residual add before it) and rotary embedding in one pass each, on a
CPU in float32.

The lean forward (lean.py) runs a Llama-shaped layer's norms and rotary embedding through
these where they apply. PyTorch runs each as several operations: its CPU RMSNorm is six
(square, mean, add, rsqrt, two multiplies), rotary embedding of queries and keys seven.
In a small model's decode step each operation's dispatch costs more than its arithmetic,
and on a long prefill chunk each pass reads and writes the whole activation again.
`kernels/csrc/layer_ops.cpp` is part of symbiont's CPU kernel library, with the attention
kernels (symbiont/kernels/library.py: compiled once with the machine's C++ compiler,
cached, loaded only from this user's own folders), and called through `ctypes`, which
releases the GIL. Where it cannot be built, the lean forward uses PyTorch's operations.

Results: rotary embedding and the residual add are bitwise transformers' (the same
multiplies and adds, never fused into one multiply-add); RMSNorm sums its squares in
another order, so it agrees with PyTorch within float32 rounding, not bit for bit
(`tests/test_layer_ops.py`). A fused SiLU-and-multiply was measured and left out: with its
own exp it was 1.3x slower than PyTorch's two operations.
"""

from __future__ import annotations

import ctypes

import torch

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


class LayerOps:
    """The kernels of one loaded library; `fits(...)` says which tensors they take."""

    def __init__(self, lib: ctypes.CDLL):
        self._rms_norm = lib.rms_norm
        self._rms_norm.argtypes = [_PTR, _I64] * 3 + [_PTR, _PTR, _I64, _I64, _I64]
        self._rms_norm.argtypes += [ctypes.c_float, ctypes.c_int]
        self._rotary = lib.rotary
        self._rotary.argtypes = [_PTR, _I64, _I64, _I64] * 2 + [_PTR, _PTR, _I64]
        self._rotary.argtypes += [_PTR, _I64, _I64, ctypes.c_int]
        for fn in (self._rms_norm, self._rotary):
            fn.restype = None

    @staticmethod
    def norm_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether `rms_norm` takes these (float32 CPU rows, one weight per column)."""
        return LayerOps.fits(x, weight) and weight.dim() == 1 and weight.numel() == x.shape[-1]

    @staticmethod
    def rotary_fits(q, k, cos, sin, heads: int, kv_heads: int, head_dim: int) -> bool:
        """Whether `rotary` takes these: q and k rows of whole heads, cos and sin one
        `head_dim` row per token with the same strides, an even head dim. Anything else
        (partial rotary, odd head dims) is left to PyTorch, which raises as transformers
        does where the shapes do not broadcast."""
        return (
            LayerOps.fits(q, k, cos, sin)
            and head_dim % 2 == 0
            and cos.shape == sin.shape == (1, q.shape[1], head_dim)
            and cos.stride() == sin.stride()
            and q.shape[-1] == heads * head_dim
            and k.shape[-1] == kv_heads * head_dim
            and k.shape[1] == q.shape[1]
        )

    @staticmethod
    def fits(*tensors: torch.Tensor) -> bool:
        """float32 on a CPU with the last dimension contiguous, every one of them."""
        for t in tensors:  # a loop, not all(...): this runs a few times per layer and step
            if t.dtype != torch.float32 or not t.is_cpu or t.stride(-1) != 1:
                return False
        return True

    def rms_norm(
        self,
        x: torch.Tensor,  # [1, n, dim]
        weight: torch.Tensor,  # [dim]
        eps: float,
        residual: torch.Tensor | None = None,  # [1, n, dim]: normalise x + residual
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (x + residual, or x itself without one; its RMSNorm), each [1, n, dim]."""
        _, n, dim = x.shape
        out = x.new_empty(1, n, dim)  # float32 on the CPU, whatever torch's defaults
        h = x if residual is None else x.new_empty(1, n, dim)
        res = residual if residual is not None else x  # a pointer the kernel ignores
        self._rms_norm(
            x.data_ptr(), x.stride(1),
            res.data_ptr() if residual is not None else None, res.stride(1),
            h.data_ptr() if residual is not None else None, h.stride(1),
            weight.data_ptr(), out.data_ptr(), out.stride(1),
            n, dim, eps, torch.get_num_threads(),
        )  # fmt: skip
        return h, out

    def rotary(
        self,
        q: torch.Tensor,  # [1, n, heads * hd]: a projection's output
        k: torch.Tensor,  # [1, n, kv_heads * hd]
        cos: torch.Tensor,  # [1, n, hd]
        sin: torch.Tensor,  # [1, n, hd]
        heads: int,
        kv_heads: int,
    ) -> torch.Tensor:  # [1, heads + kv_heads, n, hd] contiguous
        """transformers' `x * cos + rotate_half(x) * sin` of the query and key heads."""
        _, n, hd = cos.shape
        out = q.new_empty(1, heads + kv_heads, n, hd)
        self._rotary(
            q.data_ptr(), q.stride(1), hd, heads,
            k.data_ptr(), k.stride(1), hd, kv_heads,
            cos.data_ptr(), sin.data_ptr(), cos.stride(1),
            out.data_ptr(), n, hd, torch.get_num_threads(),
        )  # fmt: skip
        return out
