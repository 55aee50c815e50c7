"""Adapters served side by side: PEFT folders parsed into slots of stacked weights.

Each targeted base layer is wrapped once in an `AdapterLayer` holding, for every slot,
LoRA `Aᵀ [slots, chunks, in, 16]` (A transposed, its ranks in chunks of 16) and
`B·scale [slots, r_max, out]` (mixed ranks zero-padded; on a CPU, in the kernel's blocks
of 8 x 8, `block_b`), IA3 vectors `[slots, in]`
(feed-forward layers scale their input) or `[slots, out]` (other layers scale their
output), and DoRA's output scales `[slots, out]`. Slot 0 is "no adapter": zero LoRA and
unit IA3. Per iteration the layer runs one base call for all tokens, one gather for IA3
and DoRA, and LoRA only for the tokens that use it, two ways (chosen once per iteration
by `adapter_batch`):

- tokens whose adapter has few tokens in the batch (decoding sequences): each token's
  A and B rows read straight from the stacks, no copy of any weight (`LoraRows`; the
  SGMV shrink/expand pair of punica and vLLM), through symbiont's CPU kernel
  (symbiont/kernels/lora_rows.py) or, where it does not apply, two `embedding_bag`s;
- tokens of an adapter with many (prefill chunks): grouped by slot in rank buckets, the
  slot's A and B gathered once and applied with a `bmm` pair (`LoraBucket`).

AdaLoRA, VeRA, LoHa and DoRA become LoRA slots and LoKr a per-slot `RowDelta`
(`symbiont.serve.weight_methods`).
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from peft.utils.other import get_pattern_key
from torch import nn

from symbiont.adapters.spec import PEFT_KEY_PREFIX, AdapterError, AdapterSpec, read_adapter
from symbiont.kernels.lora_rows import (
    B_BLOCK,
    STACK_DTYPES,
    LoraRowsKernel,
    RowsIndex,
    block_b,
    unblock_b,
)
from symbiont.model.layers import find_base_layers, spec_of
from symbiont.model.skeleton import owner_of
from symbiont.serve.config import EngineConfig
from symbiont.serve.context import AdapterBatch, LoraBucket, current_context
from symbiont.serve.virtual_tokens import PROMPT_METHODS, VirtualTokens, read_virtual_tokens
from symbiont.util import memory

SERVED_METHODS = (
    *("lora", "ia3", "adalora", "vera", "loha", "lokr", "dora"),
    *("prompt_tuning", "p_tuning", "prefix_tuning"),
)

__all__ = [
    "AdapterError",
    "AdapterLayer",
    "AdapterNotFound",
    "AdapterRegistry",
    "AdapterWeights",
    "Ia3Weights",
    "LoraRows",
    "LoraWeights",
    "MethodWeights",
    "RowDelta",
    "ServedAdapterBatch",
    "adapter_batch",
]

# Ranks of Aᵀ per chunk: 16 fp32 values are one 64-byte cache line, so a rank-8 adapter
# reads at most one line per input feature and higher ranks read no padding.
RANK_CHUNK = 16
# An adapter with at least this many tokens in an iteration has its A and B gathered
# once and applied with bmm (a GEMM per slot); with fewer, each token reads its rows in
# place (embedding_bag: a GEMV per token, which rereads the rows from cache per token).
DENSE_MIN_TOKENS = 8


@functools.cache
def rows_kernel() -> LoraRowsKernel | None:
    """symbiont's CPU kernel for LoRA rows read in place (None: it cannot be built here)."""
    return LoraRowsKernel.load()


class AdapterNotFound(KeyError):
    """No adapter of that name is loaded."""

    def __str__(self) -> str:
        return str(self.args[0])


@dataclass(frozen=True)
class LoraWeights:
    a: torch.Tensor  # [r, in], as PEFT stores lora_A.weight
    b: torch.Tensor  # [out, r], as PEFT stores lora_B.weight
    scale: float  # lora_alpha / r (or / sqrt(r) with rsLoRA)
    # DoRA's g = m / ‖W + s·BA‖ per output channel [out]: scales B and the base result
    out_scale: torch.Tensor | None = None

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass(frozen=True)
class Ia3Weights:
    vector: torch.Tensor  # [in] if feedforward else [out]
    feedforward: bool


@dataclass(frozen=True)
class RowDelta:
    """A term added to the rows of one slot's tokens: a compressed full fine-tune's layer
    delta (`symbiont.serve.deltas`)."""

    product: Callable[[torch.Tensor], torch.Tensor]  # x [n, in] -> [n, out]
    nbytes: int = 0  # of the tensors `product` holds


@dataclass(frozen=True)
class AdapterWeights:
    """A parsed, validated PEFT adapter, not yet placed in a slot."""

    path: str
    method: str  # "lora" | "ia3" | "delta" | one of weight_methods.WEIGHT_METHODS
    modules: dict[str, LoraWeights | Ia3Weights | RowDelta]  # base-layer module name -> weights

    @property
    def rank(self) -> int:
        return max((w.rank for w in self.modules.values() if isinstance(w, LoraWeights)), default=0)


@dataclass(frozen=True)
class MethodWeights(AdapterWeights):
    """An adapter of another method (`weight_methods`, `virtual_tokens`) as served."""

    nbytes: int  # of the tensors held (what the adapter cache's host tier counts)
    virtual: VirtualTokens | None = None  # prompt/prefix tuning: positions before the prompt

    @classmethod
    def of(cls, path: str, method: str, modules: dict, virtual: VirtualTokens | None = None):
        tensors = []
        for module in modules.values():
            if isinstance(module, LoraWeights):
                tensors += [module.a, module.b, module.out_scale]
        if virtual is not None:
            tensors += [virtual.embeds, *virtual.keys, *virtual.values]
        held = sum(m.nbytes for m in modules.values() if isinstance(m, RowDelta))
        held += sum(t.numel() * t.element_size() for t in tensors if t is not None)
        return cls(path, method, modules, held, virtual)


class AdapterLayer(nn.Module):
    """A base layer plus every slot's adapter for it, applied per token group."""

    def __init__(
        self,
        base: nn.Module,
        in_features: int,
        out_features: int,
        num_slots: int,
        lora_dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.base = base
        self.in_features, self.out_features, self.num_slots = in_features, out_features, num_slots
        self.lora_dtype = lora_dtype  # of the LoRA stacks (None: the base weight's)
        self.lora_a_t: torch.Tensor | None = None  # [slots, chunks, in, RANK_CHUNK]: Aᵀ
        # B·scale [slots, r_max, out], or in blocks [slots, r_max / 8, out / 8, 8, 8]
        # (`b_blocked`): what the CPU kernel reads, one stream per pass over 8 rows
        self.lora_b: torch.Tensor | None = None
        self.block_b = True  # hold B in blocks where it can be: a CPU, out a multiple of 8
        self.b_blocked = False
        self.ia3_in: torch.Tensor | None = None  # [slots, in]
        self.ia3_out: torch.Tensor | None = None  # [slots, out]
        self.dora_scale: torch.Tensor | None = None  # [slots, out], DoRA's g; 1 elsewhere
        self.deltas: dict[int, RowDelta] = {}  # slot -> full fine-tune delta

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ctx = current_context()
        batch = None if ctx is None else ctx.adapters
        if batch is None:
            return self.base(x)
        rows = getattr(batch, "lora_rows", None)
        lora = self.lora_a_t is not None and (batch.lora or rows is not None)
        if not (lora or batch.has_ia3 or batch.has_dora or self.deltas):
            return self.base(x)  # fast path: no adapter math for this layer this iteration
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
        if batch.has_dora and self.dora_scale is not None:
            y = self._dora_rescale(y, self.dora_scale[batch.token_slots])
        if lora and rows is not None and not self._lora_rows_in_place(flat, y, rows):
            delta = self._lora_rows(flat, rows)  # [n_rows, out]
            if rows.all_tokens:
                y += delta
            else:  # index_put_ (tokens are distinct): CPU index_add is far slower
                y.index_put_((rows.tokens,), delta, accumulate=True)
        if lora:
            for bucket in batch.lora:  # at most log2(max_lora_rank) + 1 rank buckets
                y.index_put_((bucket.tokens,), self._lora_delta(flat, bucket), accumulate=True)
        for slot, delta in self.deltas.items():  # x Δ̃ᵀ for the rows of each delta's tokens
            rows = (batch.token_slots == slot).nonzero().flatten()
            if rows.numel():
                y.index_put_((rows,), delta.product(flat[rows]), accumulate=True)
        return y.view(*x.shape[:-1], self.out_features)

    def _dora_rescale(self, y: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """b + g ⊙ (W x): DoRA scales the base result but not its bias. y, g [n_tokens, out]"""
        bias = getattr(self.base, "bias", None)
        return y * g if bias is None else y * g + bias * (1 - g)

    def _lora_delta(self, flat: torch.Tensor, bucket: LoraBucket) -> torch.Tensor:
        """Grouped LoRA: x @ A[s] @ B[s] for the tokens of every slot s of the bucket at once.
        flat [n_tokens, in] -> [n_valid, out], rows in `bucket.tokens` order"""
        r = bucket.rank
        chunks = -(-r // RANK_CHUNK)
        stack = self.lora_a_t.permute(0, 2, 1, 3)[:, :, :chunks]  # [slots, in, c, 16] view
        # widened to the model's dtype where the stacks are held in another (--lora-dtype)
        a_t = stack.index_select(0, bucket.slots).flatten(2)[..., :r].to(flat.dtype)
        b = self._b_of(bucket.slots, r).to(flat.dtype)  # [groups, r, out]
        xg = flat[bucket.index]  # [groups, max_len, in]
        delta = torch.bmm(torch.bmm(xg, a_t), b)  # [groups, max_len, out]
        return delta.reshape(-1, self.out_features).index_select(0, bucket.rows)

    def _lora_rows_in_place(self, flat: torch.Tensor, y: torch.Tensor, rows: LoraRows) -> bool:
        """Per-token LoRA through symbiont's CPU kernel, added into y [n_tokens, out] in
        place; False where the kernel does not apply (no compiler, not float32 on the CPU,
        gradients), and `_lora_rows` runs instead."""
        if not (flat.is_cpu and flat.dtype == torch.float32):
            return False  # before rows_kernel(): a GPU engine builds no CPU kernels
        kernel = rows_kernel()
        if kernel is None:
            return False
        num_slots, chunks = self.lora_a_t.shape[:2]
        index = rows.index(flat.shape[0], num_slots, chunks, self.r_max)
        if index is None or not kernel.add_if_fits(flat, y, index, self.lora_a_t, self.lora_b):
            return False
        torch.autograd.graph.increment_version(y)  # as `y +=` would: y changed in place
        return True

    def _lora_rows(self, flat: torch.Tensor, rows: LoraRows) -> torch.Tensor:
        """Per-token LoRA read in place: h = Aᵀ[s] x (shrink), then B[s]ᵀ h (expand), as
        weighted sums of stack rows. flat [n_tokens, in] -> [n_rows, out] in `rows.tokens`
        order. Each token reads exactly its adapter's A (in 16-rank chunks) and B rows."""
        num_slots, chunks = self.lora_a_t.shape[:2]
        plan = rows.plan(num_slots, chunks, self.in_features, self.r_max)
        x = flat if plan.x_rows is None else flat.index_select(0, plan.x_rows)  # [n_bags, in]
        # embedding_bag takes per-sample weights in its table's dtype: with --lora-dtype
        # bfloat16 stacks under a float32 model, x and h are rounded to it here (the
        # kernel, `_lora_rows_in_place`, keeps them in float32)
        x = x.to(self.lora_a_t.dtype)
        table_a = self.lora_a_t.view(-1, RANK_CHUNK)  # [slots * c * in, 16]
        h = F.embedding_bag(
            plan.a_index, table_a, plan.a_offsets, mode="sum", per_sample_weights=x.reshape(-1)
        )  # [n_bags, 16]
        h = h.view(-1) if plan.h_index is None else h.view(-1).index_select(0, plan.h_index)
        # [slots * r_max, out] (blocks are copied back to rows: only where the kernel
        # refuses a call of a layer that holds B for it, which `_kernel_reads_b` avoids)
        plain = unblock_b(self.lora_b) if self.b_blocked else self.lora_b
        table_b = plain.reshape(-1, self.out_features)
        return F.embedding_bag(
            plan.b_index, table_b, plan.b_offsets, mode="sum", per_sample_weights=h
        ).to(flat.dtype)  # [n_rows, out]

    def ensure_lora(self, max_rank: int) -> None:
        if self.lora_a_t is None:
            like = dict(dtype=self.lora_dtype or self._dtype(), device=self._device())
            chunks = -(-max_rank // RANK_CHUNK)
            # on huge pages: a decode step streams scattered regions of these stacks
            self.lora_a_t = memory.zeros(
                self.num_slots, chunks, self.in_features, RANK_CHUNK, **like
            )
            self.b_blocked = self._kernel_reads_b(like["dtype"], like["device"])
            if self.b_blocked:
                r_max = -(-max_rank // B_BLOCK) * B_BLOCK
                shape = (r_max // B_BLOCK, self.out_features // B_BLOCK, B_BLOCK, B_BLOCK)
                self.lora_b = memory.zeros(self.num_slots, *shape, **like)
            else:
                self.lora_b = memory.zeros(self.num_slots, max_rank, self.out_features, **like)

    def _kernel_reads_b(self, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether decoding tokens' LoRA will go through the CPU kernel, which reads B in
        blocks (else B stays in rows, as `embedding_bag` and the GPU read it)."""
        return (
            self.block_b
            and device.type == "cpu"
            and self._dtype() == torch.float32  # x and y of the kernel
            and dtype in STACK_DTYPES
            and self.out_features % B_BLOCK == 0
            and rows_kernel() is not None
        )

    @property
    def r_max(self) -> int:
        """Rows of each slot's B (max_rank, rounded up to whole blocks where blocked)."""
        return self.lora_b.shape[1] * (B_BLOCK if self.b_blocked else 1)

    def _b_of(self, slots: torch.Tensor, r: int) -> torch.Tensor:
        """B·scale of `slots`, its first r rows: [len(slots), r, out] (a copy)."""
        if not self.b_blocked:
            return self.lora_b[:, :r].index_select(0, slots)
        whole = -(-r // B_BLOCK)
        # the blocks as rows, a view: [slots, whole, 8, out / 8, 8]; gathered in one copy
        rows = self.lora_b[:, :whole].permute(0, 1, 3, 2, 4).index_select(0, slots)
        return rows.reshape(len(slots), whole * B_BLOCK, self.out_features)[:, :r]

    def ensure_ia3(self, feedforward: bool) -> torch.Tensor:
        name, width = (
            ("ia3_in", self.in_features) if feedforward else ("ia3_out", self.out_features)
        )
        if getattr(self, name) is None:
            like = dict(dtype=self._dtype(), device=self._device())
            setattr(self, name, torch.ones(self.num_slots, width, **like))
        return getattr(self, name)

    def put(
        self, slot: int, weights: LoraWeights | Ia3Weights | RowDelta | None, max_rank: int
    ) -> None:
        """Write one slot (None clears it back to "no adapter")."""
        self.deltas.pop(slot, None)
        if self.lora_a_t is not None:
            self.lora_a_t[slot].zero_()
            self.lora_b[slot].zero_()
        for stack in (self.ia3_in, self.ia3_out, self.dora_scale):
            if stack is not None:
                stack[slot].fill_(1)
        if isinstance(weights, LoraWeights):
            self.ensure_lora(max_rank)
            r = weights.rank
            chunks = self.lora_a_t.shape[1]
            a = torch.zeros(chunks * RANK_CHUNK, self.in_features, dtype=weights.a.dtype)
            a[:r] = weights.a  # [r, in] zero-padded to whole chunks
            self.lora_a_t[slot].copy_(a.view(chunks, RANK_CHUNK, -1).transpose(1, 2))
            b = weights.b.t() * weights.scale  # [r, out]
            if weights.out_scale is not None:  # DoRA: g ⊙ s·B A x
                b = b * weights.out_scale
                self.ensure_dora()[slot].copy_(weights.out_scale)
            if self.b_blocked:
                rows = torch.zeros(self.r_max, self.out_features, dtype=b.dtype)
                rows[:r] = b
                self.lora_b[slot].copy_(block_b(rows))
            else:
                self.lora_b[slot, :r].copy_(b)
        elif isinstance(weights, Ia3Weights):
            self.ensure_ia3(weights.feedforward)[slot].copy_(weights.vector)
        elif isinstance(weights, RowDelta):
            self.deltas[slot] = weights

    def ensure_dora(self) -> torch.Tensor:
        if self.dora_scale is None:
            like = dict(dtype=self._dtype(), device=self._device())
            self.dora_scale = torch.ones(self.num_slots, self.out_features, **like)
        return self.dora_scale

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
        layers = find_base_layers(model)
        self._base = {name: m for name, m in layers if _servable(model, m)}
        self._specs = tuple(spec_of(i, name, m) for i, (name, m) in enumerate(self._base.items()))
        self._unservable = {name for name, _ in layers} - set(self._base)
        self._layers: dict[str, AdapterLayer] = {}
        self._by_name: dict[str, _Resident] = {}
        self._by_slot: dict[int, _Resident] = {}
        self._free = list(range(config.num_slots - 1, 0, -1))
        self.slot_bucket = [0] * config.num_slots  # LoRA rank rounded up; 0 = not LoRA
        self.slot_is_ia3 = [False] * config.num_slots
        self.slot_is_dora = [False] * config.num_slots
        self.slot_virtual: list[VirtualTokens | None] = [None] * config.num_slots

    # -- reading adapters -------------------------------------------------------------

    def parse(self, path: str | os.PathLike) -> AdapterWeights:
        """Read and validate a PEFT adapter folder against this model and config."""
        spec = self.inspect(path)
        # weight_methods builds on this module's weight types, hence imported here
        from symbiont.serve.weight_methods import WEIGHT_METHODS, build_modules, method_of

        tensors = spec.load_tensors()
        method = method_of(spec)
        if method in PROMPT_METHODS:
            virtual = read_virtual_tokens(spec, tensors, self.model)
            return MethodWeights.of(str(spec.path), method, {}, virtual)
        if method in WEIGHT_METHODS:
            modules = build_modules(spec, tensors, self._base, self.config.max_lora_rank)
            return MethodWeights.of(str(spec.path), method, modules)
        return AdapterWeights(str(spec.path), method, self._modules_of(spec, tensors))

    def inspect(self, path: str | os.PathLike) -> AdapterSpec:
        """Config and weight headers of a PEFT adapter folder, checked against this model
        and config without reading the weights (cheap: what a folder scan runs)."""
        spec = read_adapter(path)
        if spec.method not in SERVED_METHODS:
            raise AdapterError(
                f"{spec.path} is a {spec.peft_type} adapter, which the serving engine does not "
                f"serve: it batches {', '.join(SERVED_METHODS)} (use `symbiont generate "
                "--adapter` for other PEFT methods)"
            )
        _refuse_unsupported(spec)
        self._check_targets(spec)
        return spec

    def _check_targets(self, spec: AdapterSpec) -> None:
        unserved = sorted(set(spec.modules) & self._unservable)
        if unserved:
            raise AdapterError(
                f"{spec.path}: the adapter targets {unserved[0]!r}, the output layer; adapters "
                "on the output layer (lm_head) are not served"
            )
        spec.check_base(self._specs)
        spec.check_prompt_learning(getattr(self.model, "config", None))
        if spec.method != "lora":
            return  # other methods wider than the LoRA stacks run in their own sub-batch
        for name, r in spec.ranks.items():
            if r > self.config.max_lora_rank:
                raise AdapterError(
                    f"{spec.path}: {name} has LoRA rank {r}, above max_lora_rank "
                    f"{self.config.max_lora_rank}; restart the server with --max-lora-rank {r}"
                )

    def _modules_of(self, spec: AdapterSpec, tensors: dict[str, torch.Tensor]) -> dict:
        grouped: dict[str, dict[str, torch.Tensor]] = {}
        suffixes = (".lora_A.weight", ".lora_B.weight") if spec.method == "lora" else (".ia3_l",)
        for key, tensor in tensors.items():
            stem = key.removeprefix(PEFT_KEY_PREFIX)
            suffix = next((s for s in suffixes if stem.endswith(s)), None)
            if suffix is None:
                raise AdapterError(
                    f"{spec.path}: tensor {key!r} is not a {spec.peft_type} weight of a linear "
                    "layer (embedding adapters, biases and modules_to_save are not served)"
                )
            grouped.setdefault(stem.removesuffix(suffix), {})[suffix] = tensor
        if not grouped:
            raise AdapterError(f"{spec.path}: the adapter holds no {spec.peft_type} weights")
        build = self._lora_module if spec.method == "lora" else self._ia3_module
        return {name: build(spec, name, parts) for name, parts in grouped.items()}

    def _lora_module(self, spec: AdapterSpec, name: str, parts) -> LoraWeights:
        if set(parts) != {".lora_A.weight", ".lora_B.weight"}:
            raise AdapterError(f"{spec.path}: {name} has {sorted(parts)}, LoRA needs both A and B")
        a, b = parts[".lora_A.weight"], parts[".lora_B.weight"]
        config, r = spec.config, a.shape[0]
        alpha = config.alpha_pattern.get(
            get_pattern_key(config.alpha_pattern, name), config.lora_alpha
        )
        scale = alpha / math.sqrt(r) if config.use_rslora else alpha / r
        return LoraWeights(a, b, float(scale))

    def _ia3_module(self, spec: AdapterSpec, name: str, parts) -> Ia3Weights:
        vector = parts[".ia3_l"]  # [1, in] (feed-forward) or [out, 1], as check_base found
        feedforward = vector.shape[0] == 1 and vector.shape[1] != 1
        return Ia3Weights(vector.flatten(), feedforward)

    # -- slots ------------------------------------------------------------------------

    def add(self, name: str, weights: AdapterWeights) -> int:
        """Place parsed weights in a free slot under `name`; returns the slot. Names made
        by `cached_key` belong to the adapter cache and are not listed by `names`."""
        if name in self._by_name and not self._by_name[name].unloading:
            raise AdapterError(f"an adapter named {name!r} is already loaded; unload it first")
        if not self._free:
            raise AdapterError(
                f"all {self.config.max_adapters} adapter slots are in use; unload an adapter "
                "or restart with a larger --max-loras"
            )
        slot = self._free.pop()
        try:
            for module_name, module_weights in weights.modules.items():
                self._layer(module_name).put(slot, module_weights, self.config.max_lora_rank)
        except Exception as err:  # out of memory growing a stack, say: the slot goes back
            for layer in self._layers.values():
                layer.put(slot, None, self.config.max_lora_rank)
            self._free.append(slot)
            raise AdapterError(
                f"adapter {name!r} could not be placed in a slot ({type(err).__name__}: {err}); "
                "the server goes on without it"
            ) from err
        resident = _Resident(name, slot, weights)
        self._by_name[name] = resident
        self._by_slot[slot] = resident
        self.slot_bucket[slot] = bucket_rank(weights.rank, self.config.max_lora_rank)
        self.slot_is_ia3[slot] = weights.method == "ia3"
        self.slot_is_dora[slot] = weights.method == "dora"
        self.slot_virtual[slot] = getattr(weights, "virtual", None)
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
        self.slot_is_dora[resident.slot] = False
        self.slot_virtual[resident.slot] = None
        self._free.append(resident.slot)

    def _layer(self, module_name: str) -> AdapterLayer:
        """The AdapterLayer around `module_name`, wrapping the base layer on first use."""
        if module_name not in self._layers:
            base = self._base[module_name]
            lora_dtype = getattr(torch, self.config.lora_dtype) if self.config.lora_dtype else None
            layer = AdapterLayer(base, _in(base), _out(base), self.config.num_slots, lora_dtype)
            owner, leaf = owner_of(self.model, module_name)
            setattr(owner, leaf, layer)
            self._layers[module_name] = layer
        return self._layers[module_name]

    # -- introspection ----------------------------------------------------------------

    def servable(self, module_name: str) -> bool:
        """Whether `module_name` is a base layer adapters (and deltas) are applied in."""
        return module_name in self._base

    def base_shape(self, module_name: str) -> tuple[int, int] | None:
        """[out, in] of a servable base layer, None for any other name."""
        module = self._base.get(module_name)
        return None if module is None else (_out(module), _in(module))

    def names(self) -> list[str]:
        """Adapters loaded by name (`--adapter`, POST /v1/adapters), not the cache's."""
        return sorted(n for n in self._by_name if not n.startswith(CACHED_PREFIX))

    def users(self, name: str) -> int:
        """Running sequences holding `name`'s slot (0 if it is not loaded)."""
        resident = self._by_name.get(name)
        return 0 if resident is None else resident.users

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

    def virtual_tokens(self, slot: int) -> VirtualTokens | None:
        """The prompt-learning positions the adapter in `slot` puts before each prompt."""
        return self.slot_virtual[slot]

    @property
    def num_free_slots(self) -> int:
        """Adapter slots not holding an adapter (slot 0, "no adapter", is not counted)."""
        return len(self._free)

    @property
    def num_loaded(self) -> int:
        return len(self._by_name)


# Registry names of adapters the cache places in slots: a NUL never appears in a served
# name, so these never collide with adapters loaded by name.
CACHED_PREFIX = "\0cache/"


def cached_key(name: str) -> str:
    return CACHED_PREFIX + name


@dataclass(frozen=True)
class RowsPlan:
    """Index tensors of `AdapterLayer._lora_rows` for one stack shape. A bag is one
    16-rank chunk of one token's Aᵀ; a term is one rank of one token's adapter."""

    x_rows: torch.Tensor | None  # [n_bags] flat token of each bag; None: bags are the tokens
    a_index: torch.Tensor  # [n_bags * in] row of Aᵀ's [slots * chunks * in, 16] table
    a_offsets: torch.Tensor  # [n_bags] first a_index entry of each bag
    h_index: torch.Tensor | None  # [n_terms] entries of the flattened [n_bags, 16] result
    # that are ranks of the token's adapter; None: all of them, in order
    b_index: torch.Tensor  # [n_terms] row of B's [slots * r_max, out] table
    b_offsets: torch.Tensor  # [n_rows] first term of each token


@dataclass(frozen=True)
class LoraRows:
    """LoRA tokens applied one by one, reading their adapter's rows in place: the tokens
    whose adapter has fewer than DENSE_MIN_TOKENS tokens this iteration (decoding
    sequences, mostly). Semantics: `y[t] += x[t] @ A[s_t]ᵀ @ B[s_t]ᵀ·scale` per token."""

    tokens: torch.Tensor  # [n_rows] flat token index, ascending
    slots: torch.Tensor  # [n_rows] adapter slot of each token
    ranks: torch.Tensor  # [n_rows] the slot's bucket rank (its rank, or a zero-padded bound)
    all_tokens: bool  # the rows are every token of the batch, in order
    plans: dict = field(default_factory=dict)  # stack shape -> RowsPlan / RowsIndex, per iteration

    def index(self, n_tokens: int, num_slots: int, chunks: int, r_max: int) -> RowsIndex | None:
        """The rows checked for the kernel against a stack's shape (None: out of range)."""
        key = ("kernel", n_tokens, num_slots, chunks, r_max)
        if key not in self.plans:
            self.plans[key] = RowsIndex.check(
                self.tokens, self.slots, self.ranks, n_tokens, num_slots, chunks, r_max
            )
        return self.plans[key]

    def plan(self, num_slots: int, chunks: int, in_features: int, r_max: int) -> RowsPlan:
        key = (num_slots, chunks, in_features, r_max)
        if key not in self.plans:
            self.plans[key] = _rows_plan(self, *key)
        return self.plans[key]


@dataclass(frozen=True)
class ServedAdapterBatch(AdapterBatch):
    """`AdapterBatch` plus the LoRA tokens applied row by row (None: none are)."""

    lora_rows: LoraRows | None = None


def adapter_batch(
    token_slots: torch.Tensor,
    registry: AdapterRegistry,
    dense_min: int = DENSE_MIN_TOKENS,
    *,
    any_adapter: bool = True,
) -> ServedAdapterBatch:
    """Per-iteration adapter metadata, reused by every layer: LoRA tokens of adapters with
    at least `dense_min` tokens sorted into rank buckets and slot groups, the others as
    rows read in place; base tokens in neither. token_slots [n_tokens]; any_adapter
    False: the caller knows every slot is 0 (a base-only step: nothing to sort; sorting
    took about 40 µs, 1% of a 4M-parameter model's decode step)."""
    if not any_adapter:
        return ServedAdapterBatch(token_slots=token_slots, lora=(), has_ia3=False)
    device = token_slots.device
    bucket_of = torch.tensor(registry.slot_bucket, device=device)[token_slots]  # [n_tokens]
    is_ia3 = torch.tensor(registry.slot_is_ia3, device=device)
    is_dora = torch.tensor(registry.slot_is_dora, device=device)
    num_slots = len(registry.slot_bucket)
    group_len = torch.bincount(token_slots, minlength=num_slots)[token_slots]  # [n_tokens]
    lora = bucket_of > 0
    dense = lora & (group_len >= dense_min)
    ranks = sorted(set(bucket_of[dense].tolist()))
    return ServedAdapterBatch(
        token_slots=token_slots,
        lora=tuple(_lora_bucket(token_slots, dense & (bucket_of == r), r) for r in ranks),
        has_ia3=bool(is_ia3[token_slots].any()),
        has_dora=bool(is_dora[token_slots].any()),
        lora_rows=_lora_rows(token_slots, bucket_of, lora & ~dense),
    )


def _lora_rows(
    token_slots: torch.Tensor, bucket_of: torch.Tensor, member: torch.Tensor
) -> LoraRows | None:
    tokens = torch.nonzero(member).flatten()  # [n_rows]
    if not len(tokens):
        return None
    return LoraRows(tokens, token_slots[tokens], bucket_of[tokens], len(tokens) == len(token_slots))


def _rows_plan(rows: LoraRows, num_slots: int, chunks: int, in_features: int, r_max: int):
    device = rows.tokens.device
    # int32 indices where the tables allow: half the index bytes each layer reads
    table_rows = max(num_slots * chunks * in_features, num_slots * r_max)
    dtype = torch.int32 if table_rows < 2**31 else torch.long
    n_rows, ranks = len(rows.tokens), rows.ranks
    n_chunks = (ranks + RANK_CHUNK - 1) // RANK_CHUNK  # [n_rows]
    row_of_bag = torch.repeat_interleave(torch.arange(n_rows, device=device), n_chunks)
    first_bag = torch.cumsum(n_chunks, 0) - n_chunks  # [n_rows]
    chunk_of_bag = torch.arange(len(row_of_bag), device=device) - first_bag[row_of_bag]
    table_row = (rows.slots[row_of_bag] * chunks + chunk_of_bag) * in_features  # [n_bags]
    features = torch.arange(in_features, device=device)
    a_index = (table_row[:, None] + features[None, :]).flatten()  # [n_bags * in]
    a_offsets = torch.arange(len(row_of_bag), device=device) * in_features
    one_bag_each = len(row_of_bag) == n_rows
    x_rows = None if rows.all_tokens and one_bag_each else rows.tokens[row_of_bag]
    term_row = torch.repeat_interleave(torch.arange(n_rows, device=device), ranks)
    first_term = torch.cumsum(ranks, 0) - ranks  # [n_rows]
    rank_of_term = torch.arange(len(term_row), device=device) - first_term[term_row]
    whole_chunks = bool((ranks % RANK_CHUNK == 0).all())
    h_index = None if whole_chunks else first_bag[term_row] * RANK_CHUNK + rank_of_term
    b_index = rows.slots[term_row] * r_max + rank_of_term  # [n_terms]
    return RowsPlan(
        x_rows=x_rows,
        a_index=a_index.to(dtype),
        a_offsets=a_offsets.to(dtype),
        h_index=h_index,
        b_index=b_index.to(dtype),
        b_offsets=first_term.to(dtype),
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


def bucket_rank(rank: int, max_rank: int) -> int:
    """rank rounded up to a power of two, at most max_rank; 0 stays 0 (not LoRA)."""
    return 0 if rank == 0 else min(1 << (rank - 1).bit_length(), max_rank)


def _servable(model: nn.Module, module: nn.Module) -> bool:
    return module is not model.get_output_embeddings()


def _in(module: nn.Module) -> int:
    return module.spec.in_features if hasattr(module, "spec") else module.weight.shape[-1]


def _out(module: nn.Module) -> int:
    return module.spec.out_features if hasattr(module, "spec") else module.weight.shape[0]


def _refuse_unsupported(spec: AdapterSpec) -> None:
    refusals = {
        "lora_bias": "LoRA biases (lora_bias=True) are not served",
        "modules_to_save": "modules_to_save (fully trained extra modules) are not served",
        "layer_replication": "layer_replication is not served",
        "trainable_token_indices": "trainable_token_indices are not served",
    }
    for field_name, why in refusals.items():
        if getattr(spec.config, field_name, None):
            raise AdapterError(f"{spec.path}: {why}; retrain without `{field_name}`")
