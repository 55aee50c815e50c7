"""Model skeletons: a Hugging Face model built with no parameter storage at all.

Both halves start from a skeleton on the meta device and fill in only the tensors they
own, so neither ever materialises the other's weights (no full load then discard).
"""

from __future__ import annotations

import copy
import difflib
import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import (
    WeightConverter,
    WeightRenaming,
    dot_natural_key,
    rename_source_key,
)

from symbiont.model.checkpoint import Checkpoint, CheckpointError
from symbiont.model.layers import find_base_layers


def resolve_dtype(checkpoint: Checkpoint, dtype: torch.dtype | str | None) -> torch.dtype:
    """The dtype to run in: the one asked for, else the checkpoint's, else float32."""
    if dtype is None or dtype == "auto":
        dtype = getattr(checkpoint.config, "dtype", None) or torch.float32
    if isinstance(dtype, str):
        if not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise ValueError(f"unknown dtype {dtype!r}; use e.g. 'float32', 'bfloat16', 'float16'")
        dtype = getattr(torch, dtype)
    if not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating point type, got {dtype}")
    return dtype


def build_skeleton(config: PretrainedConfig, dtype: torch.dtype) -> PreTrainedModel:
    """The causal LM for `config`, every parameter and buffer on the meta device."""
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    except ValueError as err:
        raise CheckpointError(
            f"no causal-LM class in transformers for model_type {config.model_type!r}: {err}"
        ) from err
    if not find_base_layers(model):
        raise CheckpointError(
            f"{type(model).__name__} has no nn.Linear or Conv1D layers, so there is nothing "
            "for a base executor to serve; symbiont splits models whose projections are "
            "linear layers"
        )
    return model


def checkpoint_key(model: PreTrainedModel, checkpoint: Checkpoint, tensor_name: str) -> str:
    """The checkpoint key holding the model tensor `tensor_name`.

    Keys are matched to names exactly as `from_pretrained` matches them: every key in the
    file goes through transformers' own conversion mapping for this model (e.g. GPT-NeoX
    saves `lm_head.weight` as `embed_out.weight`), then tied weights are followed
    (a tied `lm_head.weight` is read from the input embeddings).
    """
    keys = key_map(model, checkpoint)
    if tensor_name in keys.file_keys:
        return keys.file_keys[tensor_name]
    if tensor_name in keys.converted:
        raise CheckpointError(keys.conversion_message(tensor_name))
    source = (getattr(model, "all_tied_weights_keys", None) or {}).get(tensor_name)
    if source is not None and source in keys.file_keys:
        return keys.file_keys[source]
    raise CheckpointError(keys.missing_message(tensor_name, tied_to=source))


@dataclass(frozen=True)
class KeyMap:
    """Which checkpoint key `from_pretrained` would load into each tensor of one model."""

    model: str  # class name, for messages
    path: Path
    file_keys: dict[str, str]  # model tensor name -> checkpoint key
    converted: dict[str, list[str]]  # model tensor name -> keys a WeightConverter combines
    # model tensor name -> (the converter's first target, the converter, (pattern, key) of
    # each source in load order): what `read_tensor` replays
    conversions: dict[str, tuple[str, WeightConverter, tuple[tuple[str, str], ...]]]
    checkpoint_keys: tuple[str, ...]
    unused_keys: tuple[str, ...]  # keys that load into no tensor of the model
    saved_names: Callable[[str], str]  # model tensor name -> the key save_pretrained writes

    def conversion_message(self, name: str) -> str:
        sources = ", ".join(repr(k) for k in self.converted[name][:4])
        return (
            f"{self.model} parameter {name!r} is stored in {self.path} as {sources}, which "
            "transformers converts (splits, merges or permutes) when it loads; symbiont reads "
            "tensors one by one and cannot run that conversion yet. Re-save the weights "
            "under the model's own names, one key per parameter: "
            "safetensors.torch.save_model(AutoModelForCausalLM.from_pretrained(dir), "
            "'<new dir>/model.safetensors'), and copy config.json next to it"
        )

    def missing_message(self, name: str, *, tied_to: str | None) -> str:
        wanted = [name, self.saved_names(name)]
        if tied_to is not None:
            wanted += [tied_to, self.saved_names(tied_to)]
        wanted = list(dict.fromkeys(wanted))
        # Keys no tensor uses are the likeliest suspects; else the nearest names at all.
        pool, which = self.unused_keys, "keys in the checkpoint that no parameter uses"
        if not pool:
            pool, which = self.checkpoint_keys, "closest keys in the checkpoint"
        closest = difflib.get_close_matches(self.saved_names(name), pool, 5, 0)
        tied = f" (tied to {tied_to!r})" if tied_to is not None else ""
        return (
            f"no tensor for {self.model} parameter {name!r}{tied} in {self.path}: looked for "
            f"{' or '.join(repr(k) for k in wanted)} (the names transformers loads and saves "
            f"it under); {which}: {', '.join(map(repr, closest))} "
            f"({len(pool)} in all). If one of them is this tensor under "
            "another name, this transformers version does not know that rename: rename the "
            "key in the file (or use the transformers version that saved it); otherwise "
            "config.json describes another architecture than the weights"
        )


_KEY_MAPS: weakref.WeakKeyDictionary[nn.Module, dict[Path, KeyMap]] = weakref.WeakKeyDictionary()


def key_map(model: PreTrainedModel, checkpoint: Checkpoint) -> KeyMap:
    """The KeyMap of `model` over `checkpoint`, built once per pair."""
    per_model = _KEY_MAPS.setdefault(model, {})
    if checkpoint.path not in per_model:
        per_model[checkpoint.path] = _build_key_map(model, checkpoint)
    return per_model[checkpoint.path]


def _build_key_map(model: PreTrainedModel, checkpoint: Checkpoint) -> KeyMap:
    """Rename every checkpoint key the way `convert_and_load_state_dict_in_model` does."""
    transforms = get_model_conversion_mapping(model)  # what from_pretrained applies
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    by_pattern = {pattern: c for c in converters for pattern in c.source_patterns}
    names = model.state_dict(keep_vars=True)  # keep_vars: never touches remote weights
    prefix = model.base_model_prefix
    file_keys: dict[str, str] = {}
    converted: dict[str, list[str]] = {}
    sources: dict[str, list[tuple[str, str]]] = {}  # first target -> (pattern, key), in order
    conversions: dict = {}
    unused: list[str] = []
    ordered = sorted(checkpoint.tensor_files, key=dot_natural_key)  # stateful renames need it
    for key in ordered:
        renamed, pattern = rename_source_key(key, renamings, converters, prefix, names)
        if renamed not in names and key in names:  # a rename that misfired: keep the key
            renamed, pattern = rename_source_key(key, [], [], prefix, names)
        if renamed not in names:
            unused.append(key)
            continue
        if pattern is None:
            file_keys.setdefault(renamed, key)
            continue
        targets = by_pattern[pattern].target_patterns
        sources.setdefault(renamed, []).append((pattern, key))
        for target in targets:  # a one-to-many converter fills every target from one key
            name = renamed.replace(targets[0], target)
            converted.setdefault(name, []).append(key)
            conversions[name] = (renamed, by_pattern[pattern], sources[renamed])
    return KeyMap(
        type(model).__name__,
        checkpoint.path,
        file_keys,
        converted,
        {n: (first, c, tuple(srcs)) for n, (first, c, srcs) in conversions.items()},
        tuple(ordered),
        tuple(unused),
        _saved_names(model),
    )


def read_tensor(
    model: PreTrainedModel, checkpoint: Checkpoint, name: str, *, device="cpu"
) -> torch.Tensor:
    """The model tensor `name` exactly as `from_pretrained` loads it: one checkpoint key,
    or several keys that transformers' conversion mapping combines (e.g. per-expert
    `experts.0.up_proj.weight`, ... stacked into one `experts.gate_up_proj`), combined
    by transformers' own conversion operations."""
    keys = key_map(model, checkpoint)
    if name not in keys.conversions:
        return checkpoint.read(checkpoint_key(model, checkpoint, name), device=device)
    first, converter, sources = keys.conversions[name]
    fresh = copy.deepcopy(converter)  # it collects tensors: one instance per target
    for pattern, key in sources:
        fresh.collected_tensors[pattern].append(
            functools.partial(checkpoint.read, key, device=device)
        )
    try:
        tensors = fresh.convert(first, model=model, config=model.config)
    except Exception as err:  # noqa: BLE001 - any op failing means the same: cannot convert
        raise CheckpointError(
            f"{keys.conversion_message(name)} (converting failed: {err})"
        ) from err
    if name not in tensors:
        raise CheckpointError(keys.conversion_message(name))
    return tensors[name]


def _saved_names(model: PreTrainedModel) -> Callable[[str], str]:
    """name -> key, as `save_pretrained` reverts the conversion mapping when it saves."""
    try:
        reverse = [t.reverse_transform() for t in get_model_conversion_mapping(model)[::-1]]
    except (ValueError, NotImplementedError, AttributeError):  # a conversion with no inverse
        reverse = []
    renamings = [t for t in reverse if isinstance(t, WeightRenaming)]
    converters = [t for t in reverse if isinstance(t, WeightConverter)]

    def saved_name(name: str) -> str:
        return rename_source_key(name, renamings, converters, reverse=True)[0]

    return saved_name


def set_tensor(module: nn.Module, name: str, value: torch.Tensor) -> None:
    """Replace a (meta) parameter or buffer of `module` by a real tensor, keeping its kind."""
    if name in module._parameters:
        old = module._parameters[name]
        module._parameters[name] = nn.Parameter(value, requires_grad=old.requires_grad)
    else:
        module._buffers[name] = value


def owner_of(model: nn.Module, qualified: str) -> tuple[nn.Module, str]:
    module_path, _, leaf = qualified.rpartition(".")
    return (model.get_submodule(module_path) if module_path else model), leaf
