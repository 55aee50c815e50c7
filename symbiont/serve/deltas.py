"""Compressed full fine-tunes served per row beside adapters (`--delta`, `--adapter-dir`).

A delta takes an adapter slot, so its requests share every batch with LoRA, IA3 and
plain-base requests. Per iteration each base layer still runs once for all tokens; then,
exactly as `symbiont delta merge` + transformers would compute (within fp32 rounding):

- a linear layer's delta adds `x Δ̃ᵀ` (and a bias delta) to the rows of the delta's
  tokens only (`RowDelta` in the `AdapterLayer`; the output layer through a hook on the
  kept rows, `StepContext.keep_rows`);
- a changed norm or embedding (a module the client holds) is re-run on the delta's rows
  with the merged parameters (`base + fp16 delta`, merged once at load), so any norm
  formula is served exactly.

Two ways to apply, chosen per delta (`DeltaMode`):

- `exact`: `x Δ̃ᵀ` from the packed 2:4 low-bit layer, decompressed at every call; holds
  only the compressed bytes (about a tenth of the fp16 delta).
- `merged` ("hot"): Δ̃ decompressed once at load into a dense matrix of the model's dtype,
  so a call is one matmul. In a batch shared with other variants this is the merged
  weight's honest form: the base output is computed for every row anyway, and
  `x (W_base + Δ̃)ᵀ = x W_baseᵀ + x Δ̃ᵀ`; the weight itself is never needed here (it may
  live on a remote executor). It holds a dense delta per layer (the size of the base's
  linear weights), so `--max-deltas` bounds how many are resident.

Refused at load, with the reason: what `load_delta` refuses (another base, tampered or
truncated files, bad formats), a delta that does not fit the model, and a delta that
changes tied input/output embeddings (the output layer would need per-row weights;
serve `symbiont delta merge`'s checkpoint instead).

Slots: `place(slot, weights)` (engine thread) makes a parsed delta's hooks see its slot;
`evict(slot)` forgets it. Deltas given with `--delta` are placed once and stay; deltas of
`--adapter-dir` come and go with the adapter cache (`symbiont.serve.adapter_cache`).
"""

from __future__ import annotations

import os
import threading
import weakref
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call

from symbiont.client.virt import BaseWeightUnavailable
from symbiont.delta import DeltaFormatError, delta_product, load_delta
from symbiont.delta.format import MANIFEST, CompressedDelta, read_manifest
from symbiont.delta.identity import check_base
from symbiont.model.checkpoint import Checkpoint
from symbiont.serve.adapters import AdapterError, AdapterRegistry, AdapterWeights, RowDelta
from symbiont.serve.config import DeltaMode
from symbiont.serve.context import current_context

__all__ = ["DeltaServer", "DeltaWeights", "is_delta_folder"]


@dataclass(frozen=True)
class DeltaWeights(AdapterWeights):
    """A parsed, verified delta: `modules` holds a `RowDelta` per servable base layer."""

    mode: DeltaMode
    head: RowDelta | None  # the output layer's delta, applied to the kept rows
    params: dict[str, dict[str, torch.Tensor]]  # client module -> merged parameters
    nbytes: int  # what it holds in memory (packed layers, dense ones when merged, params)


def is_delta_folder(path: str | os.PathLike) -> bool:
    """Whether `path` holds a delta's manifest (what `symbiont delta compress` writes)."""
    return os.path.isfile(os.path.join(path, MANIFEST))


_SERVERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_SERVERS_LOCK = threading.Lock()  # the cache's loader threads may ask first


class DeltaServer:
    """The deltas an engine serves; installs its hooks on first placement."""

    @classmethod
    def of(cls, registry: AdapterRegistry) -> DeltaServer:
        """The one DeltaServer of `registry`'s model (pinned and cached deltas share it)."""
        with _SERVERS_LOCK:
            server = _SERVERS.get(registry)
            if server is None:
                server = _SERVERS[registry] = cls(registry.model, registry)
            return server

    def __init__(self, model: nn.Module, registry: AdapterRegistry):
        self.model = model
        self.registry = registry
        self.loaded: dict[str, int] = {}  # --delta name -> slot
        self.by_slot: dict[int, DeltaWeights] = {}  # placed deltas (pinned and cached)
        self._hooked: set[str] = set()
        self._rerunning = False  # functional_call runs the module again: its hook must pass
        self._head = model.get_output_embeddings()
        self._head_name = next(n for n, m in model.named_modules() if m is self._head)
        self._fingerprint: str | None = None

    @property
    def base(self) -> str:
        """The checkpoint folder the served model was loaded from."""
        return self.model.name_or_path

    # -- reading (any thread) -----------------------------------------------------------

    def inspect(self, folder: str | os.PathLike) -> int:
        """Check a delta folder's manifest against this base and model without reading its
        data (what an `--adapter-dir` scan runs); -> bytes of its data file."""
        try:
            manifest = read_manifest(folder)  # names, shapes and sizes of the right types
            check_base(manifest, self._checkpoint(), full=False)
            for entry in manifest["layers"]:
                self._check_layer(entry["name"], tuple(entry["shape"]))
            params = dict(self.model.named_parameters())
            for entry in manifest["params"]:
                self._check_param(params, entry["name"], tuple(entry["shape"]))
        except (DeltaFormatError, ValueError, OSError) as err:
            raise AdapterError(f"delta {folder} is refused: {err}") from err
        return sum(meta["bytes"] for meta in manifest["files"].values())

    def parse(
        self, folder: str | os.PathLike, mode: DeltaMode, base: str | os.PathLike | None = None
    ) -> DeltaWeights:
        """Read and verify a delta folder (hashes, against `base`, default the served
        checkpoint; shapes) -> its weights, not placed."""
        try:
            delta = load_delta(folder, base or self.base)
            self._check(delta)
            return self._split(delta, DeltaMode(mode))
        except (DeltaFormatError, ValueError, OSError) as err:
            raise AdapterError(f"delta {folder} is refused: {err}") from err

    def _checkpoint(self) -> Checkpoint:
        return Checkpoint.open(self.base)

    def _check_layer(self, name: str, shape: tuple) -> None:
        """A packed layer's delta must be one of the base layers the engine applies
        adapters in (or the output layer), with its [out, in] shape."""
        if self._base_shape(name) != shape:
            raise DeltaFormatError(
                f"layer {name} of the delta is not a linear layer of this model with shape "
                f"{list(shape)}; the delta belongs to another model"
            )

    def _check_param(self, params: dict, name: str, shape: tuple) -> None:
        """A parameter's delta must be a weight or bias of a base layer, or a parameter
        the client holds (norms, embeddings), with the parameter's shape."""
        owner, _, leaf = name.rpartition(".")
        want = None
        layer = self._base_shape(owner)
        if layer is not None:
            want = {"weight": layer, "bias": layer[:1]}.get(leaf)
        elif name in params:
            want = tuple(params[name].shape)
        if want != shape:
            got = "missing" if want is None else list(want)
            raise DeltaFormatError(
                f"parameter {name} is {got} in this model, {list(shape)} in the delta; the "
                "delta belongs to another model"
            )

    def _check(self, delta: CompressedDelta) -> None:
        for name, layer in delta.layers.items():
            self._check_layer(name, layer.shape)
        params = dict(self.model.named_parameters())
        for name, param in delta.params.items():
            self._check_param(params, name, param.shape)
        tied = getattr(self.model.config, "tie_word_embeddings", False)
        embed = self.model.get_input_embeddings()
        embed_names = {f"{n}.weight" for n, m in self.model.named_modules() if m is embed}
        if tied and embed_names & set(delta.params):
            raise DeltaFormatError(
                "it changes the embeddings, which this model ties to its output layer; "
                "serving that per request is not supported: run `symbiont delta merge` and "
                "serve the merged checkpoint"
            )

    def _split(self, delta: CompressedDelta, mode: DeltaMode) -> DeltaWeights:
        """RowDelta per servable base layer, the output layer's RowDelta or None, merged
        parameters per client module."""
        owners = dict(self.model.named_modules())
        params = dict(self.model.named_parameters())
        dtype = self.model.get_input_embeddings().weight.dtype
        layer_terms: dict[str, list] = {}
        nbytes = 0
        for name, layer in delta.layers.items():
            if mode is DeltaMode.MERGED:  # decompressed once: one matmul per call
                dense = layer.dense(dtype)
                layer_terms.setdefault(name, []).append(("weight", dense))
                nbytes += dense.numel() * dense.element_size()
            else:  # the mask decoded once into kept positions: the same bytes
                serving = layer.serving()
                layer_terms.setdefault(name, []).append(("product", serving))
                nbytes += serving.nbytes()
        modules: dict[str, dict[str, torch.Tensor]] = {}
        for name, param in delta.params.items():
            owner, _, leaf = name.rpartition(".")
            nbytes += param.nbytes()
            if owner in owners and self._is_base_layer(owner):
                layer_terms.setdefault(owner, []).append((leaf, param.delta.to(dtype)))
            elif name in params:
                try:
                    with torch.no_grad():
                        merged = param.apply_to(params[name].detach())
                except BaseWeightUnavailable as err:  # an MoE's experts, on the executor
                    raise DeltaFormatError(
                        f"it changes {name}, a weight that stays on the base executor (the "
                        "experts of a mixture-of-experts layer); serving that per request is "
                        "not supported: run `symbiont delta merge` and serve the merged "
                        "checkpoint"
                    ) from err
                modules.setdefault(owner, {})[leaf] = merged
            else:
                raise DeltaFormatError(f"parameter {name} of the delta is not in this model")
        rows = {name: RowDelta(_product(terms)) for name, terms in layer_terms.items()}
        head = rows.pop(self._head_name, None)
        return DeltaWeights(str(delta.path), "delta", rows, mode, head, modules, nbytes)

    def _is_base_layer(self, name: str) -> bool:
        return name == self._head_name or self.registry.servable(name)

    def _base_shape(self, name: str) -> tuple[int, ...] | None:
        """[out, in] of a base layer (or the output layer) named `name`, else None."""
        if name == self._head_name:
            weight = getattr(self._head, "weight", None)
            return tuple(weight.shape) if isinstance(weight, torch.Tensor) else None
        return self.registry.base_shape(name)

    # -- slots (engine thread) ----------------------------------------------------------

    def load(
        self,
        name: str,
        folder: str | os.PathLike,
        mode: DeltaMode,
        base: str | os.PathLike | None = None,
    ) -> int:
        """A `--delta`: verify it, then place it in a slot it keeps; -> the slot."""
        limit = self.registry.config.max_deltas
        if limit is not None and len(self.by_slot) >= limit:
            raise AdapterError(
                f"delta {name!r}: {limit} deltas are resident already (--max-deltas {limit}); "
                "raise --max-deltas or serve fewer deltas"
            )
        try:
            weights = self.parse(folder, mode, base)
        except AdapterError as err:
            raise AdapterError(f"delta {name!r} ({folder}): {err}") from err
        slot = self.registry.add(name, weights)
        self.place(slot, weights)
        self.loaded[name] = slot
        return slot

    def place(self, slot: int, weights: DeltaWeights) -> None:
        """Let the hooks apply `weights` to the rows of `slot` (its base layers' terms are
        already in the AdapterLayers: `AdapterRegistry.add`)."""
        for module_name in weights.params:
            self._hook_module(module_name)
        if weights.head is not None and self._head_name not in self._hooked:
            self._head.register_forward_hook(self._head_hook)
            self._hooked.add(self._head_name)
        self.by_slot[slot] = weights

    def evict(self, slot: int) -> None:
        self.by_slot.pop(slot, None)

    @property
    def num_resident(self) -> int:
        return len(self.by_slot)

    # -- per-row application ------------------------------------------------------------

    def _hook_module(self, module_name: str) -> None:
        if module_name in self._hooked:
            return
        module = dict(self.model.named_modules())[module_name]

        def rerun(module, args, kwargs, output, module_name=module_name):
            return self._rerun_rows(module_name, module, args, kwargs, output)

        module.register_forward_hook(rerun, with_kwargs=True)
        self._hooked.add(module_name)

    def _rerun_rows(self, module_name, module, args, kwargs, output):
        """Recompute the rows of every delta that changes this module with its merged
        parameters. args[0] and output: [1, n_tokens, ...]"""
        ctx = current_context()
        if ctx is None or self._rerunning:
            return output
        slots = ctx.adapters.token_slots  # [n_tokens]
        x = args[0]
        # tokens on axis 1 of [1, n_tokens, ...]; token ids alone ([n_tokens]: the embedding
        # when virtual tokens are put in, model_runner.py) have them on axis 0
        axis = 0 if x.dim() == 1 else 1
        if x.shape[axis] != slots.shape[0]:
            raise RuntimeError(
                f"{module_name} saw {x.shape[axis]} tokens, the batch has {slots.shape[0]}"
            )
        for slot, weights in self.by_slot.items():
            merged = weights.params.get(module_name)
            rows = (slots == slot).nonzero().flatten() if merged else None
            if rows is None or not rows.numel():
                continue
            at = (slice(None),) * axis + (rows,)
            self._rerunning = True
            try:
                output[at] = functional_call(module, merged, (x[at], *args[1:]), kwargs)
            finally:
                self._rerunning = False
        return output

    def _head_hook(self, module, args, output):
        """The output layer's delta on the kept rows. args[0] [1, n_keep, hidden]"""
        ctx = current_context()
        if ctx is None:
            return output
        slots = ctx.adapters.token_slots[ctx.keep_rows]  # [n_keep]
        x = args[0][0]
        for slot, weights in self.by_slot.items():
            if weights.head is None:
                continue
            rows = (slots == slot).nonzero().flatten()
            if rows.numel():
                output[0, rows] += weights.head.product(x[rows])
        return output


def _product(terms):
    """x [n, in] -> [n, out]: the sum of a layer's delta product and bias / weight deltas."""

    def product(x: torch.Tensor) -> torch.Tensor:
        y = None
        for kind, value in terms:
            if kind == "product":  # exact: decompressed at each call
                term = delta_product(x, value)
            elif kind == "bias":
                term = value.to(x.dtype).expand(x.shape[0], -1)
            else:  # a dense weight delta: merged mode, or an output layer kept as fp16
                term = x @ value.to(x.dtype).T
            y = term if y is None else y + term
        return y

    return product
