"""Model skeletons: a Hugging Face model built with no parameter storage at all.

Both halves start from a skeleton on the meta device and fill in only the tensors they
own, so neither ever materialises the other's weights (no full load then discard).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from symbiont.checkpoint import Checkpoint, CheckpointError
from symbiont.layers import find_base_layers


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
    """The checkpoint key holding `tensor_name`, following tied weights (lm_head -> embeddings)."""
    if checkpoint.has(tensor_name):
        return tensor_name
    source = (getattr(model, "all_tied_weights_keys", None) or {}).get(tensor_name)
    if source is not None and checkpoint.has(source):
        return source
    raise CheckpointError(
        f"checkpoint {checkpoint.path} has no tensor {tensor_name!r} that "
        f"{type(model).__name__} needs; the checkpoint is incomplete or of another architecture"
    )


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
