"""Fine-tuning on a client model: data, the training loop, atomic checkpoints and resume.

Names load on first use (`symbiont finetune --help` must not import torch)."""

from symbiont.util.lazy import lazy_exports

_EXPORTS = {
    **dict.fromkeys(
        ["AdapterFlags", "build_peft_config", "load_peft_config"], "symbiont.adapters.peft_config"
    ),
    **dict.fromkeys(
        ["TrainState", "latest_checkpoint", "list_checkpoints"], "symbiont.train.checkpoints"
    ),
    "TrainConfig": "symbiont.train.config",
    **dict.fromkeys(
        [
            "DataError",
            "Example",
            "collate",
            "load_examples",
            "pad_id",
            "read_records",
            "tokenize_records",
        ],
        "symbiont.train.data",
    ),
    **dict.fromkeys(["TrainResult", "evaluate", "train"], "symbiont.train.loop"),
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
