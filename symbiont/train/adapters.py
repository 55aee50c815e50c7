"""PEFT configs from command-line flags or from a JSON file of any PEFT method."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import peft

METHODS = ("lora", "ia3", "loha", "lokr", "vera", "adalora", "prefix", "prompt")


@dataclass(frozen=True)
class AdapterSpec:
    """The adapter flags of `symbiont finetune`."""

    method: str = "lora"
    r: int = 16
    alpha: float | None = None  # LoRA-style scaling numerator; default 2 * r
    dropout: float = 0.0
    target: str | None = None  # "all-linear", comma-separated module names, or None (PEFT default)
    virtual_tokens: int = 16  # prefix / prompt tuning

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown method {self.method!r}; choose one of {', '.join(METHODS)}")
        if self.r < 1 or self.virtual_tokens < 1:
            raise ValueError("r and virtual_tokens must be >= 1")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")


def build_peft_config(spec: AdapterSpec, total_steps: int = 1000) -> peft.PeftConfig:
    """The PEFT config for `spec`, as a CAUSAL_LM task."""
    targets = _targets(spec.target)
    common = dict(task_type="CAUSAL_LM")
    alpha = spec.alpha if spec.alpha is not None else 2 * spec.r
    match spec.method:
        case "lora":
            return peft.LoraConfig(
                r=spec.r,
                lora_alpha=alpha,
                lora_dropout=spec.dropout,
                target_modules=targets,
                **common,
            )
        case "adalora":
            return peft.AdaLoraConfig(
                init_r=spec.r, target_r=max(1, spec.r // 2), total_step=total_steps,
                lora_alpha=alpha, target_modules=targets, **common,
            )  # fmt: skip
        case "ia3":
            return peft.IA3Config(target_modules=targets, **_ia3_feedforward(targets), **common)
        case "loha":
            return peft.LoHaConfig(r=spec.r, alpha=alpha, target_modules=targets, **common)
        case "lokr":
            return peft.LoKrConfig(r=spec.r, alpha=alpha, target_modules=targets, **common)
        case "vera":
            return peft.VeraConfig(r=spec.r, target_modules=targets, **common)
        case "prefix":
            return peft.PrefixTuningConfig(num_virtual_tokens=spec.virtual_tokens, **common)
        case _:  # "prompt"
            return peft.PromptTuningConfig(num_virtual_tokens=spec.virtual_tokens, **common)


def load_peft_config(path: str | os.PathLike) -> peft.PeftConfig:
    """Any PEFT config: a JSON file (as written by `PeftConfig.save_pretrained`) or an
    adapter folder holding `adapter_config.json`. `task_type` defaults to CAUSAL_LM."""
    path = Path(path)
    file = path / "adapter_config.json" if path.is_dir() else path
    try:
        record = json.loads(file.read_text(encoding="utf-8"))
    except OSError as err:
        raise ValueError(f"cannot read PEFT config {file}: {err.strerror or err}") from err
    except json.JSONDecodeError as err:
        raise ValueError(f"{file}:{err.lineno}: not valid JSON ({err.msg})") from err
    if not isinstance(record, dict) or "peft_type" not in record:
        raise ValueError(
            f'{file}: a PEFT config needs a \'peft_type\' field (e.g. "LORA", "IA3", '
            '"PREFIX_TUNING"); write one with PeftConfig.save_pretrained'
        )
    record.setdefault("task_type", "CAUSAL_LM")
    try:
        return peft.get_peft_config(record)
    except (TypeError, ValueError, KeyError) as err:
        raise ValueError(f"{file}: not a valid PEFT config: {err}") from err


def _targets(target: str | None) -> str | list[str] | None:
    if target is None or target == "all-linear":
        return target
    names = [name.strip() for name in target.split(",") if name.strip()]
    if not names:
        raise ValueError("--target must be 'all-linear' or comma-separated module names")
    return names


_FEEDFORWARD_HINTS = ("mlp", "fc", "ffn", "down_proj", "up_proj", "gate_proj", "w1", "w2", "w3")


def _ia3_feedforward(targets) -> dict:
    """IA3 scales the input of feed-forward layers; with explicit targets, pick those that
    look like MLP layers. With None or all-linear, PEFT's per-architecture default applies."""
    if not isinstance(targets, list):
        return {}
    return {"feedforward_modules": [t for t in targets if any(h in t for h in _FEEDFORWARD_HINTS)]}
