"""Compressed full fine-tunes (`--delta NAME=DIR`) served per row beside adapters.

A delta takes an adapter slot, so its requests share every batch with LoRA, IA3 and
plain-base requests. Per iteration each base layer still runs once for all tokens; then,
exactly as `symbiont delta merge` + transformers would compute (within fp32 rounding):

- a linear layer's delta adds `delta_product(x, layer) = x Δ̃ᵀ` (and a bias delta) to
  the rows of the delta's tokens only (`RowDelta` in the `AdapterLayer`; the output
  layer through a hook on the kept rows, `StepContext.keep_rows`);
- a changed norm or embedding (a module the client holds) is re-run on the delta's rows
  with the merged parameters (`base + fp16 delta`, merged once at load), so any norm
  formula is served exactly.

Refused at load, with the reason: what `load_delta` refuses (another base, tampered or
truncated files, bad formats), a delta that does not fit the model, and a delta that
changes tied input/output embeddings (the output layer would need per-row weights;
serve `symbiont delta merge`'s checkpoint instead).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call

from symbiont.delta import DeltaFormatError, delta_product, load_delta
from symbiont.delta.format import CompressedDelta
from symbiont.serve.adapters import AdapterError, AdapterRegistry, AdapterWeights, RowDelta
from symbiont.serve.context import current_context

__all__ = ["DeltaServer"]


@dataclass(frozen=True)
class _Loaded:
    slot: int
    head: RowDelta | None  # the output layer's delta, applied to the kept rows
    modules: dict[str, dict[str, torch.Tensor]]  # client module -> merged parameters


class DeltaServer:
    """The deltas an engine serves; installs its hooks on first load."""

    def __init__(self, model: nn.Module, registry: AdapterRegistry):
        self.model = model
        self.registry = registry
        self.loaded: dict[str, _Loaded] = {}
        self._hooked: set[str] = set()
        self._rerunning = False  # functional_call runs the module again: its hook must pass
        self._head = model.get_output_embeddings()
        self._head_name = next(n for n, m in model.named_modules() if m is self._head)

    def load(self, name: str, folder: str | os.PathLike, base: str | os.PathLike) -> int:
        """Verify the delta against `base` and this model, then place it in a slot."""
        try:
            delta = load_delta(folder, base)
            self._check(delta)
        except (DeltaFormatError, ValueError, OSError) as err:
            raise AdapterError(f"delta {name!r} ({folder}) is refused: {err}") from err
        layers, head, modules = self._split(delta)
        slot = self.registry.add(name, AdapterWeights(str(folder), "delta", layers))
        self.loaded[name] = _Loaded(slot, head, modules)
        for module_name in modules:
            self._hook_module(module_name)
        if head is not None and self._head_name not in self._hooked:
            self._head.register_forward_hook(self._head_hook)
            self._hooked.add(self._head_name)
        return slot

    def _check(self, delta: CompressedDelta) -> None:
        modules = dict(self.model.named_modules())
        for name, layer in delta.layers.items():
            module = modules.get(name)
            width = getattr(module, "weight", None)
            if module is None or (width is not None and tuple(width.shape) != layer.shape):
                raise DeltaFormatError(
                    f"layer {name} of the delta is not a layer of this model with shape "
                    f"{list(layer.shape)}; the delta belongs to another model"
                )
        tied = getattr(self.model.config, "tie_word_embeddings", False)
        embed = self.model.get_input_embeddings()
        embed_names = {f"{n}.weight" for n, m in self.model.named_modules() if m is embed}
        if tied and embed_names & set(delta.params):
            raise DeltaFormatError(
                "it changes the embeddings, which this model ties to its output layer; "
                "serving that per request is not supported: run `symbiont delta merge` and "
                "serve the merged checkpoint"
            )

    def _split(self, delta: CompressedDelta):
        """-> (RowDelta per servable base layer, the output layer's RowDelta or None,
        merged parameters per client module)."""
        owners = dict(self.model.named_modules())
        params = dict(self.model.named_parameters())
        layer_terms: dict[str, list] = {}
        for name, layer in delta.layers.items():
            layer_terms.setdefault(name, []).append(("product", layer))
        modules: dict[str, dict[str, torch.Tensor]] = {}
        for name, param in delta.params.items():
            owner, _, leaf = name.rpartition(".")
            if owner in owners and self._is_base_layer(owner):
                layer_terms.setdefault(owner, []).append((leaf, param.delta.float()))
            elif name in params:
                with torch.no_grad():
                    merged = param.apply_to(params[name].detach())
                modules.setdefault(owner, {})[leaf] = merged
            else:
                raise DeltaFormatError(f"parameter {name} of the delta is not in this model")
        rows = {name: RowDelta(_product(terms)) for name, terms in layer_terms.items()}
        head = rows.pop(self._head_name, None)
        return rows, head, modules

    def _is_base_layer(self, name: str) -> bool:
        return name == self._head_name or self.registry.servable(name)

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
        if x.shape[1] != slots.shape[0]:
            raise RuntimeError(f"{module_name} saw {x.shape[1]} tokens, the batch has {slots}")
        for loaded in self.loaded.values():
            merged = loaded.modules.get(module_name)
            rows = (slots == loaded.slot).nonzero().flatten() if merged else None
            if rows is None or not rows.numel():
                continue
            self._rerunning = True
            try:
                output[:, rows] = functional_call(module, merged, (x[:, rows], *args[1:]), kwargs)
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
        for loaded in self.loaded.values():
            if loaded.head is None:
                continue
            rows = (slots == loaded.slot).nonzero().flatten()
            if rows.numel():
                output[0, rows] += loaded.head.product(x[rows])
        return output


def _product(terms):
    """x [n, in] -> [n, out]: the sum of a layer's delta product and bias / weight deltas."""

    def product(x: torch.Tensor) -> torch.Tensor:
        y = None
        for kind, value in terms:
            if kind == "product":
                term = delta_product(x, value)
            elif kind == "bias":
                term = value.to(x.dtype).expand(x.shape[0], -1)
            else:  # a weight kept as a plain fp16 delta (an output layer not solved)
                term = x @ value.to(x.dtype).T
            y = term if y is None else y + term
        return y

    return product
