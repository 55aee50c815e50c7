"""Fully fine-tuned models as compressed deltas over their base (DeltaZip).

`Δ = W_ft - W_base` of every linear layer is made 2:4 sparse and 2- or 4-bit by an
optimal-brain-surgeon solver on calibration activations (`solver.py`), propagated layer by
layer through `W_base + Δ̃` (`compress.py`), packed (`packing.py`) into a folder with a
verified manifest (`format.py`, `identity.py`), and applied exactly or merged
(`apply.py`). docs/deltas.md describes the format and the commands. Imports model only.
"""

from symbiont.delta.apply import (
    attach,
    decompress,
    delta_product,
    load_delta,
    merge_checkpoint,
    merge_into,
)
from symbiont.delta.config import CompressConfig, Method, Sparsity
from symbiont.delta.format import CompressedDelta, ParamDelta
from symbiont.delta.identity import BaseMismatchError
from symbiont.delta.packing import DeltaFormatError, PackedLayer

__all__ = [
    "BaseMismatchError",
    "CompressConfig",
    "CompressedDelta",
    "DeltaFormatError",
    "Method",
    "PackedLayer",
    "ParamDelta",
    "Sparsity",
    "attach",
    "decompress",
    "delta_product",
    "load_delta",
    "merge_checkpoint",
    "merge_into",
]
