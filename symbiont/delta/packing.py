"""Packed form of a solved layer: what the safetensors file of a delta holds.

Per linear layer `NAME` ([out, in]):

    NAME.codes   uint8 [out, ceil(k·bits/8)]   the kept values' codes, 8/bits per byte,
                                               low bits first; k = in/2 with 2:4, else in
    NAME.mask    uint8 [out, ceil(in/8)]       2:4 only: one 4-bit bitmask per group of 4
                                               input columns (bit j: column 4g+j kept),
                                               two groups per byte, exactly 2 bits per nibble
    NAME.scale   bfloat16 [out, groups]        value = scale · (code - zero)
    NAME.zero    uint8 [out, groups]

`pack` and `unpack` are exact inverses: the dense Δ̃ of an unpacked layer equals the
solver's bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from symbiont.delta.config import SUPPORTED_BITS
from symbiont.delta.solver import QuantizedLayer, dequantize, group_count


class DeltaFormatError(ValueError):
    """A delta file or manifest is invalid; the message says what and how to fix it."""


@dataclass(frozen=True)
class PackedLayer:
    """One linear layer's compressed delta, as stored (see the module docstring)."""

    name: str
    shape: tuple[int, int]  # (out, in) of the layer's weight
    bits: int
    two_four: bool
    group_size: int
    codes: torch.Tensor
    mask: torch.Tensor | None
    scale: torch.Tensor
    zero: torch.Tensor

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {
            f"{self.name}.codes": self.codes,
            f"{self.name}.scale": self.scale,
            f"{self.name}.zero": self.zero,
        }
        if self.mask is not None:
            out[f"{self.name}.mask"] = self.mask
        return out

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def kept(self) -> torch.Tensor:
        """[out, in] bool: where values are stored."""
        rows, columns = self.shape
        if self.mask is None:
            return torch.ones(rows, columns, dtype=torch.bool)
        nibbles = unpack_bits(self.mask, 4, columns // 4)  # [out, in/4]
        bits = (nibbles[:, :, None] >> torch.arange(4, dtype=torch.uint8)) & 1
        return bits.reshape(rows, columns).bool()

    def codes_dense(self, kept: torch.Tensor) -> torch.Tensor:
        """[out, in] uint8 codes; pruned positions hold their group's zero."""
        rows, columns = self.shape
        stored = unpack_bits(self.codes, self.bits, stored_per_row(columns, self.two_four))
        if self.mask is None:
            return stored
        zero_cols = self.zero.repeat_interleave(self.group_size or columns, dim=1)[:, :columns]
        dense = zero_cols.clone()
        dense[kept] = stored.reshape(-1)  # row-major: each row's kept columns in order
        return dense

    def dense(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Δ̃ [out, in] (fp32 math, then cast): the stored values dequantised where they
        are, [out, k], then scattered to their columns: the same numbers as
        `dense_reference`, bit for bit, several times faster (exact serving runs this, or
        `ServingLayer.dense`, at every call)."""
        rows, columns = self.shape
        k = stored_per_row(columns, self.two_four)
        stored = unpack_bits(self.codes, self.bits, k)  # [out, k]
        values = stored_values(stored, self.scale, self.zero, self.group_size, self.shape)
        if not self.two_four:
            return values.to(dtype)
        low, high = self.kept_pairs()
        return scatter_pairs(low, high, values, dtype)

    def kept_pairs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The two kept columns of each group of 4, from its mask nibble (exactly two bits
        set, `validate`): the lowest and the highest set bit, by comparisons.
        -> uint8 [out, in/4] each, in 0..3"""
        n = unpack_bits(self.mask, 4, self.shape[1] // 4)  # [out, in/4]
        low = (n & 1 == 0).to(torch.uint8) + (n & 3 == 0) + (n & 7 == 0)
        high = (n >= 2).to(torch.uint8) + (n >= 4) + (n >= 8)
        return low, high

    def serving(self) -> PackedLayer | ServingLayer:
        """This layer re-encoded once for decompression at every call (exact serving)."""
        if not self.two_four:
            return self
        low, high = self.kept_pairs()
        positions = pack_bits(low | (high << 2), 4)  # the mask's 4 bits per group, decoded
        fields = dict(codes=self.codes, scale=self.scale, zero=self.zero)
        return ServingLayer(self.name, self.shape, self.bits, self.group_size, positions, **fields)

    def dense_reference(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """`dense` the direct way (dense codes, boolean mask): what tests compare it to."""
        kept = self.kept()
        values = dequantize(self.codes_dense(kept), kept, self.scale, self.zero, self.group_size)
        return values.to(dtype)

    def validate(self) -> None:
        """Refuse a layer whose tensors do not describe a valid `shape` layer."""
        rows, columns = self.shape
        where = f"layer {self.name}"
        if self.bits not in SUPPORTED_BITS:
            raise DeltaFormatError(
                f"{where}: unknown bit width {self.bits} (supported: {SUPPORTED_BITS}); "
                "this delta was written by a newer or foreign tool, re-compress it"
            )
        if self.two_four and columns % 4:
            raise DeltaFormatError(f"{where}: 2:4 needs in % 4 == 0, shape is {self.shape}")
        groups = group_count(columns, self.group_size)
        stored = stored_per_row(columns, self.two_four)
        expected = {
            "codes": (torch.uint8, (rows, packed_width(stored, self.bits))),
            "scale": (torch.bfloat16, (rows, groups)),
            "zero": (torch.uint8, (rows, groups)),
        }
        if self.two_four:
            expected["mask"] = (torch.uint8, (rows, packed_width(columns // 4, 4)))
        for part, (dtype, shape) in expected.items():
            tensor = getattr(self, part)
            if tensor is None or tensor.dtype != dtype or tuple(tensor.shape) != shape:
                got = "missing" if tensor is None else f"{tensor.dtype} {list(tensor.shape)}"
                raise DeltaFormatError(
                    f"{where}: {part} should be {dtype} {list(shape)}, got {got}; the file "
                    "does not match its manifest (re-compress the delta)"
                )
        if int(self.zero.max()) >= 2**self.bits:
            raise DeltaFormatError(f"{where}: zero point outside the {self.bits}-bit range")
        if not bool(torch.isfinite(self.scale).all()):
            raise DeltaFormatError(f"{where}: a scale is NaN or infinite; re-compress the delta")
        if self.two_four:
            self._validate_mask(where)

    def _validate_mask(self, where: str) -> None:
        rows, columns = self.shape
        per_group = self.kept().reshape(rows, columns // 4, 4).sum(dim=2)
        if not bool((per_group == 2).all()):
            bad = (per_group != 2).nonzero()[0].tolist()
            raise DeltaFormatError(
                f"{where}: the sparsity mask is not 2:4 (row {bad[0]}, columns "
                f"{4 * bad[1]}..{4 * bad[1] + 3} keep {int(per_group[bad[0], bad[1]])} of 4); "
                "the file is corrupt or was not written by `symbiont delta compress`"
            )


@dataclass(frozen=True)
class ServingLayer:
    """A 2:4 packed layer as exact serving holds it: the same codes, scales and zeros
    (shared, not copied), and instead of the mask each group's two kept columns as 2-bit
    positions (`low | high << 2`: the same 4 bits per group), so `dense` needs no bit
    search. `dense` equals `PackedLayer.dense` bit for bit."""

    name: str
    shape: tuple[int, int]
    bits: int
    group_size: int
    positions: torch.Tensor  # uint8 [out, ceil(in/8)]: two groups per byte
    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor

    def nbytes(self) -> int:
        parts = (self.positions, self.codes, self.scale, self.zero)
        return sum(t.numel() * t.element_size() for t in parts)

    def dense(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        columns = self.shape[1]
        stored = unpack_bits(self.codes, self.bits, columns // 2)  # [out, in/2]
        values = stored_values(stored, self.scale, self.zero, self.group_size, self.shape)
        p = unpack_bits(self.positions, 4, columns // 4)  # [out, in/4]
        return scatter_pairs(p & 3, p >> 2, values, dtype)


def stored_values(
    stored: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    group_size: int,
    shape: tuple[int, int],
) -> torch.Tensor:
    """codes [out, k] -> scale · (code - zero), fp32, each with its group's scale and
    zero (k = in with every column stored, in/2 with 2:4)."""
    rows, k = stored.shape
    columns, groups = shape[1], scale.shape[1]
    scale, zero = scale.float(), zero.float()  # [out, groups]
    if groups == 1 or (group_size and columns % group_size == 0):
        # groups of equal size: broadcast instead of gathering a scale per value
        grouped = stored.view(rows, groups, -1).float()
        return (scale[:, :, None] * (grouped - zero[:, :, None])).view(rows, k)
    first_column = torch.arange(k) // 2 * 4 if k != columns else torch.arange(k)
    group = first_column // group_size  # [k]: each stored value's group
    return scale[:, group] * (stored.float() - zero[:, group])


def scatter_pairs(
    low: torch.Tensor, high: torch.Tensor, values: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Dense [out, in] from 2:4 stored values [out, in/2] (each group's two in column
    order) and their columns within the group, low and high [out, in/4]."""
    rows, groups = low.shape
    where = torch.stack([low, high], 2).long()  # [out, in/4, 2]
    dense = torch.zeros(rows, groups, 4, dtype=torch.float32)
    dense.scatter_(2, where, values.view(rows, groups, 2))
    return dense.view(rows, groups * 4).to(dtype)


def stored_per_row(columns: int, two_four: bool) -> int:
    return columns // 2 if two_four else columns


def packed_width(count: int, bits: int) -> int:
    return -(-count * bits // 8)


def pack(name: str, layer: QuantizedLayer, two_four: bool) -> PackedLayer:
    """The solver's dense result -> the stored tensors."""
    rows, columns = layer.codes.shape
    mask = None
    stored = layer.codes
    if two_four:
        stored = layer.codes[layer.kept].reshape(rows, columns // 2)
        weights = 2 ** torch.arange(4, dtype=torch.uint8)
        nibbles = (layer.kept.reshape(rows, columns // 4, 4).to(torch.uint8) * weights).sum(
            dim=2, dtype=torch.uint8
        )
        mask = pack_bits(nibbles, 4)
    return PackedLayer(
        name=name,
        shape=(rows, columns),
        bits=layer.bits,
        two_four=two_four,
        group_size=layer.group_size,
        codes=pack_bits(stored, layer.bits),
        mask=mask,
        scale=layer.scale.contiguous(),
        zero=layer.zero.contiguous(),
    )


def pack_bits(values: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 [rows, n] with values < 2^bits -> uint8 [rows, ceil(n·bits/8)], low bits first."""
    per_byte = 8 // bits
    rows, n = values.shape
    padded = torch.zeros(rows, packed_width(n, bits) * per_byte, dtype=torch.uint8)
    padded[:, :n] = values
    shifts = torch.arange(per_byte, dtype=torch.uint8) * bits
    return (padded.reshape(rows, -1, per_byte) << shifts).sum(dim=2, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of `pack_bits`: uint8 [rows, bytes] -> uint8 [rows, n]."""
    per_byte = 8 // bits
    shifts = torch.arange(per_byte, dtype=torch.uint8) * bits
    values = (packed[:, :, None] >> shifts) & (2**bits - 1)
    return values.reshape(packed.shape[0], -1)[:, :n]
