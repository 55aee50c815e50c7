"""Atomic checkpoints and the final adapter.

An output folder looks like::

    out/
      adapter config + weights     final adapter (standard PEFT folder at the root)
      adapter_model.safetensors
      metrics.jsonl
      checkpoint-000100/           adapter + optimizer + scheduler + RNG + step
      checkpoint-000200/

A checkpoint is written into a hidden staging folder, flushed to disk, and renamed into
place in one step, so a kill at any moment leaves either the complete checkpoint or none.
The root adapter's files are each replaced atomically, weights first and config last.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from peft import set_peft_model_state_dict

from symbiont.adapters.names import CONFIG_FILE, WEIGHTS_FILE
from symbiont.adapters.spec import read_adapter

CHECKPOINT_PREFIX = "checkpoint-"
STAGING_PREFIX = ".staging-"
STATE_FILE = "trainer_state.json"
# Non-tensor state is JSON: nothing in a run folder is unpickled (a planted file could run code).
SCHEDULER_FILE = "scheduler.json"
CUDA_RNG_FILE = "cuda_rng.pt"  # written only by runs on a GPU
ADAPTER_FILES = (WEIGHTS_FILE, CONFIG_FILE)  # config last marks done


@dataclass(frozen=True)
class TrainState:
    """Where a run is: after `step` optimizer steps, having trained on `tokens` tokens."""

    step: int
    tokens: int
    config: dict  # TrainConfig.as_record() of the run that wrote it


def checkpoint_dir(out: Path, step: int) -> Path:
    return out / f"{CHECKPOINT_PREFIX}{step:06d}"


def list_checkpoints(out: Path) -> list[Path]:
    """Complete checkpoints in `out`, oldest first."""
    if not out.is_dir():
        return []
    found = [p for p in out.iterdir() if _step_of(p) is not None and p.is_dir()]
    # by step, not by name: step 1000000 has one digit more than the 6 the names pad to
    return sorted((p for p in found if (p / STATE_FILE).is_file()), key=_step_of)


def _step_of(path: Path) -> int | None:
    digits = path.name.removeprefix(CHECKPOINT_PREFIX)
    if digits == path.name or not digits.isascii() or not digits.isdigit():
        return None
    return int(digits)


# adapter_config.json fields that say where the adapter came from, not what it computes
_PEFT_BOOKKEEPING = frozenset(
    {"base_model_name_or_path", "revision", "inference_mode", "peft_version", "auto_mapping"}
)


def peft_conflicts(model, checkpoint: Path) -> list[str]:
    """Adapter settings of `model` (a PeftModel) that differ from those the checkpoint was
    trained with (its adapter_config.json): resuming with them would train another adapter."""
    configs = getattr(model, "peft_config", None)
    saved_file = checkpoint / "adapter_config.json"
    if not configs or not saved_file.is_file():
        return []
    saved = json.loads(saved_file.read_text(encoding="utf-8"))
    mine = json.loads(json.dumps(next(iter(configs.values())).to_dict(), default=_jsonable))
    return sorted(
        f"{key}: checkpoint {saved[key]!r}, now {mine[key]!r}"
        for key in saved.keys() & mine.keys()
        if key not in _PEFT_BOOKKEEPING and _normal(saved[key]) != _normal(mine[key])
    )


def _jsonable(value):
    if isinstance(value, set | frozenset):
        return sorted(value, key=str)
    return getattr(value, "value", str(value))  # enums (task type, ...) as PEFT saves them


def _normal(value):
    """Lists of names (target modules, ...) compare as sets: PEFT saves them in any order."""
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return sorted(value)
    return value


def latest_checkpoint(out: Path) -> Path | None:
    found = list_checkpoints(out)
    return found[-1] if found else None


def save_checkpoint(model, optimizer, scheduler, state: TrainState, out: Path, keep: int) -> Path:
    """Write checkpoint-<step> atomically, then delete all but the newest `keep` (0: keep all)."""
    target = checkpoint_dir(out, state.step)
    with _staging(out) as staging:
        model.save_pretrained(staging)
        torch.save(optimizer.state_dict(), staging / "optimizer.pt")
        _write_json(staging / SCHEDULER_FILE, _scheduler_record(scheduler))
        torch.save(torch.get_rng_state(), staging / "rng.pt")
        if torch.cuda.is_available() and torch.cuda.is_initialized():  # dropout on a GPU
            torch.save(torch.cuda.get_rng_state_all(), staging / CUDA_RNG_FILE)
        _write_json(staging / STATE_FILE, asdict(state))
        _fsync_tree(staging)
        if target.exists():  # a rerun of the same step: replace it whole
            shutil.rmtree(target)
        os.replace(staging, target)
    _fsync_dir(out)
    _prune(out, keep)
    return target


def load_checkpoint(path: Path, model, optimizer, scheduler) -> TrainState:
    """Restore adapter weights, optimizer, scheduler and RNG; return the saved state."""
    weights = read_adapter(path).load_tensors()
    result = set_peft_model_state_dict(model, weights)
    missing = [k for k in getattr(result, "unexpected_keys", []) if k]
    if missing:
        raise RuntimeError(f"{path}: adapter has tensors this model lacks: {missing[:5]}")
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True))
    scheduler.load_state_dict(_read_scheduler(path))
    torch.set_rng_state(torch.load(path / "rng.pt", weights_only=True))
    cuda_rng = path / CUDA_RNG_FILE
    if cuda_rng.is_file() and torch.cuda.is_available():
        states = torch.load(cuda_rng, weights_only=True)
        if len(states) == torch.cuda.device_count():  # else another machine: not exact
            torch.cuda.set_rng_state_all(states)
    return TrainState(**json.loads((path / STATE_FILE).read_text(encoding="utf-8")))


def _scheduler_record(scheduler) -> dict:
    """The LR scheduler's state as plain JSON values (transformers' schedules hold only
    numbers; a callable that is not a plain function would not survive, so refuse it)."""
    state = scheduler.state_dict()
    try:
        return json.loads(json.dumps(state))
    except TypeError as err:
        raise TypeError(
            f"cannot checkpoint the LR scheduler {type(scheduler).__name__}: its state is not "
            f"plain numbers ({err}); use one of transformers' schedules"
        ) from err


def _read_scheduler(path: Path) -> dict:
    file = path / SCHEDULER_FILE
    if file.is_file():
        return json.loads(file.read_text(encoding="utf-8"))
    legacy = path / "scheduler.pt"  # checkpoints written before scheduler.json
    try:
        return torch.load(legacy, weights_only=True)
    except FileNotFoundError:
        raise ValueError(f"{path}: checkpoint has no {SCHEDULER_FILE}; it is incomplete") from None
    except pickle.UnpicklingError as err:
        raise ValueError(
            f"{legacy} holds objects other than plain numbers and tensors; symbiont does not "
            f"unpickle them (a planted file could run code). Delete {path} to resume from an "
            "earlier checkpoint"
        ) from err


def publish_adapter(model, out: Path) -> None:
    """Put the adapter at the root of `out` as a standard PEFT folder, file by file atomically."""
    with _staging(out) as staging:
        model.save_pretrained(staging)
        _fsync_tree(staging)
        extras = [p for p in staging.iterdir() if p.name not in ADAPTER_FILES]
        for path in [*extras, *(staging / name for name in ADAPTER_FILES)]:
            if path.exists():
                os.replace(path, out / path.name)
    _fsync_dir(out)


def remove_abandoned_staging(out: Path) -> None:
    """Staging folders left by a killed run are incomplete by construction."""
    if out.is_dir():
        for leftover in out.iterdir():
            if leftover.name.startswith(STAGING_PREFIX):
                shutil.rmtree(leftover, ignore_errors=True)


class _staging:
    """A fresh hidden folder in `out`, removed on exit unless it was renamed away."""

    def __init__(self, out: Path):
        out.mkdir(parents=True, exist_ok=True)
        self.path = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=out))

    def __enter__(self) -> Path:
        return self.path

    def __exit__(self, *exc) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def _prune(out: Path, keep: int) -> None:
    if keep <= 0:
        return
    for old in list_checkpoints(out)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def _write_json(path: Path, record: dict) -> None:
    path.write_text(json.dumps(record, indent=2, sort_keys=True), encoding="utf-8")


def _fsync_tree(folder: Path) -> None:
    for path in folder.rglob("*"):
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
    _fsync_dir(folder)


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # some platforms cannot open folders; rename is still atomic there
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
