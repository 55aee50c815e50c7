"""Prompt tuning, P-tuning and prefix tuning served per request, beside every other adapter.

A prompt-learning adapter puts `v` positions before a request's prompt in its KV cache:

- prompt tuning and P-tuning: `v` virtual token embeddings [v, hidden] (P-tuning saves
  its prompt encoder's output, so both are plain embeddings once loaded). They are rows
  of the sequence's first chunk: the runner feeds `inputs_embeds` with those rows taken
  from the adapter, at positions 0..v-1, as peft concatenates them before the prompt.
- prefix tuning: a key and value prefix [v, kv_heads, head_dim] per layer, written
  straight into the sequence's first `v` KV slots before its prompt runs (peft hands them
  to the model as a past-key-value cache: never rotated, and the prompt's positions start
  at v, as transformers counts from the cache's length).

Either way the sequence's positions are `v` virtual ones followed by its tokens
(`Sequence.num_virtual`); a prefix's are in the cache as soon as it is admitted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from symbiont.adapters.spec import AdapterError, AdapterSpec

PROMPT_METHODS = ("prompt_tuning", "p_tuning", "prefix_tuning")
_KEY = "prompt_embeddings"


@dataclass(frozen=True)
class VirtualTokens:
    """What a prompt-learning adapter puts before each of its requests' prompts."""

    embeds: torch.Tensor | None = None  # [v, hidden]: prompt tuning, P-tuning
    keys: tuple[torch.Tensor, ...] = ()  # per layer [v, kv_heads, head_dim]: prefix tuning
    values: tuple[torch.Tensor, ...] = ()

    @property
    def count(self) -> int:
        return self.embeds.shape[0] if self.embeds is not None else self.keys[0].shape[0]

    @property
    def precomputed(self) -> bool:
        """Whether the positions are written to the KV cache, not run (a prefix)."""
        return self.embeds is None


def read_virtual_tokens(
    spec: AdapterSpec, tensors: dict[str, torch.Tensor], model: nn.Module
) -> VirtualTokens:
    """The adapter's virtual tokens, checked against the served model."""
    extra = sorted(set(tensors) - {_KEY})
    if extra or _KEY not in tensors:
        raise AdapterError(
            f"{spec.path}: a {spec.peft_type} adapter holds one tensor {_KEY!r}; this one "
            f"holds {sorted(tensors) or 'none'} (re-save it with save_pretrained)"
        )
    weights = tensors[_KEY]
    config = spec.config
    if weights.dim() != 2 or weights.shape[0] != config.num_virtual_tokens:
        raise AdapterError(
            f"{spec.path}: {_KEY} is {list(weights.shape)}, the config needs "
            f"[num_virtual_tokens={config.num_virtual_tokens}, width]; re-save the adapter"
        )
    dtype = model.get_input_embeddings().weight.dtype
    if spec.method != "prefix_tuning":
        hidden = model.get_input_embeddings().weight.shape[1]
        _check_width(spec, weights, hidden, "the model's hidden size")
        return VirtualTokens(embeds=weights.to(dtype))
    return _prefix(spec, weights.to(dtype), model)


def _prefix(spec: AdapterSpec, weights: torch.Tensor, model: nn.Module) -> VirtualTokens:
    config = spec.config
    if getattr(config, "num_transformer_submodules", 1) != 1:
        raise AdapterError(
            f"{spec.path}: a prefix for encoder-decoder models is not served (this is a "
            "decoder-only server)"
        )
    layers, heads = config.num_layers, config.num_attention_heads
    head_dim = config.token_dim // heads
    _check_width(spec, weights, layers * 2 * config.token_dim, "num_layers x 2 x token_dim")
    want = _kv_layout(model)
    if want is not None and want != (layers, heads, head_dim):
        raise AdapterError(
            f"{spec.path}: the prefix has {layers} layers of {heads} key/value heads of "
            f"{head_dim}; this base has {want[0]} of {want[1]} of {want[2]}. The adapter was "
            "made for another base"
        )
    v = weights.shape[0]
    # peft's get_prompt: view [v, layers * 2, heads, head_dim], layer l's key at 2l and
    # its value at 2l + 1, used by the model without any rotation
    kv = weights.view(v, layers * 2, heads, head_dim).transpose(0, 1)  # [2L, v, H, D]
    keys = tuple(kv[2 * layer].contiguous() for layer in range(layers))
    values = tuple(kv[2 * layer + 1].contiguous() for layer in range(layers))
    return VirtualTokens(keys=keys, values=values)


def _kv_layout(model: nn.Module) -> tuple[int, int, int] | None:
    """(layers, kv_heads, head_dim) of a transformers decoder, where its config says."""
    config = getattr(model, "config", None)
    config = getattr(config, "get_text_config", lambda: config)()
    heads = getattr(config, "num_attention_heads", None)
    if config is None or heads is None:
        return None
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return config.num_hidden_layers, kv_heads, head_dim


def _check_width(spec: AdapterSpec, weights: torch.Tensor, want: int, what: str) -> None:
    if weights.shape[1] != want:
        raise AdapterError(
            f"{spec.path}: {_KEY} is {list(weights.shape)}, but {what} is {want}; the adapter "
            "was made for another base"
        )


def write_prefix(kv_cache, tokens: VirtualTokens, slots: torch.Tensor) -> None:
    """Write a prefix's keys and values into every layer's pools at `slots` [v]."""
    with torch.inference_mode():  # the pools are inference tensors, made in the forward
        for layer, (k, v) in enumerate(zip(tokens.keys, tokens.values, strict=True)):
            k_pool, v_pool = kv_cache.pools(layer, k)
            k_pool.index_copy_(0, slots, k.to(k_pool))
            v_pool.index_copy_(0, slots, v.to(v_pool))
