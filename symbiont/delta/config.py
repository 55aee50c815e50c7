"""What one compression run does: the format of the compressed delta and how it is solved.

Each field with help text is also a flag of `symbiont delta compress` (symbiont/cli/flags.py),
so every default lives here once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

SUPPORTED_BITS = (2, 4)


class Sparsity(StrEnum):
    TWO_FOUR = "2:4"  # at most 2 non-zeros in every 4 consecutive input columns
    NONE = "none"


class Method(StrEnum):
    OBS = "obs"  # optimal brain surgeon (SparseGPT/GPTQ) with calibration inputs
    RTN = "rtn"  # round to nearest, magnitude 2:4 mask: the baseline of the same format


@dataclass(frozen=True)
class CompressConfig:
    """The compressed format (bits, sparsity, groups) and the solver's settings."""

    bits: int = field(default=4, metadata={"help": "bits per kept delta value", "choices": (2, 4)})
    sparsity: Sparsity = field(
        default=Sparsity.TWO_FOUR,
        metadata={"help": "structured sparsity of each linear layer's delta"},
    )
    group_size: int = field(
        default=128,
        metadata={"help": "input columns sharing one scale and zero point; 0 = one per output row"},
    )
    method: Method = field(
        default=Method.OBS,
        metadata={"help": "obs: the calibrated solver; rtn: round to nearest (a baseline)"},
    )
    damp: float = field(
        default=0.01, metadata={"help": "Hessian damping, as a fraction of its mean diagonal"}
    )
    block_size: int = field(
        default=128, metadata={"help": "columns the solver updates lazily as one block"}
    )
    calib_samples: int = field(
        default=256, metadata={"help": "calibration sequences (fewer if the text is short)"}
    )
    calib_seq_len: int = field(default=128, metadata={"help": "tokens per calibration sequence"})
    zstd: bool = field(
        default=False, metadata={"help": "add the lossless zstd stage to the packed file"}
    )
    compress_lm_head: bool = True  # solve the output projection too (else an fp16 delta)

    def __post_init__(self) -> None:
        if self.bits not in SUPPORTED_BITS:
            raise ValueError(f"--bits must be one of {SUPPORTED_BITS}, got {self.bits}")
        object.__setattr__(self, "sparsity", Sparsity(self.sparsity))
        object.__setattr__(self, "method", Method(self.method))
        if self.group_size < 0 or (self.group_size and self.group_size % 4):
            raise ValueError(
                f"--group-size must be 0 (per row) or a positive multiple of 4, got "
                f"{self.group_size}"
            )
        if not 0 < self.damp < 1:
            raise ValueError(f"--damp must be in (0, 1), got {self.damp}")
        if self.block_size < 4 or self.block_size % 4:
            raise ValueError(f"--block-size must be a multiple of 4, got {self.block_size}")
        if self.calib_samples < 1 or self.calib_seq_len < 2:
            raise ValueError("--calib-samples must be >= 1 and --calib-seq-len >= 2")

    @property
    def levels(self) -> int:
        return 2**self.bits
