"""Training data: record shapes, loss masks, padding, and errors that name file:line."""

from __future__ import annotations

import json

import pytest
import torch

from symbiont.tenant import load_tokenizer
from symbiont.train.data import (
    IGNORE_INDEX,
    DataError,
    collate,
    load_examples,
    read_records,
    tokenize_records,
)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return load_tokenizer(model_dir)


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_prompt_completion_masks_prompt_tokens(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "Q: one?\nA:", "completion": " yes"}])
    (example,) = load_examples(path, tokenizer, max_length=64)
    prompt_len = len(tokenizer("Q: one?\nA:")["input_ids"])
    completion = tokenizer(" yes", add_special_tokens=False)["input_ids"]
    assert example.labels[:prompt_len] == (IGNORE_INDEX,) * prompt_len, "prompt tokens carry loss"
    assert list(example.labels[prompt_len:]) == completion + [tokenizer.eos_token_id], (
        "completion tokens (and EOS, so the model learns to stop) must carry loss"
    )
    assert example.input_ids[prompt_len:] == example.labels[prompt_len:]


def test_text_records_take_loss_everywhere(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "the cat sat"}])
    (example,) = load_examples(path, tokenizer, max_length=64)
    assert example.labels == example.input_ids
    assert example.input_ids[-1] == tokenizer.eos_token_id


def test_chat_messages_take_loss_on_assistant_turns_only(tokenizer, tmp_path):
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "bye"},
        {"role": "assistant", "content": "see you"},
    ]
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": messages}])
    (example,) = load_examples(path, tokenizer, max_length=256)
    full = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
    assert list(example.input_ids) == list(full), "chat records must use the chat template"
    learned = tokenizer.decode(
        [t for t, lab in zip(example.input_ids, example.labels, strict=True) if lab >= 0]
    )
    assert "hello" in learned and "see you" in learned
    assert "hi" not in learned and "bye" not in learned and "brief" not in learned, learned


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "not valid JSON"),
        ('["a list"]', "expected a JSON object"),
        ('{"prompt": "x"}', "field 'completion' must be a string, it is missing"),
        ('{"prompt": "x", "completion": 3}', "field 'completion' must be a string, it is a int"),
        ('{"input": "x"}', "expected 'text', 'prompt' and 'completion', or 'messages'"),
        ('{"messages": [{"role": "user"}]}', r"messages\[0\] must be an object"),
        ('{"text": "x", "n": ' + "9" * 5000 + "}", "not valid JSON here"),  # bare ValueError
        ("[" * 40_000 + "]" * 40_000, "not valid JSON here"),  # RecursionError
    ],
)
def test_bad_record_error_names_file_and_line(tokenizer, tmp_path, line, message):
    path = write_jsonl(tmp_path / "train.jsonl", [{"text": "fine"}, "", line])
    with pytest.raises(DataError, match=message) as caught:
        load_examples(path, tokenizer, max_length=64)
    assert f"{path}:3:" in str(caught.value), "the error must name file:line of the bad record"


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        read_records(tmp_path / "absent.jsonl")


def test_truncation_drops_records_left_without_loss(tokenizer, tmp_path):
    rows = [{"prompt": "word " * 50, "completion": " x"}, {"text": "short one"}]
    examples = load_examples(write_jsonl(tmp_path / "d.jsonl", rows), tokenizer, max_length=8)
    assert len(examples) == 1 and all(len(e.input_ids) <= 8 for e in examples)


def test_collate_pads_right_and_masks_padding(tokenizer, tmp_path):
    rows = [{"text": "a b c d e f"}, {"text": "a"}]
    examples = load_examples(write_jsonl(tmp_path / "d.jsonl", rows), tokenizer, max_length=64)
    batch = collate(examples, pad_token_id=0)
    short = len(examples[1].input_ids)
    assert batch["input_ids"].shape == batch["labels"].shape == batch["attention_mask"].shape
    assert batch["attention_mask"][1].tolist() == [1] * short + [0] * (
        batch["input_ids"].shape[1] - short
    )
    assert (batch["labels"][1, short:] == IGNORE_INDEX).all(), "padding must carry no loss"
    assert batch["input_ids"].dtype == torch.long


def test_saved_dataset_folder_is_read(tokenizer, tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = {"prompt": ["Q: a?\nA:", "Q: b?\nA:"], "completion": [" a", " b"]}
    datasets.Dataset.from_dict(rows).save_to_disk(str(tmp_path / "ds"))
    records = read_records(tmp_path / "ds")
    assert [r.fields["completion"] for r in records] == [" a", " b"]
    assert len(tokenize_records(records, tokenizer, 64)) == 2


def test_an_empty_saved_dataset_is_refused_by_name(tmp_path):
    """datasets raised a bare IndexError (a traceback from `symbiont finetune`)."""
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"text": []}).save_to_disk(str(tmp_path / "empty"))
    with pytest.raises(DataError, match="empty: cannot read this saved dataset"):
        read_records(tmp_path / "empty")


def test_bad_bytes_and_empty_files_are_named(tokenizer, tmp_path):
    """A codec error named neither file nor line, and an empty --eval-data file was
    reported as 'no usable training records' without its name."""
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"text": "fine"}\n{"text": "ok \xff"}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: not UTF-8 \(byte 14 of the line\)"):
        load_examples(bad, tokenizer, 64)
    empty = tmp_path / "eval.jsonl"
    empty.write_text("")
    with pytest.raises(DataError, match=r"eval.jsonl: no usable records"):
        load_examples(empty, tokenizer, 64)
