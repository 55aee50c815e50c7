"""Tests for the embedded default model: build, cache, atomicity, determinism, assets.

Every build here uses a temporary cache dir and only a couple of pretraining steps, so
the whole file runs in seconds; the default (longer) pretraining is not exercised.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import time
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from symbiont.model.default import (
    MARKER_FILE,
    MODEL_NAME,
    DefaultModelError,
    DefaultModelSpec,
    default_cache_dir,
    default_corpus,
    default_dataset,
    default_model,
    read_build_info,
)

# `symbiont.model.default` as an attribute is the re-exported function, so fetch the module
# itself from the import system to monkeypatch its internals.
dm = importlib.import_module("symbiont.model.default")

REPO_ROOT = Path(__file__).resolve().parents[1]
FAST_STEPS = 2  # enough to run the training loop (and its determinism) without the wait
# For tests about caching and atomicity, where the architecture is irrelevant: builds in ~0.1 s.
TINY = DefaultModelSpec(
    vocab_size=512,
    hidden_size=64,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    max_position_embeddings=128,
    batch_size=4,
    sequence_length=32,
    pretrain_steps=0,
)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return default_model(tmp_path_factory.mktemp("cache") / "model", pretrain_steps=FAST_STEPS)


def build_id(path: Path) -> str:
    info = read_build_info(path)
    assert info is not None, f"{path} is not a completed build"
    return info["build_id"]


def leftovers(target: Path) -> list[str]:
    """Hidden staging/retired folders next to target (the lock file is expected to stay)."""
    return sorted(
        p.name
        for p in target.parent.iterdir()
        if p.name.startswith(f".{target.name}.") and p.is_dir()
    )


# --------------------------------------------------------------------------- loading


def test_checkpoint_has_expected_files(built: Path) -> None:
    names = {p.name for p in built.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", MARKER_FILE} <= names
    assert "tokenizer.json" in names and "tokenizer_config.json" in names
    assert not any(name.endswith(".bin") for name in names), "weights must be safetensors only"


def test_model_loads_with_auto_class_and_runs(built: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(built)
    spec = DefaultModelSpec()
    config = model.config
    assert config.model_type == "llama"
    assert (config.hidden_size, config.num_hidden_layers) == (spec.hidden_size, 4)
    assert (config.num_attention_heads, config.num_key_value_heads) == (8, 4)
    assert config.vocab_size == spec.vocab_size
    assert config.tie_word_embeddings is False
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()

    tokenizer = AutoTokenizer.from_pretrained(built)
    inputs = tokenizer("The river flows to the sea.", return_tensors="pt")
    with torch.no_grad():
        logits = model(**inputs).logits
    assert logits.shape == (1, inputs["input_ids"].shape[1], spec.vocab_size)
    assert torch.isfinite(logits).all()

    generated = model.generate(**inputs, max_new_tokens=5, do_sample=False)
    assert generated.shape[1] <= inputs["input_ids"].shape[1] + 5


def test_generation_config_names_special_tokens(built: Path) -> None:
    generation = json.loads((built / "generation_config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(built)
    assert generation["bos_token_id"] == tokenizer.bos_token_id
    assert generation["eos_token_id"] == tokenizer.eos_token_id
    assert generation["pad_token_id"] == tokenizer.pad_token_id


@pytest.mark.parametrize(
    "text",
    [
        "A computer is a machine that follows instructions.",
        "Spaces  ,  odd   punctuation ; and\ttabs\nand newlines .",
        "Unicode survives byte-level BPE: café, naïve, 日本語, 🙂",
        "Q: What is 12 plus 7?\nA: 19",
    ],
)
def test_tokenizer_round_trips_text(built: Path, text: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(built)
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert max(ids) < DefaultModelSpec().vocab_size


def test_tokenizer_has_distinct_special_tokens(built: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(built)
    special = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id}
    assert len(special) == 3 and None not in special
    # Role markers are single tokens, not spelled out byte by byte.
    assert len(tokenizer("<|assistant|>", add_special_tokens=False)["input_ids"]) == 1


def test_chat_template_renders(built: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(built)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 plus 3?"},
    ]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<|bos|><|system|>\nBe brief.<|eos|>\n<|user|>\nWhat is 2 plus 3?<|eos|>\n<|assistant|>\n"
    )
    without_prompt = tokenizer.apply_chat_template(messages, tokenize=False)
    assert not without_prompt.endswith("<|assistant|>\n")

    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
    assert ids.count(tokenizer.bos_token_id) == 1, "template BOS must not be doubled"

    with pytest.raises(Exception, match="Unsupported chat role"):
        tokenizer.apply_chat_template([{"role": "robot", "content": "beep"}], tokenize=False)


# --------------------------------------------------------------------------- caching


def test_second_call_returns_cached_folder_without_building(
    built: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = build_id(built)
    marker_mtime = (built / MARKER_FILE).stat().st_mtime_ns

    def must_not_build(*args: object, **kwargs: object) -> None:
        raise AssertionError("cached model was rebuilt")

    monkeypatch.setattr(dm, "_build_checkpoint", must_not_build)
    assert default_model(built, pretrain_steps=FAST_STEPS) == built
    assert build_id(built) == before
    assert (built / MARKER_FILE).stat().st_mtime_ns == marker_mtime


def test_rebuild_true_rebuilds_in_place(tmp_path: Path) -> None:
    target = tmp_path / "model"
    first = default_model(target, spec=TINY)
    old_id = build_id(first)
    second = default_model(target, spec=TINY, rebuild=True)
    assert second == first
    assert build_id(second) != old_id
    assert leftovers(target) == []
    AutoModelForCausalLM.from_pretrained(second)


def test_changed_spec_is_treated_as_stale(tmp_path: Path) -> None:
    target = tmp_path / "model"
    old_id = build_id(default_model(target, spec=TINY))
    default_model(target, spec=TINY, pretrain_steps=1)
    info = read_build_info(target)
    assert info is not None and info["build_id"] != old_id
    assert info["spec"]["pretrain_steps"] == 1


def test_interrupted_build_leaves_no_complete_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "model"
    real_save = dm._save_checkpoint

    def save_then_crash(folder: Path, *args: object) -> None:
        real_save(folder, *args)  # the weights are on disk, but the marker is not
        raise RuntimeError("simulated crash mid-build")

    monkeypatch.setattr(dm, "_save_checkpoint", save_then_crash)
    with pytest.raises(RuntimeError, match="simulated crash"):
        default_model(target, spec=TINY)
    assert not target.exists()
    assert read_build_info(target) is None
    assert leftovers(target) == []

    monkeypatch.setattr(dm, "_save_checkpoint", real_save)
    assert read_build_info(default_model(target, spec=TINY)) is not None


def test_interrupted_rebuild_keeps_previous_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "model"
    old_id = build_id(default_model(target, spec=TINY))

    def crash(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt  # BaseException, like a user pressing Ctrl-C

    monkeypatch.setattr(dm, "_pretrain", crash)
    with pytest.raises(KeyboardInterrupt):
        default_model(target, spec=TINY, rebuild=True)
    assert build_id(target) == old_id
    assert leftovers(target) == []


def test_folders_abandoned_by_killed_builders_are_removed(tmp_path: Path) -> None:
    target = tmp_path / "model"
    for name in (f".{target.name}.building-999-dead", f".{target.name}.old-cafe"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_bytes(b"half written")
    default_model(target, spec=TINY)
    assert leftovers(target) == []


def test_concurrent_builders_build_once(tmp_path: Path) -> None:
    """Two processes start building at the same moment; the lock makes one wait and reuse."""
    target = tmp_path / "model"
    script = textwrap.dedent(
        f"""
        import sys, time
        from pathlib import Path
        from symbiont.model.default import DefaultModelSpec, default_model, read_build_info
        me, other = Path(sys.argv[1]), Path(sys.argv[2])
        me.touch()
        deadline = time.time() + 60
        while not other.exists() and time.time() < deadline:  # start together
            time.sleep(0.01)
        spec = DefaultModelSpec(**{asdict(replace(TINY, pretrain_steps=FAST_STEPS))!r})
        path = default_model({str(target)!r}, spec=spec)
        print(read_build_info(path)["build_id"])
        """
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    ready = [tmp_path / "ready-a", tmp_path / "ready-b"]
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(ready[i]), str(ready[1 - i])],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i in range(2)
    ]
    results = [process.communicate(timeout=120) for process in processes]
    for process, (_, stderr) in zip(processes, results, strict=True):
        assert process.returncode == 0, stderr
    build_ids = {stdout.strip() for stdout, _ in results}
    assert len(build_ids) == 1, "the second builder must reuse the first build"
    builds = sum(stderr.count("building the default model") for _, stderr in results)
    assert builds == 1
    assert build_ids == {build_id(target)}
    assert leftovers(target) == []


# --------------------------------------------------------------------------- determinism


def test_builds_are_deterministic_across_folders(
    built: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    torch.manual_seed(12345)
    caller_rng = torch.get_rng_state()
    other = default_model(tmp_path / "again", pretrain_steps=FAST_STEPS)
    assert torch.equal(torch.get_rng_state(), caller_rng), "build must not disturb global RNG"

    first, second = load_file(built / "model.safetensors"), load_file(other / "model.safetensors")
    assert first.keys() == second.keys()
    for name in first:
        assert torch.equal(first[name], second[name]), f"{name} differs between builds"
    for name in ("tokenizer.json", "config.json", "generation_config.json"):
        assert (built / name).read_bytes() == (other / name).read_bytes(), name

    # Users see progress with a step counter and loss on first use.
    stderr = capsys.readouterr().err
    assert f"pretrain step {FAST_STEPS}/{FAST_STEPS} loss" in stderr


def test_pretraining_reduces_loss(tmp_path: Path) -> None:
    spec = replace(TINY, learning_rate=1e-2, warmup_steps=1)
    path = default_model(tmp_path / "model", spec=spec, pretrain_steps=10)
    losses = read_build_info(path)["losses"]
    assert losses["train_loss_last_steps"] < losses["train_loss_first_step"] - 0.5


# --------------------------------------------------------------------------- locations/errors


def test_cache_dir_comes_from_symbiont_home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SYMBIONT_HOME", str(tmp_path / "home"))
    assert default_cache_dir() == tmp_path / "home" / "models" / MODEL_NAME
    path = default_model(spec=TINY)
    assert path == tmp_path / "home" / "models" / MODEL_NAME
    assert read_build_info(path) is not None


def test_cache_dir_defaults_to_user_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SYMBIONT_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / ".cache" / "symbiont" / "models" / MODEL_NAME


def test_unwritable_cache_dir_names_path_and_symbiont_home(tmp_path: Path) -> None:
    # A regular file where a folder must go fails even for root, unlike chmod tricks.
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    target = blocker / "models" / "default"
    with pytest.raises(DefaultModelError, match="SYMBIONT_HOME") as error:
        default_model(target, spec=TINY)
    assert str(target) in str(error.value)


def test_refuses_to_replace_a_folder_it_did_not_build(tmp_path: Path) -> None:
    target = tmp_path / "precious"
    target.mkdir()
    (target / "notes.txt").write_text("user data")
    with pytest.raises(DefaultModelError, match="refusing to replace"):
        default_model(target, spec=TINY)
    assert (target / "notes.txt").read_text() == "user data"


def test_invalid_spec_is_rejected() -> None:
    with pytest.raises(ValueError):
        DefaultModelSpec(pretrain_steps=-1)
    with pytest.raises(ValueError):
        DefaultModelSpec(hidden_size=250)


# --------------------------------------------------------------------------- bundled assets


def test_bundled_dataset_is_prompt_completion_jsonl() -> None:
    path = default_dataset()
    assert path.name == "sft.jsonl" and path.is_file()
    lines = path.read_text(encoding="utf-8").splitlines()
    assert 200 <= len(lines) <= 1000
    for line in lines:
        record = json.loads(line)
        assert set(record) == {"prompt", "completion"}
        assert isinstance(record["prompt"], str) and record["prompt"]
        assert isinstance(record["completion"], str) and record["completion"].startswith(" ")


def test_bundled_dataset_matches_its_generator() -> None:
    generator_path = default_dataset().with_name("make_sft.py")
    spec = importlib.util.spec_from_file_location("symbiont_make_sft", generator_path)
    assert spec is not None and spec.loader is not None
    make_sft = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_sft)
    regenerated = make_sft.render_jsonl(make_sft.generate_records())
    assert regenerated == default_dataset().read_text(encoding="utf-8")


def test_bundled_corpus_is_plain_english_prose() -> None:
    path = default_corpus()
    assert path.name == "corpus.txt"
    text = path.read_text(encoding="utf-8")
    assert 30_000 <= len(text.encode()) <= 60_000
    assert text.isascii()
    assert text.count("\n\n") > 100  # paragraphs: the build splits the corpus on blank lines


def test_build_records_its_duration(built: Path) -> None:
    # The marker records how long the build took, so users can check it afterwards; how
    # long it takes is measured by benchmarks/default_model_build.py, not asserted here.
    info = read_build_info(built)
    assert info is not None
    assert isinstance(info["build_seconds"], float) and info["build_seconds"] > 0
    assert info["built_at"] <= time.time()
