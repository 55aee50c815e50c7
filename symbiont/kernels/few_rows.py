"""Base products of a few rows through symbiont's CPU kernel (`csrc/few_rows.cpp`).

A decode step with one to a few sequences multiplies a few rows by each base weight.
PyTorch sends those products to MKL, which on AMD EPYC runs a generic code path
(`mkl_blas_def_xsgemv`, 35% of a one-sequence decode step of the 4.0M-parameter model in a
`perf` profile). oneDNN's packed products, which the serving executor uses from a few rows
on (symbiont/base/prepack.py), cost about 12 µs more per call than a plain one. This
kernel streams the checkpoint's own `[out, in]` rows once for all the rows of x (up to 2
with every sum in registers, more in chunks of columns kept in L1) (BENCHMARKS.md, issue 17, session 18 for what it measured).

It is part of symbiont's CPU kernel library (library.py: compiled once with the machine's
C++ compiler, cached, loaded only from this user's own folders), called through `ctypes`,
which releases the GIL. Results agree with `F.linear` within float32 rounding (another
summation order), not bit for bit, and do not depend on the thread count.
"""

from __future__ import annotations

import ctypes

import torch

from symbiont.kernels import library

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


def _in_bounds(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """What keeps the kernel's reads and writes inside the tensors (`fits` checks more:
    the device, gradients)."""
    return (
        x.dtype == weight.dtype == torch.float32
        and x.dim() == weight.dim() == 2
        and x.shape[1] == weight.shape[1]
        and x.stride(-1) == 1
        and weight.stride(-1) == 1
        and (
            bias is None
            or (
                bias.dtype == torch.float32
                and bias.shape == (weight.shape[0],)
                and bias.is_contiguous()
            )
        )
    )


class FewRows:
    """`few_rows(x, weight, bias)`: `F.linear(x, weight, bias)` for float32 CPU tensors
    that `fits` takes."""

    def __init__(self, lib: ctypes.CDLL):
        self._fn = lib.few_rows_linear
        self._fn.argtypes = [_PTR, _I64, _I64, _PTR, _I64, _I64, _I64, _PTR, _PTR, _I64]
        self._fn.argtypes += [ctypes.c_int]
        self._fn.restype = None

    @staticmethod
    def load() -> FewRows | None:
        """The kernel (built on first use), or None where the CPU kernels cannot be built
        (`library.unavailable_reason()` says why)."""
        built = library.load()
        return None if built is None else FewRows(built.cdll)

    @staticmethod
    def fits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        """x [n, in] and weight [out, in] float32 on the CPU with contiguous rows, bias
        None or [out] contiguous, no gradient wanted (the kernel has no backward)."""
        return (
            x.dim() == 2
            and weight.dim() == 2
            and x.dtype == weight.dtype == torch.float32
            and x.is_cpu
            and weight.is_cpu
            and x.stride(-1) == 1
            and weight.stride(-1) == 1
            and x.shape[1] == weight.shape[1]
            and (bias is None or FewRows._bias_fits(bias, weight.shape[0]))
            and not (x.requires_grad or weight.requires_grad)
        )

    def bound(self, weight: torch.Tensor, bias: torch.Tensor | None) -> BoundFewRows | None:
        """The product by this one weight, for callers that check x themselves (None where
        `fits` would refuse the weight or bias whatever x)."""
        if not (
            weight.dim() == 2
            and weight.dtype == torch.float32
            and weight.is_cpu
            and weight.stride(-1) == 1
            and not weight.requires_grad
            and (bias is None or FewRows._bias_fits(bias, weight.shape[0]))
        ):
            return None
        return BoundFewRows(self._fn, weight, bias)

    @staticmethod
    def _bias_fits(bias: torch.Tensor, out_features: int) -> bool:
        return (
            bias.dtype == torch.float32
            and bias.is_cpu
            and bias.shape == (out_features,)
            and bias.is_contiguous()
            and not bias.requires_grad
        )

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x [n, in], weight [out, in], bias [out] -> [n, out]"""
        if not _in_bounds(x, weight, bias):  # the kernel trusts its pointers
            raise ValueError(
                f"few-rows product: x {tuple(x.shape)} {x.dtype}, weight "
                f"{tuple(weight.shape)} {weight.dtype}, bias "
                f"{None if bias is None else (tuple(bias.shape), bias.dtype)}: it takes "
                "float32 CPU rows [n, in] and [out, in] with contiguous rows, a contiguous "
                "[out] bias, no gradient (see FewRows.fits)"
            )
        (n, width), out_features = x.shape, weight.shape[0]
        y = x.new_empty(n, out_features)
        if n and out_features:
            self._fn(
                x.data_ptr(), x.stride(0), n,
                weight.data_ptr(), weight.stride(0), width, out_features,
                None if bias is None else bias.data_ptr(),
                y.data_ptr(), y.stride(0), torch.get_num_threads(),
            )  # fmt: skip
        return y


class BoundFewRows:
    """`F.linear(x, weight, bias)` by the few-rows kernel for one weight, whose checks and
    pointers were taken once: x [n, in] must be float32 CPU rows with stride(-1) 1 and
    `in` columns, which the caller checks (`PrepackedExecutor.direct_product`). It holds
    the weight and bias, so their pointers stay valid."""

    __slots__ = ("_fn", "_weight", "_bias", "_w", "_ws", "_width", "_out", "_b")

    def __init__(self, fn, weight: torch.Tensor, bias: torch.Tensor | None):
        self._fn, self._weight, self._bias = fn, weight, bias
        self._w, self._ws = weight.data_ptr(), weight.stride(0)
        self._out, self._width = weight.shape
        self._b = None if bias is None else bias.data_ptr()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [n, in] -> [n, out]"""
        n = x.shape[0]
        y = x.new_empty(n, self._out)
        if n and self._out:
            self._fn(
                x.data_ptr(), x.stride(0), n,
                self._w, self._ws, self._width, self._out,
                self._b, y.data_ptr(), y.stride(0), torch.get_num_threads(),
            )  # fmt: skip
        return y
