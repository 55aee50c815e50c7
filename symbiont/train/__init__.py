"""Fine-tuning on a client model: data, the training loop, atomic checkpoints and resume."""

from symbiont.train.adapters import AdapterSpec, build_peft_config, load_peft_config
from symbiont.train.checkpoints import TrainState, latest_checkpoint, list_checkpoints
from symbiont.train.config import TrainConfig
from symbiont.train.data import (
    DataError,
    Example,
    collate,
    load_examples,
    pad_id,
    read_records,
    tokenize_records,
)
from symbiont.train.loop import TrainResult, evaluate, train

__all__ = [
    "AdapterSpec",
    "DataError",
    "Example",
    "TrainConfig",
    "TrainResult",
    "TrainState",
    "build_peft_config",
    "collate",
    "evaluate",
    "latest_checkpoint",
    "list_checkpoints",
    "load_examples",
    "load_peft_config",
    "pad_id",
    "read_records",
    "tokenize_records",
    "train",
]
