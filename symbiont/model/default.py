"""The embedded default model: a tiny Llama-style checkpoint built locally, with no network.

Symbiont needs *some* causal LM to run out of the box (demos, tests, first-use smoke
checks), but downloading one is not an option: the machines it runs on may be offline.
So the default model is built from files shipped in the package:

* a byte-level BPE tokenizer trained on ``assets/corpus.txt``;
* a 1.3M-parameter ``LlamaForCausalLM``, seeded, then pretrained on the same corpus until
  it knows it by heart, so that greedy generation from the start of a corpus passage
  continues it with the corpus's own words (about 90 s on 2 CPU cores, first use);
* a chat template, so chat-style code paths work against it too.

The result is an ordinary Hugging Face folder (``config.json``, ``generation_config.json``,
``model.safetensors``, tokenizer files) that ``AutoModelForCausalLM`` and
``AutoTokenizer`` load offline. It is built once and cached.

Cache safety: the build goes into a hidden staging folder next to the final one and is
renamed into place only after a marker file has been written last, so a crash never
leaves a folder that looks complete. Builders serialise on an ``fcntl.flock`` lock file
next to the folder, so concurrent processes neither corrupt each other nor build twice.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

try:  # fcntl is POSIX-only; without it builds still work, just without cross-process locking.
    import fcntl
except ImportError:  # pragma: no cover - exercised only on Windows
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "DefaultModelError",
    "DefaultModelSpec",
    "default_cache_dir",
    "default_corpus",
    "default_dataset",
    "default_model",
    "read_build_info",
]

# Bump when the build recipe changes in a way that should invalidate existing caches.
MODEL_NAME = "default-v1"
FORMAT_VERSION = 1
MARKER_FILE = "symbiont_build.json"

PAD_TOKEN = "<|pad|>"
BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
# Special tokens get the lowest ids, in this order; pad is 0 so zero-filled buffers are padding.
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, *ROLE_TOKENS)

# One turn is "<|role|>\n{content}<|eos|>\n". Ending each turn with EOS means a model fine-tuned
# on this template stops generating at the end of its answer with no extra stop strings.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Unsupported chat role: ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

# A progress line on stderr at least this often during pretraining (and after the last step).
PROGRESS_EVERY_S = 5.0
# Every Nth corpus paragraph is held out, so the reported loss shows generalisation, not recall.
HELD_OUT_EVERY = 10


class DefaultModelError(RuntimeError):
    """The default model could not be built or cached."""


@dataclass(frozen=True)
class DefaultModelSpec:
    """Everything that determines the built checkpoint, byte for byte (on a given machine).

    The spec is recorded in the marker file; a cached folder built from a different spec
    is treated as stale and rebuilt.
    """

    # Architecture: a 1.3M-parameter Llama, small enough to pretrain on 2 CPU cores in
    # about 90 s (benchmarks/default_model_build.py measures it; BENCHMARKS.md).
    vocab_size: int = 2048
    hidden_size: int = 128
    num_hidden_layers: int = 4
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    intermediate_size: int = 384
    max_position_embeddings: int = 1024
    seed: int = 0
    # Pretraining: ~50 passes over the ~9.7k training tokens, enough for the model to learn
    # the corpus by heart (train loss ~0.3), so a greedy continuation of a corpus passage
    # reads as the corpus. It memorises rather than generalises: held-out loss does not fall.
    # A wider model (hidden 256) at the same budget stayed at loss ~4 and wrote gibberish.
    pretrain_steps: int = 500
    batch_size: int = 16
    sequence_length: int = 64
    learning_rate: float = 2e-3
    warmup_steps: int = 10
    weight_decay: float = 0.01
    max_grad_norm: float = 1.0

    def __post_init__(self) -> None:
        if self.pretrain_steps < 0:
            raise ValueError(f"pretrain_steps must be >= 0, got {self.pretrain_steps}")
        if self.vocab_size < 256 + len(SPECIAL_TOKENS):
            raise ValueError("vocab_size must cover the 256 byte symbols plus special tokens")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be divisible by num_attention_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be divisible by num_key_value_heads")

    def as_record(self) -> dict[str, Any]:
        return asdict(self)


# --------------------------------------------------------------------------- public API


def default_model(
    cache_dir: str | os.PathLike[str] | None = None,
    *,
    rebuild: bool = False,
    spec: DefaultModelSpec | None = None,
    pretrain_steps: int | None = None,
) -> Path:
    """Return the folder of the default checkpoint, building it first if needed.

    ``cache_dir`` is the checkpoint folder itself; by default ``default_cache_dir()``.
    ``rebuild=True`` forces a fresh build. ``pretrain_steps`` overrides ``spec.pretrain_steps``
    (tests pass a small number to stay fast). The build is atomic and safe to race.
    """
    spec = _resolve_spec(spec, pretrain_steps)
    target = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    target = target.absolute()

    # Fast path without the lock: a folder with a matching marker is complete and is only
    # ever replaced whole (by rename), so reading it needs no coordination. This also lets
    # a read-only, pre-populated cache work.
    if not rebuild and _is_complete(target, spec):
        return target

    _ensure_parent_writable(target)
    with _exclusive_lock(_lock_path(target)):
        # Another process may have finished the build while we waited for the lock.
        if not rebuild and _is_complete(target, spec):
            return target
        _refuse_to_replace_foreign_folder(target)
        _remove_abandoned_builds(target)
        _build_atomically(target, spec)
    return target


def default_cache_dir() -> Path:
    """``$SYMBIONT_HOME/models/default-v1`` if SYMBIONT_HOME is set, else the user cache."""
    home = os.environ.get("SYMBIONT_HOME")
    root = Path(home).expanduser() if home else Path.home() / ".cache" / "symbiont"
    return root / "models" / MODEL_NAME


def default_dataset() -> Path:
    """Path of the bundled fine-tuning set (JSONL records with ``prompt`` and ``completion``)."""
    return _asset_path("sft.jsonl")


def default_corpus() -> Path:
    """Path of the bundled English corpus used to train the tokenizer and pretrain the model."""
    return _asset_path("corpus.txt")


def read_build_info(model_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The marker record of a completed build (spec, losses, timing), or None if incomplete."""
    try:
        record = json.loads((Path(model_dir) / MARKER_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


# --------------------------------------------------------------------------- cache handling


def _resolve_spec(spec: DefaultModelSpec | None, pretrain_steps: int | None) -> DefaultModelSpec:
    spec = spec or DefaultModelSpec()
    return spec if pretrain_steps is None else replace(spec, pretrain_steps=pretrain_steps)


def _is_complete(target: Path, spec: DefaultModelSpec) -> bool:
    info = read_build_info(target)
    return (
        info is not None
        and info.get("format_version") == FORMAT_VERSION
        and info.get("spec") == spec.as_record()
    )


def _lock_path(target: Path) -> Path:
    # Next to the folder, not inside it: the folder itself is swapped out by rename.
    return target.with_name(f".{target.name}.lock")


def _staging_prefix(target: Path) -> str:
    return f".{target.name}.building-"


def _retired_prefix(target: Path) -> str:
    return f".{target.name}.old-"


def _ensure_parent_writable(target: Path) -> None:
    """Fail early, naming the path, instead of deep inside the build."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(_lock_path(target), "a", encoding="utf-8"):
            pass
    except OSError as error:
        raise _not_writable_error(target, error) from error


def _not_writable_error(target: Path, error: OSError) -> DefaultModelError:
    return DefaultModelError(
        f"cannot write the symbiont default model cache at {target} "
        f"({error.strerror or error}). Set SYMBIONT_HOME to a writable directory "
        "(the model goes to $SYMBIONT_HOME/models/" + MODEL_NAME + ") or pass cache_dir."
    )


@contextlib.contextmanager
def _exclusive_lock(lock_path: Path) -> Iterator[None]:
    # The lock file is never deleted: unlinking a lock file lets a waiter lock a stale inode.
    with open(lock_path, "a+b") as handle:
        if fcntl is not None:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            if fcntl is not None:
                fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _refuse_to_replace_foreign_folder(target: Path) -> None:
    """Only ever delete folders we built: a mistyped cache_dir must not wipe user data."""
    if not target.exists():
        return
    if not target.is_dir():
        raise DefaultModelError(f"{target} exists and is not a folder; choose another cache_dir")
    if read_build_info(target) is None and any(target.iterdir()):
        raise DefaultModelError(
            f"{target} exists and is not a symbiont default-model folder; refusing to replace "
            "it. Remove it or choose another cache_dir / SYMBIONT_HOME."
        )


def _remove_abandoned_builds(target: Path) -> None:
    # We hold the lock, so any staging or retired folder left here belongs to a builder
    # that died (e.g. was killed) before it could clean up.
    prefixes = (_staging_prefix(target), _retired_prefix(target))
    for leftover in target.parent.iterdir():
        if leftover.name.startswith(prefixes):
            shutil.rmtree(leftover, ignore_errors=True)


def _build_atomically(target: Path, spec: DefaultModelSpec) -> None:
    # Not tempfile.mkdtemp: its 0700 mode would make a shared SYMBIONT_HOME unreadable to
    # others; a plain mkdir honours the umask like any other cache folder.
    staging = target.with_name(f"{_staging_prefix(target)}{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        staging.mkdir()
    except OSError as error:
        raise _not_writable_error(target, error) from error
    try:
        _report(
            f"building the default model in {target} (first use only; about 90 s "
            "on 2 CPU cores, progress below)"
        )
        started = time.perf_counter()
        losses = _build_checkpoint(staging, spec)
        seconds = time.perf_counter() - started
        _match_file_modes_to_umask(staging)
        _fsync_folder_contents(staging)
        # Written last: its presence is what marks the folder as complete.
        _write_marker(staging, spec, losses, seconds)
        _swap_into_place(staging, target)
        _report(f"default model ready at {target} ({seconds:.1f}s)")
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _write_marker(
    folder: Path, spec: DefaultModelSpec, losses: dict[str, float], seconds: float
) -> None:
    record = {
        "format_version": FORMAT_VERSION,
        "model_name": MODEL_NAME,
        "build_id": uuid.uuid4().hex,
        "built_at": time.time(),
        "build_seconds": round(seconds, 3),
        "spec": spec.as_record(),
        "losses": losses,
        "torch_version": torch.__version__,
    }
    path = folder / MARKER_FILE
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(record, handle, indent=2, sort_keys=True)
        handle.flush()
        os.fsync(handle.fileno())


def _match_file_modes_to_umask(folder: Path) -> None:
    # safetensors writes model.safetensors as 0600 regardless of umask; give every file the
    # mode that a plain open() produced for config.json, so the checkpoint is uniformly readable.
    mode = (folder / "config.json").stat().st_mode & 0o777
    for path in folder.iterdir():
        if path.is_file():
            path.chmod(mode)


def _fsync_folder_contents(folder: Path) -> None:
    # Renaming is atomic, but without fsync a power loss could persist the rename before
    # the file data; flushing first keeps "marker present" meaning "data on disk".
    for path in folder.iterdir():
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())


def _swap_into_place(staging: Path, target: Path) -> None:
    # os.replace cannot overwrite a non-empty directory, so an old build is first renamed
    # aside. If we die between the two renames, the next builder deletes the retired copy.
    retired = None
    if target.exists():
        retired = target.with_name(f"{_retired_prefix(target)}{uuid.uuid4().hex}")
        os.replace(target, retired)
    os.replace(staging, target)
    if retired is not None:
        shutil.rmtree(retired, ignore_errors=True)


def _report(message: str) -> None:
    # stderr, unbuffered: users see this on first use, possibly from inside another tool.
    print(f"symbiont: {message}", file=sys.stderr, flush=True)


def _asset_path(name: str) -> Path:
    # The package is installed as plain files (setuptools package-data), so the resource
    # is a real path that other tools (tokenizers, datasets) can open directly.
    resource = resources.files("symbiont") / "assets" / name
    path = Path(str(resource))
    if not path.is_file():
        raise FileNotFoundError(f"bundled asset {name!r} not found at {path}")
    return path


# --------------------------------------------------------------------------- the build


def _build_checkpoint(folder: Path, spec: DefaultModelSpec) -> dict[str, float]:
    """Write a complete checkpoint (minus the marker) into ``folder``; return loss stats."""
    corpus = default_corpus().read_text(encoding="utf-8")
    train_paragraphs, held_out_paragraphs = _split_corpus(corpus)

    # The tokenizer is the shipped vocabulary, so it sees the whole corpus; only the model's
    # training holds paragraphs out, to measure how well it generalises.
    tokenizer = _train_tokenizer(train_paragraphs + held_out_paragraphs, spec)
    # Keep the caller's RNG state untouched: seeding globally inside a library call would
    # silently change the random streams of whatever program is using us.
    with torch.random.fork_rng(devices=[]), _one_thread():
        torch.manual_seed(spec.seed)
        model = LlamaForCausalLM(_llama_config(tokenizer, spec))
        train_ids = _encode_paragraphs(tokenizer, train_paragraphs)
        held_out_ids = _encode_paragraphs(tokenizer, held_out_paragraphs)
        losses = _pretrain(model, train_ids, held_out_ids, spec)

    _save_checkpoint(folder, model, tokenizer)
    return losses


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    # Matmuls this small run faster on one thread than on two contended ones (measured: 500
    # steps took 154 s on 1 thread and 400 steps 320 s on 2 threads of a busy 2-core VM),
    # and one thread makes the build's arithmetic the same on every machine.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _split_corpus(corpus: str) -> tuple[list[str], list[str]]:
    paragraphs = [p.strip() for p in corpus.split("\n\n") if p.strip()]
    held_out = paragraphs[HELD_OUT_EVERY - 1 :: HELD_OUT_EVERY]
    train = [p for i, p in enumerate(paragraphs) if (i + 1) % HELD_OUT_EVERY]
    return train, held_out


def _train_tokenizer(paragraphs: list[str], spec: DefaultModelSpec) -> PreTrainedTokenizerFast:
    # Byte-level BPE (GPT-2 style): any string, including unseen Unicode, encodes losslessly.
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(paragraphs, trainer=trainer)
    # Prepend BOS like Llama tokenizers do: the model always sees it first in pretraining,
    # and it gives a tiny model a stable position to attend to.
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, backend.token_to_id(BOS_TOKEN))],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=list(ROLE_TOKENS),
        chat_template=CHAT_TEMPLATE,
        model_max_length=spec.max_position_embeddings,
        # Byte-level BPE is lossless; the default clean-up would turn " ," into "," on decode.
        clean_up_tokenization_spaces=False,
    )


def _llama_config(tokenizer: PreTrainedTokenizerFast, spec: DefaultModelSpec) -> LlamaConfig:
    if len(tokenizer) > spec.vocab_size:
        raise DefaultModelError(
            f"tokenizer has {len(tokenizer)} tokens, more than vocab_size={spec.vocab_size}"
        )
    return LlamaConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        intermediate_size=spec.intermediate_size,
        max_position_embeddings=spec.max_position_embeddings,
        # Untied so the embedding and the LM head are separate frozen linear weights,
        # like the large models Symbiont serves.
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )


def _encode_paragraphs(tokenizer: PreTrainedTokenizerFast, paragraphs: list[str]) -> torch.Tensor:
    """One flat token stream: ``<bos> paragraph <eos>`` per paragraph, so EOS is learned."""
    stream: list[int] = []
    for ids in tokenizer(paragraphs)["input_ids"]:
        stream.extend(ids)  # BOS is already prepended by the post-processor
        stream.append(tokenizer.eos_token_id)
    return torch.tensor(stream, dtype=torch.long)


def _pretrain(
    model: LlamaForCausalLM,
    train_ids: torch.Tensor,
    held_out_ids: torch.Tensor,
    spec: DefaultModelSpec,
) -> dict[str, float]:
    """Next-token training on random corpus windows; returns held-out loss before and after."""
    held_out_batch = _contiguous_windows(held_out_ids, spec.sequence_length)
    losses = {"held_out_loss_before": _evaluate(model, held_out_batch)}
    if spec.pretrain_steps == 0:
        losses["held_out_loss_after"] = losses["held_out_loss_before"]
        return losses

    _report(
        f"pretraining a {_count_parameters(model) / 1e6:.1f}M-parameter model for "
        f"{spec.pretrain_steps} steps (held-out loss {losses['held_out_loss_before']:.3f})"
    )
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=spec.learning_rate, weight_decay=spec.weight_decay
    )
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, _warmup_cosine(spec))
    # A private generator makes the window sampling reproducible independent of model code.
    sampler = torch.Generator().manual_seed(spec.seed)
    model.train()
    started = last_report = time.perf_counter()
    recent: list[float] = []
    for step in range(1, spec.pretrain_steps + 1):
        batch = _random_windows(train_ids, spec.batch_size, spec.sequence_length, sampler)
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), spec.max_grad_norm)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        recent.append(loss.item())
        if step == 1:
            losses["train_loss_first_step"] = recent[0]
        now = time.perf_counter()
        if now - last_report >= PROGRESS_EVERY_S or step == spec.pretrain_steps:
            mean = sum(recent) / len(recent)
            left = (now - started) / step * (spec.pretrain_steps - step)
            _report(
                f"pretrain step {step}/{spec.pretrain_steps} loss {mean:.3f} "
                f"({now - started:.0f}s, ~{left:.0f}s left)"
            )
            losses["train_loss_last_steps"] = mean
            recent.clear()
            last_report = now
    model.eval()
    losses["held_out_loss_after"] = _evaluate(model, held_out_batch)
    _report(
        f"held-out loss {losses['held_out_loss_before']:.3f} -> "
        f"{losses['held_out_loss_after']:.3f} (as meant: the model learns the corpus by heart "
        "so that it continues corpus passages, and does not generalise)"
    )
    return losses


def _warmup_cosine(spec: DefaultModelSpec) -> Callable[[int], float]:
    # Short linear warmup avoids early divergence at a high LR; cosine decay to 10% lets the
    # few available steps settle instead of ending on a noisy high-LR update.
    def factor(step: int) -> float:
        if step < spec.warmup_steps:
            return (step + 1) / spec.warmup_steps
        progress = (step - spec.warmup_steps) / max(1, spec.pretrain_steps - spec.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor


def _random_windows(
    ids: torch.Tensor, batch_size: int, length: int, generator: torch.Generator
) -> torch.Tensor:
    length = min(length, len(ids))
    starts = torch.randint(0, len(ids) - length + 1, (batch_size,), generator=generator)
    return torch.stack([ids[start : start + length] for start in starts.tolist()])


def _contiguous_windows(ids: torch.Tensor, length: int) -> torch.Tensor:
    length = min(length, len(ids))
    usable = (len(ids) // length) * length
    return ids[:usable].view(-1, length)


@torch.no_grad()
def _evaluate(model: LlamaForCausalLM, batch: torch.Tensor) -> float:
    was_training = model.training
    model.eval()
    loss = model(input_ids=batch, labels=batch).loss.item()
    model.train(was_training)
    return loss


def _count_parameters(model: torch.nn.Module) -> int:
    return sum(parameter.numel() for parameter in model.parameters())


def _save_checkpoint(
    folder: Path, model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast
) -> None:
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    # transformers 5 always writes safetensors (the safe_serialization flag is gone).
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
