"""Calibration text -> token windows [n, seq_len] for the solver.

DeltaZip calibrates on the fine-tuning data. A file is plain text, or JSONL records with
"text", "prompt" + "completion", or chat "messages" (their contents, in order); without a
file the bundled corpus and fine-tuning set are used. Windows are spread evenly over the
tokens (overlapping when the text is short), so the same text always gives the same
windows.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch


def read_texts(path: str | Path | None) -> list[str]:
    if path is None:
        from symbiont.model.default import default_corpus, default_dataset

        return read_texts(default_corpus()) + read_texts(default_dataset())
    file = Path(path).expanduser()
    if not file.is_file():
        raise ValueError(f"--calib {file} is not a file; pass a text or JSONL file")
    content = file.read_text(encoding="utf-8", errors="replace")
    if file.suffix != ".jsonl":
        return [content]
    return [
        _record_text(line, file, n)
        for n, line in enumerate(content.splitlines(), 1)
        if line.strip()
    ]


def _record_text(line: str, file: Path, number: int) -> str:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"{file}:{number} is not valid JSON: {err}") from err
    if isinstance(record, dict):
        if isinstance(record.get("text"), str):
            return record["text"]
        if isinstance(record.get("prompt"), str) and isinstance(record.get("completion"), str):
            return record["prompt"] + record["completion"]
        if isinstance(record.get("messages"), list):
            return "\n".join(
                _content_text(m.get("content")) for m in record["messages"] if isinstance(m, dict)
            )
    raise ValueError(f"{file}:{number} has none of 'text', 'prompt'+'completion' or 'messages'")


def _content_text(content) -> str:
    """A chat message's text: a string, or OpenAI's list of parts (their text parts)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            part["text"]
            for part in content
            if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    return ""


def calibration_windows(ids: list[int], samples: int, seq_len: int) -> torch.Tensor:
    """Up to `samples` windows of `seq_len` tokens, evenly spread -> int64 [n, seq_len]."""
    if len(ids) < seq_len:
        raise ValueError(
            f"the calibration text has {len(ids)} tokens, fewer than --calib-seq-len "
            f"{seq_len}; give more text (--calib) or a shorter --calib-seq-len"
        )
    tokens = torch.tensor(ids, dtype=torch.long)
    last = len(ids) - seq_len
    starts = torch.linspace(0, last, min(samples, last + 1)).round().long().unique()
    return torch.stack([tokens[s : s + seq_len] for s in starts.tolist()])


def tokenize_calibration(
    tokenizer, path: str | Path | None, samples: int, seq_len: int
) -> torch.Tensor:
    """Token windows of the calibration text, documents joined by the EOS token."""
    separator = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    ids: list[int] = []
    for text in read_texts(path):
        ids += tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"] + separator
    return calibration_windows(ids, samples, seq_len)
