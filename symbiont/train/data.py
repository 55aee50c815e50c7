"""Training data: records from JSONL or a saved `datasets` dataset, tokenized into examples
with loss masks, and a collator that pads them into batches.

Three record shapes are accepted, decided per record:

* ``{"text": ...}``: plain language modelling, loss on every token;
* ``{"prompt": ..., "completion": ...}``: loss on the completion tokens only;
* ``{"messages": [{"role": ..., "content": ...}, ...]}``: rendered with the tokenizer's
  chat template, loss on the assistant turns only.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

IGNORE_INDEX = -100  # label value the loss skips (torch cross_entropy's ignore_index)


class DataError(ValueError):
    """A training record is malformed; the message names the file and line."""


@dataclass(frozen=True)
class Record:
    """One raw record and where it came from (for error messages)."""

    fields: dict[str, Any]
    where: str  # "path:line" for JSONL, "path[index]" for saved datasets


@dataclass(frozen=True)
class Example:
    """One tokenized record. `labels` is `input_ids` with IGNORE_INDEX where no loss is taken."""

    input_ids: tuple[int, ...]
    labels: tuple[int, ...]


# --------------------------------------------------------------------------- reading


def read_records(path: str | os.PathLike) -> list[Record]:
    """Every record of a JSONL file, or of a `datasets` dataset saved with `save_to_disk`."""
    path = Path(path)
    if path.is_dir():
        return _read_saved_dataset(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file or folder; pass a .jsonl file or a saved dataset")
    return list(_read_jsonl(path))


def _read_jsonl(path: Path) -> Iterator[Record]:
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            where = f"{path}:{number}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise DataError(
                    f"{where}: not UTF-8 (byte {err.start + 1} of the line); save the file as UTF-8"
                ) from err
            if not line.strip():
                continue
            try:
                fields = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(
                    f"{where}: not valid JSON ({err.msg} at column {err.colno})"
                ) from err
            except (ValueError, RecursionError) as err:  # a 4300-digit int, deep nesting
                raise DataError(
                    f"{where}: not valid JSON here ({err or 'nested too deep'})"
                ) from None
            if not isinstance(fields, dict):
                raise DataError(f"{where}: expected a JSON object, got {type(fields).__name__}")
            yield Record(fields, where)


def _read_saved_dataset(path: Path) -> list[Record]:
    try:
        import datasets
    except ImportError as err:
        raise DataError(
            f"{path} is a folder; reading saved datasets needs the `datasets` package "
            "(pip install datasets), or pass a .jsonl file"
        ) from err
    try:
        loaded = datasets.load_from_disk(str(path))
    except FileNotFoundError as err:
        raise DataError(f"{path}: not a dataset saved with save_to_disk ({err})") from err
    except Exception as err:  # noqa: BLE001 - datasets fails in its own ways on odd folders
        raise DataError(
            f"{path}: cannot read this saved dataset ({type(err).__name__}: {err}); an empty "
            "or partly written dataset does this, save it again with save_to_disk"
        ) from err
    if isinstance(loaded, datasets.DatasetDict):
        if "train" not in loaded:
            raise DataError(f"{path}: a DatasetDict without a 'train' split ({list(loaded)})")
        loaded = loaded["train"]
    return [Record(dict(row), f"{path}[{index}]") for index, row in enumerate(loaded)]


# --------------------------------------------------------------------------- tokenizing


def tokenize_records(records: Sequence[Record], tokenizer, max_length: int) -> list[Example]:
    """Tokenize and truncate every record; records with no loss tokens left are dropped."""
    examples = [_tokenize(record, tokenizer, max_length) for record in records]
    kept = [e for e in examples if any(label != IGNORE_INDEX for label in e.labels[1:])]
    if len(kept) < len(examples):
        log.warning(
            "dropped %d of %d records with no completion tokens within max_length=%d",
            len(examples) - len(kept),
            len(examples),
            max_length,
        )
    if not kept:
        raise DataError("no usable records (all empty or truncated away)")
    return kept


def _tokenize(record: Record, tokenizer, max_length: int) -> Example:
    fields = record.fields
    if "messages" in fields:
        ids, labels = _tokenize_messages(record, tokenizer)
    elif "prompt" in fields or "completion" in fields:
        ids, labels = _tokenize_prompt_completion(record, tokenizer)
    elif "text" in fields:
        ids = _encode(tokenizer, _string(record, "text"), special=True) + _eos(tokenizer)
        labels = list(ids)
    else:
        raise DataError(
            f"{record.where}: record has keys {sorted(fields)}; expected 'text', "
            "'prompt' and 'completion', or 'messages'"
        )
    return Example(tuple(ids[:max_length]), tuple(labels[:max_length]))


def _tokenize_prompt_completion(record: Record, tokenizer) -> tuple[list[int], list[int]]:
    prompt = _encode(tokenizer, _string(record, "prompt"), special=True)
    completion = _encode(tokenizer, _string(record, "completion"), special=False) + _eos(tokenizer)
    return prompt + completion, [IGNORE_INDEX] * len(prompt) + completion


def _tokenize_messages(record: Record, tokenizer) -> tuple[list[int], list[int]]:
    """Loss on assistant turns: each turn's tokens are found as the difference between the
    template rendered up to that turn (with generation prompt) and through it."""
    messages = record.fields["messages"]
    _check_messages(record, messages)
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(
            f"{record.where}: 'messages' records need a tokenizer with a chat template; "
            "use a model that has one, or convert the data to prompt/completion"
        )
    ids = _render(tokenizer, messages, generation_prompt=False)
    labels = [IGNORE_INDEX] * len(ids)
    for turn, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = len(_render(tokenizer, messages[:turn], generation_prompt=True))
        end = len(_render(tokenizer, messages[: turn + 1], generation_prompt=False))
        labels[start:end] = ids[start:end]
    return ids, labels


def _render(tokenizer, messages, *, generation_prompt: bool) -> list[int]:
    if not messages:
        return []
    out = tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=generation_prompt, return_dict=False
    )
    return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)


def _check_messages(record: Record, messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{record.where}: 'messages' must be a non-empty list of messages")
    for index, message in enumerate(messages):
        if not (
            isinstance(message, dict)
            and isinstance(message.get("role"), str)
            and isinstance(message.get("content"), str)
        ):
            raise DataError(
                f"{record.where}: messages[{index}] must be an object with string "
                "'role' and 'content'"
            )
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"{record.where}: no 'assistant' message to learn from")


def _string(record: Record, key: str) -> str:
    value = record.fields.get(key)
    if not isinstance(value, str):
        found = "missing" if value is None else f"a {type(value).__name__}"
        raise DataError(f"{record.where}: field '{key}' must be a string, it is {found}")
    return value


def _encode(tokenizer, text: str, *, special: bool) -> list[int]:
    return list(tokenizer(text, add_special_tokens=special)["input_ids"])


def _eos(tokenizer) -> list[int]:
    return [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []


def pad_id(tokenizer) -> int:
    """The id used to pad batches: the tokenizer's pad token, else EOS, else 0."""
    for candidate in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if candidate is not None:
            return int(candidate)
    return 0


# --------------------------------------------------------------------------- batching


def collate(examples: Sequence[Example], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-pad a list of examples. Returns input_ids, attention_mask, labels: [batch, longest]."""
    longest = max(len(e.input_ids) for e in examples)
    ids = torch.full((len(examples), longest), pad_token_id, dtype=torch.long)
    labels = torch.full((len(examples), longest), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(examples), longest), dtype=torch.long)
    for row, example in enumerate(examples):
        n = len(example.input_ids)
        ids[row, :n] = torch.tensor(example.input_ids)
        labels[row, :n] = torch.tensor(example.labels)
        mask[row, :n] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def load_examples(path: str | os.PathLike, tokenizer, max_length: int) -> list[Example]:
    """read_records + tokenize_records; every error names the file."""
    try:
        return tokenize_records(read_records(path), tokenizer, max_length)
    except DataError as err:
        if str(err).startswith(str(path)):
            raise
        raise DataError(f"{path}: {err}") from err
