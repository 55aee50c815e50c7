"""The one reader of PEFT adapters: a folder (adapter_config.json + adapter_model.safetensors)
or a bare config file, validated once into a frozen `AdapterSpec` that train, generate and
serve consume.

Validation, in order, each with an error that says what to fix: the path exists, the config
is JSON with a known `peft_type` and is a valid config for that method (peft's own check),
its scaling does not make it a no-op, it needs no base weight on the client, and the
weights file is safetensors (pickled `adapter_model.bin` is refused, never unpickled) with a
complete header. Tensor values are read only by `load_tensors`, which refuses NaN and
infinities; `check_base` compares targeted modules and shapes with a base model.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import peft
import torch
from peft.mapping import PEFT_TYPE_TO_TUNER_MAPPING
from peft.utils.other import _prepare_prompt_learning_config
from peft.utils.peft_types import PeftType
from safetensors import safe_open

from symbiont.adapters.names import (
    BASE_WEIGHT_INITS,
    CONFIG_FILE,
    KASA,
    PICKLED_WEIGHTS_FILE,
    WEIGHTS_FILE,
)

PEFT_KEY_PREFIX = "base_model.model."
_SAVE_HINT = "pass the folder that model.save_pretrained(dir) wrote"


class AdapterError(ValueError):
    """An adapter cannot be read, used or served; the message says what to fix."""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the weights file, from its header (values unread)."""

    shape: tuple[int, ...]
    dtype: str  # safetensors dtype name: "F32", "BF16", ...


@dataclass(frozen=True)
class AdapterSpec:
    """A validated PEFT adapter: its config, and where and what its weights are."""

    path: Path  # what was passed: the folder, or the bare config file
    config_file: Path
    config: peft.PeftConfig
    weights_file: Path | None = None  # None for a bare config
    size_bytes: int = 0  # of the weights file
    tensors: Mapping[str, TensorInfo] = field(default_factory=dict)  # saved key -> header info

    @property
    def peft_type(self) -> str:
        """As peft names it: "LORA", "IA3", "PREFIX_TUNING", ..."""
        return _peft_type(self.config)

    @property
    def method(self) -> str:
        """peft_type in lower case: "lora", "ia3", "prefix_tuning", ..."""
        return self.peft_type.lower()

    @property
    def base_model(self) -> str | None:
        """`base_model_name_or_path` of the config: the base it was made for, if recorded."""
        return self.config.base_model_name_or_path

    @property
    def rank(self) -> int | None:
        """The config's default rank `r`, for methods that have one."""
        return getattr(self.config, "r", None)

    @property
    def alpha(self) -> float | None:
        """The scaling numerator (`lora_alpha`, or `alpha` for LoHa/LoKr), if any."""
        return getattr(self.config, "lora_alpha", getattr(self.config, "alpha", None))

    @property
    def targets(self) -> str | tuple[str, ...] | None:
        """`target_modules` as configured: a regex/"all-linear" string, names, or None."""
        targets = getattr(self.config, "target_modules", None)
        return targets if targets is None or isinstance(targets, str) else tuple(sorted(targets))

    @property
    def modules(self) -> dict[str, dict[str, TensorInfo]]:
        """Adapted module (its name in the base model) -> its parameters' header info."""
        prefix = getattr(PEFT_TYPE_TO_TUNER_MAPPING.get(self.peft_type), "prefix", None)
        grouped: dict[str, dict[str, TensorInfo]] = {}
        for key, info in self.tensors.items():
            split = _split_key(key, prefix)
            if split is not None:
                grouped.setdefault(split[0], {})[split[1]] = info
        return grouped

    @property
    def ranks(self) -> dict[str, int]:
        """Per adapted module, the rank its saved tensors have (LoRA, AdaLoRA, LoHa)."""
        found = {}
        for name, params in self.modules.items():
            a = params.get("lora_A.weight") or params.get("lora_A") or params.get("hada_w1_b")
            if a is not None:
                found[name] = a.shape[0]
        return found

    def load_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor of the weights file, on CPU, checked finite."""
        if self.weights_file is None:
            raise AdapterError(
                f"{self.path} is a bare config without weights; {_SAVE_HINT} instead"
            )
        try:
            with safe_open(self.weights_file, framework="pt") as handle:
                tensors = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118
        except Exception as err:  # safetensors raises its own types for bad bytes
            raise AdapterError(
                f"{self.path}: cannot read the adapter weights {self.weights_file.name}: {err}; "
                "re-save or re-copy the adapter"
            ) from err
        for key, tensor in tensors.items():
            if tensor.is_floating_point() and not torch.isfinite(tensor).all():
                raise AdapterError(
                    f"{self.path}: tensor {key!r} holds NaN or infinite values; the adapter is "
                    "broken (retrain it, e.g. with a lower learning rate)"
                )
        return tensors

    def check_base(self, base: Any) -> None:
        """Refuse an adapter whose modules or shapes do not exist in `base`: a Manifest,
        a Checkpoint or checkpoint folder, a model (nn.Module), or LayerSpecs."""
        from symbiont.adapters.base import base_layers, base_model_config

        layers = base_layers(base)
        for name, params in self.modules.items():
            want = _implied_shape(params)
            if want is None:
                continue  # not a linear-layer parameter (embeddings): peft checks those
            if name not in layers:
                raise AdapterError(
                    f"{self.path}: the adapter targets {name!r}, which is not a linear layer of "
                    f"this model; was it trained on another base?{self._made_for()}"
                )
            self._check_shape(name, params, want, layers[name])
        self.check_prompt_learning(base_model_config(base))

    def _check_shape(self, name, params, want, have: tuple[int, int]) -> None:
        if all(w is None or w == h for w, h in zip(want, have, strict=True)):
            return
        saved = ", ".join(f"{p} {list(i.shape)}" for p, i in sorted(params.items()))
        raise AdapterError(
            f"{self.path}: {name} does not fit the base: the adapter's {saved} need a layer "
            f"of in={_dim(want[0])}, out={_dim(want[1])}; the base layer has in={have[0]}, "
            f"out={have[1]}. The adapter was made for another base.{self._made_for()}"
        )

    def check_prompt_learning(self, model_config) -> None:
        """Compare a prompt-learning config with what peft derives from the base's
        transformers config (its own rule, GQA included); other methods pass."""
        if model_config is None or not isinstance(self.config, peft.PromptLearningConfig):
            return
        derived = copy.copy(self.config)
        derived.num_layers = derived.token_dim = derived.num_attention_heads = None
        _prepare_prompt_learning_config(derived, model_config)
        for name in ("num_layers", "token_dim", "num_attention_heads"):
            got, want = getattr(self.config, name), getattr(derived, name)
            if got is not None and got != want:
                raise AdapterError(
                    f"{self.path}: the adapter's {name} is {got}, this base needs {want}; the "
                    f"adapter was made for another base.{self._made_for()}"
                )

    def _made_for(self) -> str:
        return f" It names base_model_name_or_path {self.base_model!r}." if self.base_model else ""


def read_adapter(path: str | os.PathLike, *, require_weights: bool = True) -> AdapterSpec:
    """Read and validate an adapter folder, or a bare config file (then without weights).
    With `require_weights=False` a folder's weights are neither required nor read."""
    path = Path(path).expanduser()
    if path.is_dir():
        config_file = path / CONFIG_FILE
        if not config_file.is_file():
            if (path / "manifest.json").is_file():  # symbiont/delta/format.py's MANIFEST
                raise AdapterError(
                    f"{path} is a compressed delta (it has manifest.json), not a PEFT "
                    "adapter: serve it with --delta NAME=DIR"
                )
            raise AdapterError(
                f"{path} has no {CONFIG_FILE}, so it is not a PEFT adapter folder; {_SAVE_HINT}"
            )
        _refuse_links_out(path, config_file)
    elif path.is_file():
        config_file, require_weights = path, False
    else:
        raise AdapterError(
            f"adapter folder {path} does not exist (no {CONFIG_FILE} to read); {_SAVE_HINT}"
        )
    config = validate_config(_parse_config(config_file), where=str(config_file))
    spec = AdapterSpec(path, config_file, config)
    if not require_weights:
        return spec
    _refuse_links_out(path, path / WEIGHTS_FILE)
    weights_file, tensors = _read_header(path)
    return AdapterSpec(
        path, config_file, config, weights_file, weights_file.stat().st_size, tensors
    )


def validate_config(config: peft.PeftConfig, where: str = "the PEFT config") -> peft.PeftConfig:
    """Refuse configs that make the adapter a no-op or need the base weights on the client."""
    _refuse_no_op(config, where)
    _refuse_base_weight_methods(config, where)
    return config


def _parse_config(file: Path) -> peft.PeftConfig:
    try:
        record = json.loads(file.read_text(encoding="utf-8"))
    except OSError as err:
        raise AdapterError(f"cannot read PEFT config {file}: {err.strerror or err}") from err
    except UnicodeDecodeError as err:
        raise AdapterError(f"{file} is not text (not a PEFT config JSON file)") from err
    except json.JSONDecodeError as err:
        raise AdapterError(f"{file}:{err.lineno}: not valid JSON ({err.msg})") from err
    if not isinstance(record, dict) or "peft_type" not in record:
        raise AdapterError(
            f'{file}: a PEFT config needs a \'peft_type\' field (e.g. "LORA", "IA3", '
            '"PREFIX_TUNING"); write one with PeftConfig.save_pretrained'
        )
    known = [t.value for t in PeftType]
    if record["peft_type"] not in known:
        raise AdapterError(
            f"{file}: unknown peft_type {record['peft_type']!r}; peft {peft.__version__} knows "
            f"{', '.join(known)} (upgrade peft if a newer one saved it)"
        )
    record.setdefault("task_type", "CAUSAL_LM")
    # Before peft builds the config: some refused inits need extra packages to build
    # (LoftQ: scipy), and the refusal, not an ImportError, is the answer.
    _refuse_base_weight_methods(SimpleNamespace(**record), str(file))
    try:
        return peft.PeftConfig.from_peft_type(**record)
    except (TypeError, ValueError, KeyError) as err:
        raise AdapterError(f"{file}: not a valid {record['peft_type']} config: {err}") from err


def _refuse_no_op(config: peft.PeftConfig, where: str) -> None:
    for field_name in ("lora_alpha", "alpha"):
        alpha = getattr(config, field_name, None)
        if alpha is not None and alpha == 0:
            raise AdapterError(
                f"{where}: {field_name} is 0, so the adapter's scale {field_name} / r is 0 and "
                f"it changes nothing; set {field_name} above 0 (symbiont finetune: --alpha, "
                "default 2 * r)"
            )
    for pattern in ("alpha_pattern", "rank_pattern"):
        for module, value in (getattr(config, pattern, None) or {}).items():
            if value == 0:
                raise AdapterError(
                    f"{where}: {pattern} sets {module!r} to 0, which makes the adapter a no-op "
                    "there; remove the entry or give it a positive value"
                )
    r = getattr(config, "r", None)
    if isinstance(r, int) and r < 1:
        raise AdapterError(f"{where}: r is {r}; an adapter needs rank r >= 1")


def _refuse_base_weight_methods(config: peft.PeftConfig, where: str) -> None:
    bias = getattr(config, "bias", "none")
    if isinstance(bias, str) and bias != "none":  # LoRA-family bias='all' | 'lora_only'
        raise AdapterError(
            f"{where}: bias={bias!r} trains the base layers' biases, but in split execution "
            "the executor adds the frozen biases, shared by every tenant, so the adapter's "
            "biases would be silently ignored. Use bias='none' (the LoRA default)"
        )
    feature = None
    init = getattr(config, "init_lora_weights", None)
    if getattr(config, "kasa_config", None):
        feature = KASA
    elif isinstance(init, str):
        feature = next(
            (f for k, f in BASE_WEIGHT_INITS.items() if init.lower().startswith(k)), None
        )
    if feature is not None:
        raise AdapterError(
            f"{where}: {feature} needs the frozen base weights on the client: it initialises "
            "the adapter from them, and where it moves part of W into the adapter (PiSSA, "
            "OLoRA, CorDA, LoftQ, LoRA-GA, KaSA) it rewrites W. But the base is shared: every "
            "tenant of the executor computes with the same frozen weights, which stay there "
            "and which no tenant may change. Initialise the adapter without the base "
            "(init_lora_weights=True or 'gaussian'); see docs/compatibility.md"
        )


def _refuse_links_out(folder: Path, file: Path) -> None:
    """A server loads adapters only from folders it was told to trust; a file of the folder
    that is a link to elsewhere would let a tenant's folder read any file of the host."""
    if file.exists() and not file.resolve().is_relative_to(folder.resolve()):
        raise AdapterError(
            f"{file} is a link that leaves the adapter folder {folder}; copy the file into "
            "the folder instead of linking to it"
        )


def _read_header(folder: Path) -> tuple[Path, dict[str, TensorInfo]]:
    file = folder / WEIGHTS_FILE
    if not file.is_file():
        if (folder / PICKLED_WEIGHTS_FILE).is_file():
            raise AdapterError(
                f"{folder} holds pickled weights ({PICKLED_WEIGHTS_FILE}), which symbiont never "
                "unpickles (a pickle can run code); re-save the adapter with "
                "model.save_pretrained(dir, safe_serialization=True) to get "
                f"{WEIGHTS_FILE}"
            )
        raise AdapterError(f"{folder} has no {WEIGHTS_FILE}; {_SAVE_HINT}")
    try:
        with safe_open(file, framework="pt") as handle:
            tensors = {
                key: TensorInfo(tuple(s.get_shape()), s.get_dtype())
                for key in handle.keys()  # noqa: SIM118 - a safe_open handle is no dict
                for s in [handle.get_slice(key)]
            }
    except Exception as err:  # safetensors raises its own types for bad bytes
        raise AdapterError(
            f"{folder}: cannot read the adapter weights {WEIGHTS_FILE} (truncated or not "
            f"safetensors: {err}); re-save or re-copy the adapter"
        ) from err
    return file, tensors


def _peft_type(config: peft.PeftConfig) -> str:
    return str(getattr(config.peft_type, "value", config.peft_type))


def _split_key(key: str, prefix: str | None) -> tuple[str, str] | None:
    """("model.layers.0.mlp.up_proj", "lora_A.weight") from a saved key, or None when
    the key is not a per-module parameter of the method (shared or extra tensors)."""
    if prefix is None:
        return None
    parts = key.removeprefix(PEFT_KEY_PREFIX).split(".")
    for i, part in enumerate(parts):
        if part.startswith(prefix) and i > 0:
            return ".".join(parts[:i]), ".".join(parts[i:])
    return None


def _implied_shape(params: Mapping[str, TensorInfo]) -> tuple[int | None, int | None] | None:
    """(in_features, out_features) of the linear layer these parameters fit; None entries
    are not implied. None when they are no linear-layer parameters we know."""
    shapes = {name: info.shape for name, info in params.items()}
    if (
        "lora_A.weight" in shapes or "lora_B.weight" in shapes
    ):  # LoRA, AdaLoRA: A [r, in], B [out, r]
        return _dim_of(shapes, "lora_A.weight", 1), _dim_of(shapes, "lora_B.weight", 0)
    if "lora_A" in shapes or "lora_B" in shapes:  # AdaLoRA: A [r, in], B [out, r]
        return _dim_of(shapes, "lora_A", 1), _dim_of(shapes, "lora_B", 0)
    if "ia3_l" in shapes:  # [1, in] on feed-forward layers, else [out, 1]
        s = shapes["ia3_l"]
        return (s[1], None) if len(s) == 2 and s[0] == 1 and s[1] != 1 else (None, s[0])
    if "hada_w1_a" in shapes:  # LoHa: w_a [out, r], w_b [r, in]
        return _dim_of(shapes, "hada_w1_b", 1), _dim_of(shapes, "hada_w1_a", 0)
    if any(k.startswith("lokr_w") for k in shapes):  # LoKr: out = a·c, in = b·d
        w1, w2 = _kron_factor(shapes, "lokr_w1"), _kron_factor(shapes, "lokr_w2")
        if w1 and w2:
            return w1[1] * w2[1], w1[0] * w2[0]
        return None
    if "vera_lambda_b" in shapes:  # [out]
        return None, shapes["vera_lambda_b"][0]
    return None


def _dim_of(shapes, name: str, axis: int) -> int | None:
    shape = shapes.get(name)
    return shape[axis] if shape is not None and len(shape) == 2 else None


def _kron_factor(shapes, stem: str) -> tuple[int, int] | None:
    if stem in shapes and len(shapes[stem]) == 2:
        return tuple(shapes[stem])
    a, b = shapes.get(f"{stem}_a"), shapes.get(f"{stem}_b")
    if a is not None and b is not None and len(a) == 2 and len(b) == 2:
        return a[0], b[1]
    return None


def _dim(value: int | None) -> str:
    return "any" if value is None else str(value)
