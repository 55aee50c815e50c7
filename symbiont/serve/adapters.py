"""Adapters served side by side: PEFT folders parsed into slots of stacked weights.

Each targeted base layer is wrapped once in an `AdapterLayer` holding, for every slot,
LoRA `A [slots, r_max, in]` and `B·scale [slots, r_max, out]` (mixed ranks zero-padded) and IA3 vectors `[slots, in]` (feed-forward layers scale their input) or
`[slots, out]` (other layers scale their output). Slot 0 is "no adapter": zero LoRA
and unit IA3. Per iteration the layer runs one base call for all tokens, one gather for
IA3 and one grouped pair of `bmm`s for LoRA, whatever mix of adapters is in the batch.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from peft import PeftConfig
from peft.utils.other import get_pattern_key
from safetensors.torch import load_file
from torch import nn

from symbiont.layers import find_base_layers
from symbiont.serve.config import EngineConfig
from symbiont.serve.context import AdapterBatch, LoraBucket, current_context
from symbiont.skeleton import owner_of

_PEFT_PREFIX = "base_model.model."


class AdapterError(ValueError):
    """An adapter cannot be loaded or served; the message says what to fix."""


class AdapterNotFound(KeyError):
    """No adapter of that name is loaded."""

    def __str__(self) -> str:
        return str(self.args[0])


@dataclass(frozen=True)
class LoraWeights:
    a: torch.Tensor  # [r, in], as PEFT stores lora_A.weight
    b: torch.Tensor  # [out, r], as PEFT stores lora_B.weight
    scale: float  # lora_alpha / r (or / sqrt(r) with rsLoRA)

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass(frozen=True)
class Ia3Weights:
    vector: torch.Tensor  # [in] if feedforward else [out]
    feedforward: bool


@dataclass(frozen=True)
class AdapterWeights:
    """A parsed, validated PEFT adapter, not yet placed in a slot."""

    path: str
    method: str  # "lora" | "ia3"
    modules: dict[str, LoraWeights | Ia3Weights]  # base-layer module name -> weights

    @property
    def rank(self) -> int:
        return max((w.rank for w in self.modules.values() if isinstance(w, LoraWeights)), default=0)


class AdapterLayer(nn.Module):
    """A base layer plus every slot's adapter for it, applied per token group."""

    def __init__(self, base: nn.Module, in_features: int, out_features: int, num_slots: int):
        super().__init__()
        self.base = base
        self.in_features, self.out_features, self.num_slots = in_features, out_features, num_slots
        self.lora_a: torch.Tensor | None = None  # [slots, r_max, in]
        self.lora_b: torch.Tensor | None = None  # [slots, r_max, out], scale folded in
        self.ia3_in: torch.Tensor | None = None  # [slots, in]
        self.ia3_out: torch.Tensor | None = None  # [slots, out]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ctx = current_context()
        if ctx is None:
            return self.base(x)
        batch = ctx.adapters
        flat = x.reshape(-1, self.in_features)  # [n_tokens, in]
        assert flat.shape[0] == batch.token_slots.shape[0], "adapter layer saw a partial batch"
        h = (
            flat * self.ia3_in[batch.token_slots]
            if batch.has_ia3 and self.ia3_in is not None
            else flat
        )
        y = self.base(h)  # [n_tokens, out]: one base call for the whole batch
        if batch.has_ia3 and self.ia3_out is not None:
            y = y * self.ia3_out[batch.token_slots]
        if batch.lora and self.lora_a is not None:
            for bucket in batch.lora:  # at most log2(max_lora_rank) + 1 rank buckets
                # index_put_ (tokens are distinct): CPU index_add is far slower
                y.index_put_((bucket.tokens,), self._lora_delta(flat, bucket), accumulate=True)
        return y.view(*x.shape[:-1], self.out_features)

    def _lora_delta(self, flat: torch.Tensor, bucket: LoraBucket) -> torch.Tensor:
        """Grouped LoRA: x @ A[s] @ B[s] for the tokens of every slot s of the bucket at once.
        flat [n_tokens, in] -> [n_valid, out], rows in `bucket.tokens` order"""
        r = bucket.rank
        a = self.lora_a[:, :r].index_select(0, bucket.slots)  # [groups, r, in]
        b = self.lora_b[:, :r].index_select(0, bucket.slots)  # [groups, r, out]
        xg = flat[bucket.index]  # [groups, max_len, in]
        delta = torch.bmm(torch.bmm(xg, a.transpose(1, 2)), b)  # [groups, max_len, out]
        return delta.reshape(-1, self.out_features).index_select(0, bucket.rows)

    def ensure_lora(self, max_rank: int) -> None:
        if self.lora_a is None:
            like = dict(dtype=self._dtype(), device=self._device())
            self.lora_a = torch.zeros(self.num_slots, max_rank, self.in_features, **like)
            self.lora_b = torch.zeros(self.num_slots, max_rank, self.out_features, **like)

    def ensure_ia3(self, feedforward: bool) -> torch.Tensor:
        name, width = (
            ("ia3_in", self.in_features) if feedforward else ("ia3_out", self.out_features)
        )
        if getattr(self, name) is None:
            like = dict(dtype=self._dtype(), device=self._device())
            setattr(self, name, torch.ones(self.num_slots, width, **like))
        return getattr(self, name)

    def put(self, slot: int, weights: LoraWeights | Ia3Weights | None, max_rank: int) -> None:
        """Write one slot (None clears it back to "no adapter")."""
        if self.lora_a is not None:
            self.lora_a[slot].zero_()
            self.lora_b[slot].zero_()
        for stack in (self.ia3_in, self.ia3_out):
            if stack is not None:
                stack[slot].fill_(1)
        if isinstance(weights, LoraWeights):
            self.ensure_lora(max_rank)
            r = weights.rank
            self.lora_a[slot, :r].copy_(weights.a)
            self.lora_b[slot, :r].copy_(weights.b.t() * weights.scale)
        elif isinstance(weights, Ia3Weights):
            self.ensure_ia3(weights.feedforward)[slot].copy_(weights.vector)

    def _dtype(self) -> torch.dtype:
        return self.base.weight.dtype

    def _device(self) -> torch.device:
        return self.base.weight.device

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, slots={self.num_slots}"


@dataclass
class _Resident:
    name: str
    slot: int
    weights: AdapterWeights
    users: int = 0  # running requests holding the slot
    unloading: bool = False


class AdapterRegistry:
    """Named adapters resident in slots of the model's `AdapterLayer`s.

    `parse` is pure (any thread); `add`, `remove`, `acquire`, `release` mutate slots and
    must run on the engine's thread between iterations. A removed adapter that running
    requests still use keeps its slot until the last of them finishes.
    """

    def __init__(self, model: nn.Module, config: EngineConfig):
        self.model = model
        self.config = config
        self._base = {name: m for name, m in find_base_layers(model) if _servable(model, m)}
        self._layers: dict[str, AdapterLayer] = {}
        self._by_name: dict[str, _Resident] = {}
        self._by_slot: dict[int, _Resident] = {}
        self._free = list(range(config.num_slots - 1, 0, -1))
        self.slot_bucket = [0] * config.num_slots  # LoRA rank rounded up; 0 = not LoRA
        self.slot_is_ia3 = [False] * config.num_slots

    # -- reading adapters -------------------------------------------------------------

    def parse(self, path: str | os.PathLike) -> AdapterWeights:
        """Read and validate a PEFT adapter folder against this model and config."""
        folder = Path(path)
        if not (folder / "adapter_config.json").is_file():
            raise AdapterError(
                f"{folder} is not a PEFT adapter folder (no adapter_config.json); pass the "
                "folder that model.save_pretrained() wrote"
            )
        try:
            config = PeftConfig.from_pretrained(str(folder))
        except (ValueError, TypeError, json.JSONDecodeError) as err:
            raise AdapterError(
                f"{folder}/adapter_config.json is not a valid PEFT config: {err}"
            ) from err
        method = str(getattr(config.peft_type, "value", config.peft_type)).lower()
        if method not in ("lora", "ia3"):
            raise AdapterError(
                f"{folder} is a {method.upper()} adapter; the serving engine batches LoRA and "
                "IA3 adapters (use `symbiont generate` for other PEFT methods)"
            )
        _refuse_unsupported(folder, config)
        tensors = _read_tensors(folder)
        modules = self._modules_of(folder, method, config, tensors)
        return AdapterWeights(str(folder), method, modules)

    def _modules_of(self, folder, method, config, tensors) -> dict:
        grouped: dict[str, dict[str, torch.Tensor]] = {}
        suffixes = (".lora_A.weight", ".lora_B.weight") if method == "lora" else (".ia3_l",)
        for key, tensor in tensors.items():
            stem = key.removeprefix(_PEFT_PREFIX)
            suffix = next((s for s in suffixes if stem.endswith(s)), None)
            if suffix is None:
                raise AdapterError(
                    f"{folder}: tensor {key!r} is not a {method.upper()} weight of a linear "
                    "layer (embedding adapters, biases and modules_to_save are not served)"
                )
            grouped.setdefault(stem.removesuffix(suffix), {})[suffix] = tensor
        if not grouped:
            raise AdapterError(f"{folder}: the adapter holds no {method.upper()} weights")
        build = self._lora_module if method == "lora" else self._ia3_module
        return {name: build(folder, config, name, parts) for name, parts in grouped.items()}

    def _base_layer(self, folder, name: str) -> nn.Module:
        if name not in self._base:
            raise AdapterError(
                f"{folder}: the adapter targets {name!r}, which is not a linear layer of this "
                "model that adapters may target (lm_head is not); was it trained on another base?"
            )
        return self._base[name]

    def _lora_module(self, folder, config, name, parts) -> LoraWeights:
        if set(parts) != {".lora_A.weight", ".lora_B.weight"}:
            raise AdapterError(f"{folder}: {name} has {sorted(parts)}, LoRA needs both A and B")
        a, b = parts[".lora_A.weight"], parts[".lora_B.weight"]
        base, r = self._base_layer(folder, name), a.shape[0]
        want_a, want_b = (r, _in(base)), (_out(base), r)
        if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
            raise AdapterError(
                f"{folder}: {name} LoRA shapes A {list(a.shape)}, B {list(b.shape)} do not fit "
                f"the base layer (expected A {list(want_a)}, B {list(want_b)})"
            )
        if r > self.config.max_lora_rank:
            raise AdapterError(
                f"{folder}: {name} has LoRA rank {r}, above max_lora_rank "
                f"{self.config.max_lora_rank}; restart the server with --max-lora-rank {r}"
            )
        alpha = config.alpha_pattern.get(
            get_pattern_key(config.alpha_pattern, name), config.lora_alpha
        )
        scale = alpha / math.sqrt(r) if config.use_rslora else alpha / r
        return LoraWeights(_checked(folder, name, a), _checked(folder, name, b), float(scale))

    def _ia3_module(self, folder, config, name, parts) -> Ia3Weights:
        vector, base = parts[".ia3_l"], self._base_layer(folder, name)
        feedforward = tuple(vector.shape) == (1, _in(base))
        if not feedforward and tuple(vector.shape) != (_out(base), 1):
            raise AdapterError(
                f"{folder}: {name} IA3 vector has shape {list(vector.shape)}; the base layer "
                f"expects [1, {_in(base)}] (feed-forward) or [{_out(base)}, 1]"
            )
        return Ia3Weights(_checked(folder, name, vector.flatten()), feedforward)

    # -- slots ------------------------------------------------------------------------

    def add(self, name: str, weights: AdapterWeights) -> int:
        """Place parsed weights in a free slot under `name`; returns the slot."""
        if name in self._by_name and not self._by_name[name].unloading:
            raise AdapterError(f"an adapter named {name!r} is already loaded; unload it first")
        if not self._free:
            raise AdapterError(
                f"all {self.config.max_adapters} adapter slots are in use; unload an adapter "
                "or restart with a larger --max-adapters"
            )
        slot = self._free.pop()
        for module_name, module_weights in weights.modules.items():
            self._layer(module_name).put(slot, module_weights, self.config.max_lora_rank)
        resident = _Resident(name, slot, weights)
        self._by_name[name] = resident
        self._by_slot[slot] = resident
        self.slot_bucket[slot] = _bucket_rank(weights.rank, self.config.max_lora_rank)
        self.slot_is_ia3[slot] = weights.method == "ia3"
        return slot

    def remove(self, name: str) -> None:
        """Unload `name`: new requests no longer find it; its slot is freed once unused."""
        resident = self._by_name.pop(name, None)
        if resident is None:
            raise AdapterNotFound(f"no adapter named {name!r} is loaded")
        resident.unloading = True
        if resident.users == 0:
            self._free_slot(resident)

    def acquire(self, name: str) -> int:
        """The slot serving `name`, held until `release`."""
        resident = self._by_name.get(name)
        if resident is None:
            raise AdapterNotFound(f"no adapter named {name!r} is loaded")
        resident.users += 1
        return resident.slot

    def release(self, slot: int) -> None:
        resident = self._by_slot.get(slot)
        if resident is None:
            return
        resident.users -= 1
        assert resident.users >= 0, f"adapter slot {slot} released more often than acquired"
        if resident.unloading and resident.users == 0:
            self._free_slot(resident)

    def _free_slot(self, resident: _Resident) -> None:
        for layer in self._layers.values():
            layer.put(resident.slot, None, self.config.max_lora_rank)
        del self._by_slot[resident.slot]
        self.slot_bucket[resident.slot] = 0
        self.slot_is_ia3[resident.slot] = False
        self._free.append(resident.slot)

    def _layer(self, module_name: str) -> AdapterLayer:
        """The AdapterLayer around `module_name`, wrapping the base layer on first use."""
        if module_name not in self._layers:
            base = self._base[module_name]
            layer = AdapterLayer(base, _in(base), _out(base), self.config.num_slots)
            owner, leaf = owner_of(self.model, module_name)
            setattr(owner, leaf, layer)
            self._layers[module_name] = layer
        return self._layers[module_name]

    # -- introspection ----------------------------------------------------------------

    def names(self) -> list[str]:
        return sorted(self._by_name)

    def info(self, name: str) -> dict:
        resident = self._by_name.get(name)
        if resident is None:
            raise AdapterNotFound(f"no adapter named {name!r} is loaded")
        w = resident.weights
        return {
            "name": name,
            "path": w.path,
            "method": w.method,
            "rank": w.rank,
            "slot": resident.slot,
        }

    @property
    def num_loaded(self) -> int:
        return len(self._by_name)


def adapter_batch(token_slots: torch.Tensor, registry: AdapterRegistry) -> AdapterBatch:
    """Per-iteration adapter metadata: LoRA tokens sorted into rank buckets and slot groups
    (one sort per iteration, reused by every layer). token_slots [n_tokens]"""
    device = token_slots.device
    bucket_of = torch.tensor(registry.slot_bucket, device=device)[token_slots]  # [n_tokens]
    is_ia3 = torch.tensor(registry.slot_is_ia3, device=device)
    ranks = sorted(set(bucket_of.tolist()) - {0})
    return AdapterBatch(
        token_slots=token_slots,
        lora=tuple(_lora_bucket(token_slots, bucket_of == r, r) for r in ranks),
        has_ia3=bool(is_ia3[token_slots].any()),
    )


def _lora_bucket(token_slots: torch.Tensor, member: torch.Tensor, rank: int) -> LoraBucket:
    """Group the tokens in `member` by slot, padded to the largest group."""
    device = token_slots.device
    tokens = torch.nonzero(member).flatten()  # [n_valid]
    slots = token_slots[tokens]
    order = torch.argsort(slots, stable=True)
    tokens, slots = tokens[order], slots[order]
    group_slots, counts = torch.unique_consecutive(slots, return_counts=True)
    max_len = int(counts.max())
    group_of = torch.repeat_interleave(torch.arange(len(group_slots), device=device), counts)
    first = torch.cumsum(counts, 0) - counts  # [n_groups] first row of each group
    rows = group_of * max_len + torch.arange(len(tokens), device=device) - first[group_of]
    index = torch.zeros(len(group_slots) * max_len, dtype=torch.long, device=device)
    index[rows] = tokens
    return LoraBucket(rank, group_slots, index.view(len(group_slots), max_len), rows, tokens)


def _bucket_rank(rank: int, max_rank: int) -> int:
    """rank rounded up to a power of two, at most max_rank; 0 stays 0 (not LoRA)."""
    return 0 if rank == 0 else min(1 << (rank - 1).bit_length(), max_rank)


def _servable(model: nn.Module, module: nn.Module) -> bool:
    return module is not model.get_output_embeddings()


def _in(module: nn.Module) -> int:
    return module.spec.in_features if hasattr(module, "spec") else module.weight.shape[-1]


def _out(module: nn.Module) -> int:
    return module.spec.out_features if hasattr(module, "spec") else module.weight.shape[0]


def _checked(folder, name: str, tensor: torch.Tensor) -> torch.Tensor:
    if not torch.isfinite(tensor).all():
        raise AdapterError(f"{folder}: {name} holds NaN or infinite values; the adapter is broken")
    return tensor


def _refuse_unsupported(folder: Path, config: PeftConfig) -> None:
    refusals = {
        "use_dora": "DoRA adapters need the base weights and are not served",
        "lora_bias": "LoRA biases (lora_bias=True) are not served",
        "modules_to_save": "modules_to_save (fully trained extra modules) are not served",
        "layer_replication": "layer_replication is not served",
        "trainable_token_indices": "trainable_token_indices are not served",
    }
    for field_name, why in refusals.items():
        if getattr(config, field_name, None):
            raise AdapterError(f"{folder}: {why}; retrain without `{field_name}`")


def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    safetensors, pickled = folder / "adapter_model.safetensors", folder / "adapter_model.bin"
    try:
        if safetensors.is_file():
            return load_file(str(safetensors))
        if pickled.is_file():
            return torch.load(pickled, map_location="cpu", weights_only=True)
    except Exception as err:  # corrupt files raise many types; report which file and why
        raise AdapterError(f"{folder}: cannot read the adapter weights: {err}") from err
    raise AdapterError(f"{folder} has no adapter_model.safetensors or adapter_model.bin")
