"""Using a compressed delta: decompress, the exact delta product, merge.

Two ways to run a fine-tuned variant over its base, equal within fp32 rounding:

- exact: `y = x W_baseᵀ (+ b) + x Δ̃ᵀ` per linear layer, the base weights untouched and
  shared; `delta_product(x, layer)` is the second term (`attach` hooks it onto a model);
- merged: `W_base + Δ̃` materialised (`merge_into`, or `merge_checkpoint`, which writes a
  plain transformers checkpoint).

Non-linear parameters (norms, biases, changed embedding rows) are small and are always
merged: `base + fp16 delta`.
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from pathlib import Path

import torch
from torch import nn

from symbiont.delta.format import CompressedDelta, check_output_folder, read_delta
from symbiont.delta.identity import BaseMismatchError, check_base
from symbiont.delta.packing import DeltaFormatError, PackedLayer
from symbiont.model.checkpoint import Checkpoint

log = logging.getLogger(__name__)

# Files of a checkpoint folder that are not weights and travel to the merged model as-is.
_COPIED_SUFFIXES = (".json", ".txt", ".model", ".jinja", ".tiktoken")
_NOT_COPIED = {
    "config.json",
    "model.safetensors.index.json",
    "generation_config.json",
    "symbiont_build.json",  # the default model's build marker: the merge is not that build
}


def load_delta(folder: str | os.PathLike, base: str | os.PathLike | None = None) -> CompressedDelta:
    """Read and verify a delta folder; with `base`, also refuse it for any other base
    (fingerprint check; `merge_checkpoint` also checks every weight's hash)."""
    delta = read_delta(folder)
    if base is not None:
        check_base(delta.manifest, Checkpoint.open(base), full=False)
    return delta


def decompress(layer: PackedLayer, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Δ̃ of one linear layer, dense [out, in]."""
    return layer.dense(dtype)


def delta_product(x: torch.Tensor, layer: PackedLayer) -> torch.Tensor:
    """x Δ̃ᵀ: x [..., in] -> [..., out], in x's dtype.

    Decompresses the layer then multiplies (a fused sparse low-bit kernel would compute
    the same product without the dense intermediate)."""
    if x.shape[-1] != layer.shape[1]:
        raise ValueError(
            f"delta_product: x has {x.shape[-1]} features, layer {layer.name} takes "
            f"{layer.shape[1]}"
        )
    return x @ layer.dense(x.dtype).to(x.device).T


def check_fits(delta: CompressedDelta, model: nn.Module) -> None:
    """Refuse a delta whose layers or parameters do not exist in `model` with its shapes."""
    modules = dict(model.named_modules())
    params = dict(model.named_parameters())
    for name, layer in delta.layers.items():
        module = modules.get(name)
        if not isinstance(module, nn.Linear):
            raise DeltaFormatError(
                f"the delta has linear layer {name}, which the model does not have "
                f"({type(module).__name__ if module is not None else 'missing'}); the delta "
                "belongs to another architecture"
            )
        if tuple(module.weight.shape) != layer.shape:
            raise DeltaFormatError(
                f"layer {name} is {list(module.weight.shape)} in the model, "
                f"{list(layer.shape)} in the delta; the delta belongs to another model"
            )
    for name, param in delta.params.items():
        if name not in params or tuple(params[name].shape) != param.shape:
            got = list(params[name].shape) if name in params else "missing"
            raise DeltaFormatError(
                f"parameter {name} is {got} in the model, {list(param.shape)} in the "
                "delta; the delta belongs to another model"
            )


@torch.no_grad()
def merge_into(model: nn.Module, delta: CompressedDelta) -> None:
    """W_base + Δ̃ for every layer and base + delta for every parameter, in place.

    Checks every shape first, so a delta that does not fit changes nothing."""
    check_fits(delta, model)
    modules = dict(model.named_modules())
    params = dict(model.named_parameters())
    for name, layer in delta.layers.items():
        weight = modules[name].weight
        weight.copy_((weight.float() + layer.dense()).to(weight.dtype))
    _merge_params(params, delta)


@torch.no_grad()
def attach(model: nn.Module, delta: CompressedDelta) -> list:
    """Exact serving: each linear layer of the delta adds `delta_product(x)` to its output
    (base weights unchanged); parameters are merged. Returns the hook handles; removing
    them detaches the layer deltas (the merged parameters stay)."""
    check_fits(delta, model)
    modules = dict(model.named_modules())
    _merge_params(dict(model.named_parameters()), delta)
    handles = []
    for name, layer in delta.layers.items():

        def add_delta(module, args, output, layer=layer):
            return output + delta_product(args[0], layer)

        handles.append(modules[name].register_forward_hook(add_delta))
    return handles


def _merge_params(params: dict, delta: CompressedDelta) -> None:
    for name, param_delta in delta.params.items():
        params[name].copy_(param_delta.apply_to(params[name]))


def merge_checkpoint(
    base: str | os.PathLike, delta_dir: str | os.PathLike, out: str | os.PathLike
) -> Path:
    """Write base + Δ̃ as a plain transformers checkpoint folder (tokenizer files copied).

    Refused, before anything is written, for another base (fingerprint and the sha256 of
    every weight), a corrupt delta or one that does not fit the model."""
    from transformers import AutoModelForCausalLM

    out = Path(out)
    check_output_folder(out)
    checkpoint = Checkpoint.open(base)
    delta = read_delta(delta_dir)
    check_base(delta.manifest, checkpoint, full=True)
    model = AutoModelForCausalLM.from_pretrained(checkpoint.path, dtype="auto")
    merge_into(model, delta)
    # a name of its own: a second merge to the same --out must not write into this one
    staging = out.parent / f".{out.name}.merging-{uuid.uuid4().hex[:8]}"
    try:
        model.save_pretrained(staging, safe_serialization=True)
        _copy_side_files(checkpoint.path, staging)
        if out.exists():
            out.rmdir()
        os.replace(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def _copy_side_files(source: Path, target: Path) -> None:
    """Tokenizer and generation files of the base travel with the merged weights."""
    for file in source.iterdir():
        if file.is_file() and file.suffix in _COPIED_SUFFIXES and file.name not in _NOT_COPIED:
            shutil.copy2(file, target / file.name)
    generation = source / "generation_config.json"
    if generation.is_file():
        shutil.copy2(generation, target / generation.name)


__all__ = [
    "BaseMismatchError",
    "DeltaFormatError",
    "attach",
    "check_fits",
    "decompress",
    "delta_product",
    "load_delta",
    "merge_checkpoint",
    "merge_into",
]
