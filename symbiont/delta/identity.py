"""Which base a delta belongs to, and the checks that refuse it on any other.

The manifest records the base's checkpoint fingerprint (config plus sampled bytes, the
same one executors and clients compare: cheap on any size) and a sha256 over every weight
tensor's name, dtype, shape and bytes (a full read: `delta merge` reads every tensor
anyway, so it checks this one too).
"""

from __future__ import annotations

import hashlib

import torch
from safetensors import safe_open

from symbiont.delta.packing import DeltaFormatError
from symbiont.model.checkpoint import Checkpoint


class BaseMismatchError(DeltaFormatError):
    """A delta is applied to a base it was not made from."""


def weights_sha256(checkpoint: Checkpoint) -> str:
    """sha256 of every tensor (name, dtype, shape, bytes), in name order."""
    digest = hashlib.sha256()
    files = checkpoint.tensor_files
    for name in sorted(files):
        with safe_open(files[name], framework="pt") as f:
            tensor = f.get_tensor(name)
        digest.update(f"{name}|{tensor.dtype}|{list(tensor.shape)}|".encode())
        digest.update(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def base_identity(checkpoint: Checkpoint, name: str) -> dict:
    return {
        "name": name,
        "fingerprint": checkpoint.fingerprint,
        "weights_sha256": weights_sha256(checkpoint),
    }


def check_base(manifest: dict, checkpoint: Checkpoint, *, full: bool) -> None:
    """Refuse `checkpoint` unless it is the base the delta was compressed against.

    full: also compare the sha256 of every weight (reads the whole base)."""
    base = manifest["base"]
    fingerprint = checkpoint.fingerprint
    if fingerprint != base.get("fingerprint"):
        raise BaseMismatchError(_mismatch(base, checkpoint, "fingerprint"))
    if full and weights_sha256(checkpoint) != base.get("weights_sha256"):
        raise BaseMismatchError(_mismatch(base, checkpoint, "weights sha256"))


def _mismatch(base: dict, checkpoint: Checkpoint, what: str) -> str:
    return (
        f"this delta was compressed against base {base.get('name')!r}, and {checkpoint.path} "
        f"is another model (its {what} differs); pass the base the delta was made from "
        "(`symbiont delta info DIR` shows it)"
    )
