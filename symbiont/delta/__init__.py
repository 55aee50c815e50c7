"""Fully fine-tuned models as compressed deltas over their base (DeltaZip).

`Δ = W_ft - W_base` of every linear layer is made 2:4 sparse and 2- or 4-bit by an
optimal-brain-surgeon solver on calibration activations (`solver.py`), propagated layer by
layer through `W_base + Δ̃` (`compress.py`), packed (`packing.py`) into a folder with a
verified manifest (`format.py`, `identity.py`), and applied exactly or merged
(`apply.py`). docs/deltas.md describes the format and the commands. Imports model only.

Names load on first use (`symbiont delta --help` must not import torch).
"""

from symbiont.util.lazy import lazy_exports

_EXPORTS = {
    **dict.fromkeys(
        [
            "attach",
            "check_fits",
            "decompress",
            "delta_product",
            "load_delta",
            "merge_checkpoint",
            "merge_into",
        ],
        "symbiont.delta.apply",
    ),
    **dict.fromkeys(["CompressConfig", "Method", "Sparsity"], "symbiont.delta.config"),
    **dict.fromkeys(["LayerReport", "compress"], "symbiont.delta.compress"),
    **dict.fromkeys(["CompressedDelta", "ParamDelta", "read_manifest"], "symbiont.delta.format"),
    "BaseMismatchError": "symbiont.delta.identity",
    **dict.fromkeys(["DeltaFormatError", "PackedLayer"], "symbiont.delta.packing"),
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
