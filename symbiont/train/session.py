"""Opening what a tenant process needs: an executor (in-process or remote), the client
model over it, and the checkpoint's tokenizer. Shared by `finetune`, `generate` and `demo`."""

from __future__ import annotations

import torch

import symbiont
from symbiont.executor import Executor


def open_client(model_dir, executor: Executor, *, device="cpu", dtype=None):
    """The client model (frozen linear layers on `executor`) with its tokenizer."""
    model = symbiont.load_client(model_dir, executor, device=device, dtype=dtype)
    return model, load_tokenizer(model_dir)


def load_tokenizer(model_dir):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError) as err:
        raise ValueError(
            f"no tokenizer in {model_dir} ({err}); symbiont needs the checkpoint folder "
            "to include its tokenizer files"
        ) from err


def set_threads(threads: int | None) -> None:
    """Limit intra-op threads (useful when several clients share a few cores)."""
    if threads:
        torch.set_num_threads(threads)
