"""Compressing a fully fine-tuned model into a delta over its base (DeltaZip Algorithm 1).

Decoder layer by decoder layer, with only that layer's weights in memory (the model is a
meta-device skeleton; one layer is materialised, solved, and sent back to meta):

1. the layer gets the fine-tuned weights, and the calibration activations (the outputs of
   the layers before, already compressed) run through it while hooks accumulate each
   linear module's input Hessian `H = X Xᵀ / n`;
2. each linear weight's delta `W_ft - W_base` is solved (solver.py) and packed;
3. the layer gets `W_base + Δ̃` and the activations run through it again: they are the
   next layer's calibration inputs, so each layer corrects for the errors before it.

The output projection is solved the same way on the final norm's output. Every other
parameter that differs from the base is kept as an fp16 delta (embeddings: changed rows).
Layer inputs (attention masks, rotary embeddings, ...) are those the model's own forward
passes to each layer, recorded once by stand-ins for the decoder layers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from symbiont.delta.config import CompressConfig, Method, Sparsity
from symbiont.delta.format import (
    FORMAT,
    VERSION,
    ParamDelta,
    ParamKind,
    check_output_folder,
    write_delta,
)
from symbiont.delta.identity import base_identity
from symbiont.delta.packing import PackedLayer, pack
from symbiont.delta.solver import round_to_nearest, solve_obs
from symbiont.model.checkpoint import Checkpoint, CheckpointError
from symbiont.model.layers import is_base_layer
from symbiont.model.skeleton import build_skeleton, checkpoint_key, owner_of, set_tensor

log = logging.getLogger(__name__)

CALIB_BATCH = 16  # calibration sequences per forward
FP16_MAX = float(torch.finfo(torch.float16).max)  # parameter deltas are stored in fp16


@dataclass(frozen=True)
class LayerReport:
    """One progress line: a solved linear layer."""

    index: int  # decoder layer (num_hidden_layers for the output projection)
    total: int
    name: str
    relative_error: float  # ‖(Δ - Δ̃) X‖² / ‖Δ X‖² on the calibration inputs


def compress(
    base_path: str | Path,
    finetuned_path: str | Path,
    out: str | Path,
    calibration: torch.Tensor,
    config: CompressConfig,
    *,
    base_name: str | None = None,
    progress: Callable[[LayerReport], None] | None = None,
) -> dict:
    """Write the compressed delta of `finetuned_path` over `base_path` to `out`.

    calibration: token ids [n_sequences, seq_len]. Returns the manifest written."""
    check_output_folder(Path(out))
    base, finetuned = Checkpoint.open(base_path), Checkpoint.open(finetuned_path)
    model = build_skeleton(finetuned.config, torch.float32)
    _check_supported(model)
    check_same_shapes(base, finetuned, model)
    run = _Run(base, finetuned, model, config, progress or (lambda report: None))
    layers, params = run.solve(calibration)
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "base": base_identity(base, base_name or str(base.path)),
        "model_type": finetuned.config.model_type,
        "compression": {
            **{
                k: str(v) if isinstance(v, Sparsity | Method) else v
                for k, v in asdict(config).items()
            },
            "calibration_sequences": int(calibration.shape[0]),
            "calibration_tokens": int(calibration.numel()),
        },
        "layers": [
            {
                "name": p.name,
                "shape": list(p.shape),
                "bits": p.bits,
                "sparsity": "2:4" if p.two_four else "none",
                "group_size": p.group_size,
            }
            for p in layers
        ],
        "params": [{"name": p.name, "kind": p.kind, "shape": list(p.shape)} for p in params],
        "sizes": _sizes(model, layers, params),
    }
    return write_delta(Path(out), manifest, layers, params, zstd=config.zstd)


def _check_supported(model: nn.Module) -> None:
    other = [
        (n, m) for n, m in model.named_modules() if is_base_layer(m) and type(m) is not nn.Linear
    ]
    if other:
        name, module = other[0]
        raise CheckpointError(
            f"{type(model).__name__} projects with {type(module).__name__} layers ({name}, "
            "...); symbiont delta compresses plain nn.Linear layers only"
        )


def check_same_shapes(base: Checkpoint, finetuned: Checkpoint, model: nn.Module) -> None:
    """Refuse a fine-tuned model that is not the same architecture as the base."""
    if base.config.model_type != finetuned.config.model_type:
        raise CheckpointError(
            f"--model is a {finetuned.config.model_type!r} model and --base a "
            f"{base.config.model_type!r} model; a delta needs two checkpoints of one "
            "architecture (the base and a fine-tune of it)"
        )
    base_model = build_skeleton(base.config, torch.float32)
    ours = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    theirs = {n: tuple(t.shape) for n, t in base_model.state_dict().items()}
    for name in sorted(set(ours) | set(theirs)):
        if ours.get(name) != theirs.get(name):
            raise CheckpointError(
                f"{name} has shape {ours.get(name)} in --model {finetuned.path} but "
                f"{theirs.get(name)} in --base {base.path}; the models' shapes differ, so "
                "one is not a fine-tune of the other (was the vocabulary resized?)"
            )
    changed = _config_changes(base.config, finetuned.config)
    if changed:
        raise CheckpointError(
            f"--model {finetuned.path} changes its config against --base {base.path} "
            f"({', '.join(changed[:8])}); a delta stores weights only, so merging or serving "
            "it would run the fine-tune with the base's config: use the base's values in the "
            "fine-tune's config.json if they are what it was trained with, else serve the "
            "fine-tune as a checkpoint of its own"
        )


# config keys a fine-tune may change without changing what its weights compute
_CONFIG_NOISE = {
    "_name_or_path", "transformers_version", "dtype", "torch_dtype", "use_cache",
    "architectures", "pad_token_id", "bos_token_id", "eos_token_id", "output_attentions",
    "output_hidden_states", "return_dict", "_attn_implementation_autoset",
}  # fmt: skip


def _config_changes(base, finetuned) -> list[str]:
    """'key: base -> fine-tune' for every config value the fine-tune changed."""
    ours, theirs = base.to_dict(), finetuned.to_dict()
    return [
        f"{key}: {ours.get(key)!r} -> {theirs.get(key)!r}"
        for key in sorted(set(ours) | set(theirs))
        if key not in _CONFIG_NOISE and ours.get(key) != theirs.get(key)
    ]


def _sizes(model: nn.Module, layers: list[PackedLayer], params: list[ParamDelta]) -> dict:
    """Byte counts for `delta info`: ours vs the fp16 delta of every parameter."""
    all_params = sum(p.numel() for p in model.parameters())
    linear = sum(p.shape[0] * p.shape[1] for p in layers)
    return {
        "fp16_delta_bytes": 2 * all_params,
        "linear_fp16_bytes": 2 * linear,
        "linear_packed_bytes": sum(p.nbytes() for p in layers),
        "params_bytes": sum(p.nbytes() for p in params),
    }


class _Run:
    """One compression: the skeleton, the two checkpoints and what is solved so far."""

    def __init__(self, base, finetuned, model, config, progress) -> None:
        self.base, self.finetuned, self.model = base, finetuned, model
        self.config, self.progress = config, progress
        self.layers: list[PackedLayer] = []
        self.params: list[ParamDelta] = []

    def solve(self, calibration: torch.Tensor) -> tuple[list[PackedLayer], list[ParamDelta]]:
        decoder = decoder_layers(self.model)
        inside = {id(p) for p in decoder.parameters()}
        head = self._head_to_solve()
        outside = [(n, p) for n, p in self.model.named_parameters() if id(p) not in inside]
        for name, _ in outside:
            if head is None or name != f"{head[0]}.weight":
                self._load_param(name)
        _materialise_computed_buffers(self.model)
        hidden, layer_kwargs = _layer_inputs(self.model, decoder, calibration)
        total = len(decoder) + (head is not None)
        for index, layer in enumerate(decoder):
            prefix = _prefix_of(self.model, layer)
            hidden = self._solve_layer(index, total, layer, prefix, hidden, layer_kwargs[index])
        if head is not None:
            self._solve_head(head, hidden, total)
        return self.layers, self.params

    def _head_to_solve(self) -> tuple[str, nn.Linear, nn.Module] | None:
        """(name, output projection, final norm) when the head can be solved on calibration."""
        head = self.model.get_output_embeddings()
        norm = getattr(self.model.base_model, "norm", None)
        tied = getattr(self.model.config, "tie_word_embeddings", False)
        if not self.config.compress_lm_head or tied or norm is None:
            return None
        if type(head) is not nn.Linear:
            return None
        name = next(n for n, m in self.model.named_modules() if m is head)
        return name, head, norm

    def _solve_layer(self, index, total, layer, prefix, hidden, kwargs) -> list[torch.Tensor]:
        linears = [(f"{prefix}.{n}", m) for n, m in layer.named_modules() if type(m) is nn.Linear]
        linear_weights = {f"{name}.weight" for name, _ in linears}
        for name, _ in layer.named_parameters():
            full = f"{prefix}.{name}"
            if full in linear_weights:
                self._set(full, self._read(self.finetuned, full))
            else:
                self._load_param(full)
        hessians = _collect_hessians(
            [m for _, m in linears], lambda: _run_layer(layer, hidden, kwargs)
        )
        for name, module in linears:
            self._solve_linear(index, total, name, module, hessians[module])
        hidden = _run_layer(layer, hidden, kwargs)  # through W_base + Δ̃: the next inputs
        layer.to("meta")  # frees this layer: memory stays at one layer plus activations
        return hidden

    def _solve_head(self, head, hidden, total) -> None:
        name, module, norm = head
        self._set(f"{name}.weight", self._read(self.finetuned, f"{name}.weight"))
        with torch.no_grad():
            normed = [norm(h) for h in hidden]
        hessian = _hessian_of(normed)
        self._solve_linear(total - 1, total, name, module, hessian)

    def _solve_linear(self, index, total, name, module: nn.Linear, hessian) -> None:
        base_weight = self._read(self.base, f"{name}.weight").float()  # [out, in]
        delta = module.weight.detach().float() - base_weight
        if self.config.method == Method.OBS:
            solved = solve_obs(delta, hessian.matrix, self.config)
        else:
            solved = round_to_nearest(delta, self.config)
        approx = solved.dense()
        packed = pack(name, solved, self.config.sparsity == Sparsity.TWO_FOUR)
        self.layers.append(packed)
        module.weight.data = base_weight + approx
        error = _relative_error(delta, approx, hessian.matrix)
        self.progress(LayerReport(index, total, name, error))

    def _load_param(self, name: str) -> None:
        """Set a non-linear parameter to base + its stored fp16 delta (what merge gives)."""
        base_value = self._read(self.base, name)
        finetuned_value = self._read(self.finetuned, name)
        record = param_delta(name, base_value, finetuned_value, self._is_embedding(name))
        if record is not None:
            self.params.append(record)
        merged = base_value if record is None else record.apply_to(base_value)
        self._set(name, merged.float() if merged.is_floating_point() else merged)

    def _is_embedding(self, name: str) -> bool:
        owner, _ = owner_of(self.model, name)
        return isinstance(owner, nn.Embedding)

    def _read(self, checkpoint: Checkpoint, name: str) -> torch.Tensor:
        tensor = checkpoint.read(checkpoint_key(self.model, checkpoint, name))
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise ValueError(
                f"{name} in {checkpoint.path} holds NaN or infinite values; a delta of a "
                "broken checkpoint would serve them, fix or re-train that checkpoint"
            )
        return tensor

    def _set(self, name: str, value: torch.Tensor) -> None:
        owner, leaf = owner_of(self.model, name)
        set_tensor(owner, leaf, value.float() if value.is_floating_point() else value)


def param_delta(
    name: str, base: torch.Tensor, finetuned: torch.Tensor, embedding: bool
) -> ParamDelta | None:
    """The fp16 delta of a non-linear parameter; None if it did not change."""
    delta = finetuned.float() - base.float()
    if not bool(delta.any()):
        return None
    if float(delta.abs().max()) > FP16_MAX:
        raise ValueError(
            f"{name} changed by up to {float(delta.abs().max()):.3g}, beyond what its fp16 "
            f"delta can hold (±{FP16_MAX:g}); the fine-tune diverged, check that checkpoint"
        )
    shape = tuple(base.shape)
    if embedding and delta.dim() == 2:
        rows = delta.any(dim=1).nonzero().flatten()
        if rows.numel() < shape[0]:
            return ParamDelta(name, ParamKind.ROWS, shape, delta[rows].half(), rows)
    return ParamDelta(name, ParamKind.FULL, shape, delta.half())


def _relative_error(delta: torch.Tensor, approx: torch.Tensor, hessian: torch.Tensor) -> float:
    """‖(Δ - Δ̃) X‖² / ‖Δ X‖² from H = X Xᵀ / n: trace(E H Eᵀ) / trace(Δ H Δᵀ)."""
    error = delta - approx
    num = (error @ hessian * error).sum()
    den = (delta @ hessian * delta).sum()
    return float(num / den) if den > 0 else 0.0


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The model's stack of decoder layers (the ModuleList with num_hidden_layers entries)."""
    count = getattr(model.config, "num_hidden_layers", None)
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) == count:
            return module
    raise CheckpointError(
        f"{type(model).__name__}: found no list of {count} decoder layers; "
        "symbiont delta compresses decoder-only models with a layer stack"
    )


def _prefix_of(model: nn.Module, layer: nn.Module) -> str:
    return next(name for name, module in model.named_modules() if module is layer)


@dataclass
class _Hessian:
    matrix: torch.Tensor  # [in, in] fp32, X Xᵀ / n
    tokens: int


def _hessian_of(inputs: list[torch.Tensor]) -> _Hessian:
    width = inputs[0].shape[-1]
    total = torch.zeros(width, width, dtype=torch.float64)
    tokens = 0
    for x in inputs:
        flat = x.reshape(-1, width).double()
        total += flat.T @ flat
        tokens += flat.shape[0]
    return _Hessian((total / tokens).float(), tokens)


def _collect_hessians(modules: list[nn.Linear], run: Callable[[], object]) -> dict:
    """Run `run` once with hooks that accumulate each module's input Hessian."""
    sums = {m: [torch.zeros(m.in_features, m.in_features, dtype=torch.float64), 0] for m in modules}

    def hook(module, args):
        flat = args[0].detach().reshape(-1, module.in_features).double()  # [tokens, in]
        sums[module][0] += flat.T @ flat
        sums[module][1] += flat.shape[0]

    handles = [m.register_forward_pre_hook(hook) for m in modules]
    try:
        run()
    finally:
        for handle in handles:
            handle.remove()
    return {m: _Hessian((total / max(n, 1)).float(), n) for m, (total, n) in sums.items()}


def _run_layer(layer: nn.Module, hidden: list[torch.Tensor], kwargs: list[dict]):
    """The layer over every calibration batch -> its outputs, one per batch."""
    outputs = []
    with torch.no_grad():
        for h, kw in zip(hidden, kwargs, strict=True):
            out = layer(h, **kw)
            outputs.append(out[0] if isinstance(out, tuple) else out)
    return outputs


class _Recorder(nn.Module):
    """Stands in for a decoder layer: records what the model passes it, passes h through."""

    def __init__(self, layer: nn.Module, calls: list) -> None:
        super().__init__()
        self.calls = calls
        self.__dict__["wrapped"] = layer  # not a submodule: its meta weights stay out

    def __getattr__(self, name):  # attributes the model reads (e.g. attention_type)
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["wrapped"], name)

    def forward(self, hidden_states, *args, **kwargs):
        if args:
            raise CheckpointError("decoder layers called with positional extras are not supported")
        self.calls.append((hidden_states, kwargs))
        return hidden_states


def _layer_inputs(model, decoder: nn.ModuleList, calibration: torch.Tensor):
    """Layer 0's hidden states per batch, and each layer's keyword inputs per batch."""
    originals = list(decoder)
    calls: list[list] = [[] for _ in originals]
    for i, layer in enumerate(originals):
        decoder[i] = _Recorder(layer, calls[i])
    try:
        with torch.no_grad():
            for batch in calibration.split(CALIB_BATCH):
                model(input_ids=batch, use_cache=False)
    finally:
        for i, layer in enumerate(originals):
            decoder[i] = layer
    hidden = [h for h, _ in calls[0]]
    kwargs = [[_frozen_kwargs(kw) for _, kw in layer_calls] for layer_calls in calls]
    return hidden, kwargs


def _frozen_kwargs(kwargs: dict) -> dict:
    """Drop cache arguments: each layer is replayed alone, with no KV cache."""
    return {k: v for k, v in kwargs.items() if k not in ("past_key_values", "past_key_value")}


def _materialise_computed_buffers(model: nn.Module) -> None:
    """Buffers not in a checkpoint (rotary frequencies, ...) computed by the model's own
    init code, as from_pretrained computes them; parameters (loaded or still on the meta
    device) are marked initialised so the init code leaves them alone."""
    for module in model.modules():
        for leaf, buffer in list(module._buffers.items()):
            if buffer is not None and buffer.is_meta:
                if leaf not in module._non_persistent_buffers_set:
                    raise CheckpointError(
                        f"{type(module).__name__}.{leaf} is a persistent buffer, which "
                        "symbiont delta does not read yet; please report this model type"
                    )
                module._buffers[leaf] = torch.empty_like(buffer, device="cpu")
    for param in model.parameters():
        param._is_hf_initialized = True
    model.initialize_weights()
