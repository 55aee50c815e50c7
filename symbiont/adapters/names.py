"""File names, method names and refusal tables of PEFT adapters; no heavy imports, so the
CLI can build its flags from them without loading torch."""

from __future__ import annotations

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLED_WEIGHTS_FILE = "adapter_model.bin"  # refused, never unpickled

# The methods `symbiont finetune --method` builds from flags.
METHODS = ("lora", "dora", "ia3", "loha", "lokr", "vera", "adalora", "prefix", "prompt")
# The methods a fine-tuning job of `serve --jobs-dir` trains: weight methods, which the
# engine batches and the windowed job step can cut anywhere. AdaLoRA needs its rank
# budget schedule, and prompt learning adds positions the windowed step does not have.
JOB_METHODS = ("lora", "dora", "ia3", "loha", "lokr", "vera")

# Config settings whose method reads or rewrites the frozen base weight, which a split
# client never holds: (config field, predicate on its value, the feature to name).
# The client's RemoteWeight names the same features when one slips through at run time.
BASE_WEIGHT_INITS = {
    "pissa": "PiSSA initialisation (init_lora_weights='pissa')",
    "corda": "CorDA initialisation (init_lora_weights='corda')",
    "olora": "OLoRA initialisation (init_lora_weights='olora')",
    "mica": "MiCA initialisation (init_lora_weights='mica')",
    "loftq": "LoftQ initialisation (init_lora_weights='loftq')",
    "eva": "EVA initialisation (init_lora_weights='eva')",
    "lora_ga": "LoRA-GA initialisation (init_lora_weights='lora_ga')",
}
KASA = "KaSA (LoraConfig(kasa_config=...))"
