"""Building a client: an ordinary Hugging Face model whose frozen linear layers are remote."""

from __future__ import annotations

import os

import torch
from transformers import GenerationConfig, PreTrainedModel

from symbiont.client.experts import make_virt_experts
from symbiont.client.masking import MaskConfig, mask_executors
from symbiont.client.virt import make_virt_layer
from symbiont.model.checkpoint import Checkpoint, CheckpointError
from symbiont.model.layers import find_base_layers, spec_of
from symbiont.model.moe import experts_spec, find_experts
from symbiont.model.skeleton import (
    build_skeleton,
    checkpoint_key,
    owner_of,
    resolve_dtype,
    set_tensor,
)
from symbiont.protocol.executor import PROTOCOL_VERSION, Executor, ExecutorError


def load_client(
    path: str | os.PathLike,
    executor: Executor | tuple[Executor, Executor],
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str | None = None,
    local_lm_head: bool = False,
    mask_activations: bool | str | MaskConfig | None = None,
) -> PreTrainedModel:
    """The checkpoint's causal LM with every nn.Linear/Conv1D served by `executor`.

    Only the remaining tensors (embeddings, norms, ...) are read from the checkpoint;
    the base linear weights are never materialised here. `dtype` defaults to the
    executor's; the client may run in another and activations are cast on each call.

    local_lm_head: keep the output projection on the client as a plain module, for
    trainers that read `lm_head.weight` directly (TRL's SFTTrainer computes its loss
    with a fused, chunked LM head). Free when the head is tied to the input
    embeddings, which the client holds anyway; otherwise it costs vocab x hidden.

    mask_activations: 'pool' (or True) masks every call so the executor cannot read the
    activations; 'shares' splits each call between two executors of parties that do
    not collude (pass `executor` as a pair). See docs/privacy.md.
    """
    executor = mask_executors(path, executor, mask_activations, device=device)
    checkpoint = Checkpoint.open(path)
    manifest = executor.manifest
    _check_same_base(checkpoint, manifest)
    dtype = resolve_dtype(checkpoint, dtype or manifest.dtype)
    device = torch.device(device)
    model = build_skeleton(checkpoint.config, dtype)
    keep = {model.get_output_embeddings()} if local_lm_head else set()
    _replace_base_layers(model, executor, dtype, device, keep=keep)
    _replace_experts(model, executor, dtype, device)
    _load_client_tensors(model, checkpoint, dtype, device)
    _materialise_computed_buffers(model, device)
    _attach_generation_config(model, checkpoint)
    model.name_or_path = str(checkpoint.path)
    return model.eval()


def _check_same_base(checkpoint: Checkpoint, manifest) -> None:
    if manifest.protocol != PROTOCOL_VERSION:
        raise ExecutorError(
            f"executor speaks protocol {manifest.protocol}, this client {PROTOCOL_VERSION}; "
            "upgrade symbiont on the older side"
        )
    if manifest.fingerprint != checkpoint.fingerprint:
        raise ExecutorError(
            f"checkpoint {checkpoint.path} (fingerprint {checkpoint.fingerprint}) is not the base "
            f"this executor serves (fingerprint {manifest.fingerprint}); load the client from "
            "the same checkpoint folder the executor was started with"
        )


def _replace_base_layers(model, executor: Executor, dtype, device, keep) -> None:
    manifest = executor.manifest
    ids = manifest.layer_ids()
    for name, module in find_base_layers(model):
        if module in keep:
            continue
        local = spec_of(ids.get(name, -1), name, module)
        if name not in ids or manifest.layers[ids[name]] != local:
            raise ExecutorError(
                f"layer {name} {local} does not match the executor's manifest; "
                "client and executor were built by different transformers versions or configs"
            )
        owner, leaf = owner_of(model, name)
        setattr(owner, leaf, make_virt_layer(module, executor, local, dtype, device))


def _replace_experts(model, executor: Executor, dtype, device) -> None:
    """Each MoE experts stack becomes a VirtExperts: its weights stay on the executor."""
    served = {spec.name: spec for spec in executor.manifest.experts}
    for name, module, after in find_experts(model):
        spec = served.get(name)
        if spec is None or experts_spec(spec.id, name, module, after) != spec:
            why = "serves no experts" if spec is None else f"serves {name} as {spec}"
            raise ExecutorError(
                f"{type(model).__name__} has a mixture-of-experts stack {name}, but the "
                f"executor {why}: start serve-base with this symbiont version and the same "
                "checkpoint and transformers version as the client"
            )
        owner, leaf = owner_of(model, name)
        setattr(owner, leaf, make_virt_experts(module, executor, spec, dtype, device))


def _load_client_tensors(model, checkpoint: Checkpoint, dtype, device) -> None:
    """Read every remaining parameter (and persistent buffer) from the checkpoint."""
    loaded: dict[str, torch.Tensor] = {}
    for name, tensor in _meta_tensors(model, persistent_only=True):
        key = checkpoint_key(model, checkpoint, name)
        if key not in loaded:
            value = checkpoint.read(key, device=device)
            if value.shape != tensor.shape:
                raise CheckpointError(
                    f"{key} has shape {list(value.shape)} in {checkpoint.path}, the model "
                    f"expects {list(tensor.shape)}; config.json does not match the weights"
                )
            loaded[key] = value.to(dtype) if value.is_floating_point() else value
        owner, leaf = owner_of(model, name)
        set_tensor(owner, leaf, loaded[key])
        owner._parameters.get(leaf, owner._buffers.get(leaf))._is_hf_initialized = True


def _materialise_computed_buffers(model, device) -> None:
    """Buffers not in the checkpoint (rotary frequencies, embedding scales, ...) are
    computed by the model's own init code, exactly as `from_pretrained` computes them."""
    for name, tensor in _meta_tensors(model, persistent_only=False):
        owner, leaf = owner_of(model, name)
        set_tensor(owner, leaf, torch.empty_like(tensor, device=device))
    for tensor in list(model.parameters()):
        tensor._is_hf_initialized = True
    model.initialize_weights()
    leftover = [name for name, _ in _meta_tensors(model, persistent_only=False)]
    if leftover:
        raise CheckpointError(f"could not materialise {leftover}; please report this model type")


def _meta_tensors(model, *, persistent_only: bool):
    seen = set()
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        tensors = list(module._parameters.items())
        tensors += [
            (n, b)
            for n, b in module._buffers.items()
            if not persistent_only or n not in module._non_persistent_buffers_set
        ]
        for leaf, tensor in tensors:
            if tensor is not None and tensor.is_meta and (prefix + leaf) not in seen:
                seen.add(prefix + leaf)
                yield prefix + leaf, tensor


def _attach_generation_config(model, checkpoint: Checkpoint) -> None:
    if (checkpoint.path / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(checkpoint.path)
