"""PEFT weight methods beyond LoRA and IA3, turned into what `AdapterLayer` batches.

Each is rewritten exactly (up to fp32 rounding) as something the layer already runs:

- AdaLoRA: ΔW = B·(E ⊙ A)·α/(ranknum + 1e-5) (peft's SVD form, `ranknum` the init_r the
  adapter was created with) is a LoRA of the saved rank with A' = E ⊙ A.
- VeRA: λ_b ⊙ B_shared·(λ_d ⊙ A_shared x) is a LoRA of rank r with A' = diag(λ_d)·A[:, :in]
  and B' = diag(λ_b)·B[:out] (the shared projections are saved in the folder, or rebuilt
  from `projection_prng_key` exactly as peft does).
- LoHa: (W1a W1b) ⊙ (W2a W2b) = Σ_ij (W1a[:, i] ⊙ W2a[:, j]) (W1b[i] ⊙ W2b[j])ᵀ, a LoRA of
  rank r1·r2 (face-splitting products of the factors).
- LoKr: kron(W1, W2)·s applied to x without building it: with x viewed as [n, b, d]
  (W1 [a, b], W2 [c, d]), y = W1 · x · W2ᵀ viewed as [n, a·c]. A `RowDelta` (its own
  sub-batch of the slot's tokens), since its rank is rank(W1)·rank(W2).
- DoRA: b + m ⊙ (W x + s·B A x) / ‖W + s·BA‖_row. The per-output-channel factor
  g = m / ‖W + s·BA‖ is fixed once the adapter is loaded, so the slot gets a LoRA with B
  scaled by g and an output scale g on the base result (the bias kept unscaled); the
  norm comes from the serving process's base layer (`symbiont.client.dora` for a layer
  on the executor).

A low-rank form whose rank exceeds `max_lora_rank` is served as a `RowDelta` instead of
being refused: its own sub-batch, two small matmuls for the slot's tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F
from peft.tuners.vera.model import _kaiming_init
from peft.utils.other import get_pattern_key
from torch import nn

from symbiont.adapters.spec import PEFT_KEY_PREFIX, AdapterError, AdapterSpec
from symbiont.serve.adapters import LoraWeights, RowDelta

# Methods served here, by `AdapterSpec.method` ("lora" with use_dora counts as "dora").
WEIGHT_METHODS = ("adalora", "vera", "loha", "lokr", "dora")

_PARAM_PREFIX = {
    "adalora": "lora_",
    "vera": "vera_lambda_",
    "loha": "hada_",
    "lokr": "lokr_",
    "dora": "lora_",
}
_SHARED_KEYS = {"vera": ("base_model.vera_A", "base_model.vera_B")}


def method_of(spec: AdapterSpec) -> str:
    """The served method: DoRA is a LoRA config with use_dora."""
    return (
        "dora" if spec.method == "lora" and getattr(spec.config, "use_dora", False) else spec.method
    )


def build_modules(
    spec: AdapterSpec,
    tensors: Mapping[str, torch.Tensor],
    base_layers: Mapping[str, nn.Module],
    max_rank: int,
) -> dict[str, LoraWeights | RowDelta]:
    """Base-layer module name -> what its `AdapterLayer` slot holds, for a weight method."""
    method = method_of(spec)
    grouped = _group(spec, method, tensors)
    shared = {key: tensors[key] for key in _SHARED_KEYS.get(method, ()) if key in tensors}
    if method == "vera":
        shared = _vera_projections(spec, grouped, base_layers, shared)
    build: Callable = _BUILDERS[method]
    modules = {}
    for name, parts in grouped.items():
        if name not in base_layers:
            raise AdapterError(
                f"{spec.path}: the adapter targets {name!r}, which is not a linear layer of "
                "this model that adapters are served in; was it trained on another base?"
            )
        weights = build(spec, name, parts, base_layers[name], shared)
        if isinstance(weights, LoraWeights) and method != "dora" and weights.rank > max_rank:
            weights = low_rank_delta(weights)  # its own sub-batch rather than a refusal
        modules[name] = weights
    return modules


def low_rank_delta(weights: LoraWeights) -> RowDelta:
    """A LoRA too wide for the stacks, applied to its slot's rows on their own."""
    a, b = weights.a, weights.b * weights.scale  # [r, in], [out, r]
    return RowDelta(lambda x: F.linear(F.linear(x, a), b), _nbytes(a, b))


# -- parsing ----------------------------------------------------------------------------


def _group(spec: AdapterSpec, method: str, tensors) -> dict[str, dict[str, torch.Tensor]]:
    """{module name: {parameter: tensor}}; refuses tensors that are not the method's."""
    prefix, shared = _PARAM_PREFIX[method], _SHARED_KEYS.get(method, ())
    grouped: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        if key in shared:
            continue
        parts = key.removeprefix(PEFT_KEY_PREFIX).split(".")
        at = next((i for i, p in enumerate(parts) if i > 0 and p.startswith(prefix)), None)
        if at is None:
            raise AdapterError(
                f"{spec.path}: tensor {key!r} is not a {spec.peft_type} weight of a linear "
                "layer (embedding adapters, biases and modules_to_save are not served)"
            )
        grouped.setdefault(".".join(parts[:at]), {})[".".join(parts[at:])] = tensor
    if not grouped:
        raise AdapterError(f"{spec.path}: the adapter holds no {spec.peft_type} weights")
    return grouped


def _need(spec: AdapterSpec, name: str, parts, *wanted: str) -> list[torch.Tensor]:
    missing = [w for w in wanted if w not in parts]
    if missing:
        raise AdapterError(
            f"{spec.path}: {name} lacks {', '.join(missing)} (has {', '.join(sorted(parts))}); "
            "the adapter is incomplete, re-save it"
        )
    return [parts[w] for w in wanted]


def _pattern(config, pattern: str, name: str, default):
    table = getattr(config, pattern, None) or {}
    return table.get(get_pattern_key(table, name), default) if table else default


# -- builders, one per method -------------------------------------------------------------


def _adalora(spec, name, parts, base, shared) -> LoraWeights:
    a, b, e = _need(spec, name, parts, "lora_A", "lora_B", "lora_E")  # [r, in] [out, r] [r, 1]
    config, r = spec.config, a.shape[0]
    scaling = config.lora_alpha if config.lora_alpha > 0 else float(r)
    # peft keeps ranknum at the rank the layer was created with (init_r), also after the
    # rank pattern prunes it; the 1e-5 is peft's.
    ranknum = float(config.init_r) + 1e-5
    return LoraWeights(a * e, b, scaling / ranknum)


def _vera(spec, name, parts, base, shared) -> LoraWeights:
    lambda_b, lambda_d = _need(spec, name, parts, "vera_lambda_b", "vera_lambda_d")
    vera_a, vera_b = shared  # [r, max_in], [max_out, r]
    n_in, n_out = _features(base)
    a = lambda_d[:, None] * vera_a[:, :n_in]  # [r, in]
    b = lambda_b[:, None] * vera_b[:n_out]  # [out, r]
    return LoraWeights(a, b, 1.0)


def _vera_projections(spec, grouped, base_layers, saved) -> tuple[torch.Tensor, torch.Tensor]:
    """The shared A [r, max_in] and B [max_out, r]: saved, or rebuilt as peft builds them
    (one generator seeded with projection_prng_key, A first) over the targeted layers."""
    if len(saved) == 2:
        return saved["base_model.vera_A"], saved["base_model.vera_B"]
    if saved:
        raise AdapterError(f"{spec.path}: the adapter saves only one of vera_A and vera_B")
    dims = [_features(base_layers[name]) for name in grouped]
    max_in, max_out = max(d[0] for d in dims), max(d[1] for d in dims)
    generator = torch.Generator(device="cpu").manual_seed(spec.config.projection_prng_key)
    vera_a = _kaiming_init((spec.config.r, max_in), generator=generator)
    vera_b = _kaiming_init((max_out, spec.config.r), generator=generator)
    return vera_a, vera_b


def _loha(spec, name, parts, base, shared) -> LoraWeights:
    if "hada_t1" in parts or "hada_t2" in parts:
        raise AdapterError(
            f"{spec.path}: {name} is a LoHa with effective conv2d factors (hada_t1/t2); "
            "only linear layers are served"
        )
    w1a, w1b, w2a, w2b = _need(
        spec, name, parts, "hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b"
    )
    r = _pattern(spec.config, "rank_pattern", name, spec.config.r)
    alpha = _pattern(spec.config, "alpha_pattern", name, spec.config.alpha)
    # (W1a W1b) ⊙ (W2a W2b) = B' A' with B'[:, (i, j)] = W1a[:, i] ⊙ W2a[:, j] and
    # A'[(i, j)] = W1b[i] ⊙ W2b[j]: an exact LoRA of rank r1·r2.
    b = (w1a[:, :, None] * w2a[:, None, :]).flatten(1)  # [out, r1 * r2]
    a = (w1b[:, None, :] * w2b[None, :, :]).flatten(0, 1)  # [r1 * r2, in]
    return LoraWeights(a, b, float(alpha / r))


def _lokr(spec, name, parts, base, shared) -> RowDelta:
    if "lokr_t2" in parts:
        raise AdapterError(
            f"{spec.path}: {name} is a LoKr with effective conv2d factors (lokr_t2); only "
            "linear layers are served"
        )
    w1 = _factor(spec, name, parts, "lokr_w1")  # [a, b]
    w2 = _factor(spec, name, parts, "lokr_w2")  # [c, d]
    r = _pattern(spec.config, "rank_pattern", name, spec.config.r)
    alpha = _pattern(spec.config, "alpha_pattern", name, spec.config.alpha)
    w1 = w1 * (alpha / r)
    (a, b_), (c, d) = w1.shape, w2.shape

    def product(x: torch.Tensor) -> torch.Tensor:  # x [n, b·d] -> [n, a·c]
        y = torch.matmul(torch.matmul(w1, x.reshape(-1, b_, d)), w2.t())  # [n, a, c]
        return y.reshape(-1, a * c)

    return RowDelta(product, _nbytes(w1, w2))


def _factor(spec, name, parts, stem: str) -> torch.Tensor:
    if stem in parts:
        return parts[stem]
    a, b = _need(spec, name, parts, f"{stem}_a", f"{stem}_b")
    return a @ b


def _dora(spec, name, parts, base, shared) -> LoraWeights:
    a, b, magnitude = _need(
        spec, name, parts, "lora_A.weight", "lora_B.weight", "lora_magnitude_vector"
    )
    config, r = spec.config, a.shape[0]
    alpha = _pattern(config, "alpha_pattern", name, config.lora_alpha)
    scale = float(alpha / math.sqrt(r) if config.use_rslora else alpha / r)
    norm = _dora_weight_norm(base, a, b, scale)  # [out]
    return LoraWeights(a, b, scale, magnitude / norm)


def _dora_weight_norm(base: nn.Module, a, b, scale: float) -> torch.Tensor:
    """‖W_i + s(BA)_i‖ per output row, as peft's `get_weight_norm` computes it."""
    from symbiont.client.dora import dora_weight_norm
    from symbiont.client.virt import VirtLayer

    if isinstance(base, VirtLayer):  # W lives on the executor
        return dora_weight_norm(base, a, b, scale)
    weight = base.weight if isinstance(base, nn.Linear) else base.weight.t()  # [out, in]
    with torch.no_grad():
        return torch.linalg.norm(weight.to(a.dtype) + scale * (b @ a), dim=1)


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _features(base: nn.Module) -> tuple[int, int]:
    """(in, out) of a base layer."""
    if hasattr(base, "spec"):
        return base.spec.in_features, base.spec.out_features
    if isinstance(base, nn.Linear):
        return base.in_features, base.out_features
    return base.weight.shape[0], base.weight.shape[1]  # transformers Conv1D: [in, out]


_BUILDERS = {"adalora": _adalora, "vera": _vera, "loha": _loha, "lokr": _lokr, "dora": _dora}
