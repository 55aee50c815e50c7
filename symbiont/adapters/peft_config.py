"""PEFT configs for training: built from `symbiont finetune` flags, or read from any PEFT
config JSON (through the one adapter reader, so both are validated alike)."""

from __future__ import annotations

import copy
import os

import peft

from symbiont.adapters.flags import AdapterFlags
from symbiont.adapters.spec import read_adapter, validate_config


def build_peft_config(spec: AdapterFlags, total_steps: int = 1000) -> peft.PeftConfig:
    """The PEFT config for `spec`, as a CAUSAL_LM task, validated as a read one would be."""
    return validate_config(_build(spec, total_steps), where="the adapter flags")


def _build(spec: AdapterFlags, total_steps: int) -> peft.PeftConfig:
    targets = _targets(spec.target)
    common = dict(task_type="CAUSAL_LM")
    alpha = spec.alpha if spec.alpha is not None else 2 * spec.r
    match spec.method:
        case "lora" | "dora":  # DoRA: its row norms come from the executor (client/dora.py)
            return peft.LoraConfig(
                r=spec.r,
                lora_alpha=alpha,
                lora_dropout=spec.dropout,
                target_modules=targets,
                use_dora=spec.method == "dora",
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
    """Any PEFT config, to train a new adapter with: a JSON file (as written by
    `PeftConfig.save_pretrained`) or an adapter folder holding `adapter_config.json` (its
    weights are not read). `task_type` defaults to CAUSAL_LM. A saved adapter's config
    says `inference_mode: true`, which would freeze the new adapter: it is turned off.
    Raises `AdapterError` (a ValueError) saying what to fix."""
    config = copy.deepcopy(read_adapter(path, require_weights=False).config)
    config.inference_mode = False
    return config


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
