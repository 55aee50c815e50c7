"""The base side of `AdapterSpec.check_base`: a base model's linear layers, however given.

A Manifest is recognised by its `layers` (adapters sit below protocol and do not import it).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from torch import nn

from symbiont.model.checkpoint import Checkpoint
from symbiont.model.layers import LayerSpec, find_base_layers, spec_of


def base_layers(base: Any) -> dict[str, tuple[int, int]]:
    """Linear layer name -> (in_features, out_features) of a Manifest, a Checkpoint or a
    checkpoint folder, a model (nn.Module), or an iterable of LayerSpecs."""
    if isinstance(getattr(base, "layers", None), tuple):  # a protocol Manifest
        return base_layers(base.layers)
    if isinstance(base, nn.Module):
        return _shapes(spec_of(i, n, m) for i, (n, m) in enumerate(find_base_layers(base)))
    if isinstance(base, (Checkpoint, str, os.PathLike)):
        return base_layers(_skeleton(_checkpoint(base)))
    if isinstance(base, Iterable):
        specs = list(base)
        if all(isinstance(s, LayerSpec) for s in specs):
            return _shapes(specs)
    raise TypeError(
        "check_base takes a Manifest, a Checkpoint or checkpoint folder, a model, or "
        f"LayerSpecs; got {type(base).__name__}"
    )


def base_model_config(base: Any):
    """The transformers config of `base` where it carries one, else None."""
    if isinstance(base, (Checkpoint, str, os.PathLike)):
        return _checkpoint(base).config
    return getattr(base, "config", None) if isinstance(base, nn.Module) else None


def _shapes(specs: Iterable[LayerSpec]) -> dict[str, tuple[int, int]]:
    return {s.name: (s.in_features, s.out_features) for s in specs}


def _checkpoint(base) -> Checkpoint:
    return base if isinstance(base, Checkpoint) else Checkpoint.open(Path(base))


def _skeleton(checkpoint: Checkpoint) -> nn.Module:
    import torch

    from symbiont.model.skeleton import build_skeleton

    return build_skeleton(checkpoint.config, torch.float32)
