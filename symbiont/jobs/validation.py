"""Checks of what a tenant sends, before anything is stored: uploaded training files
(each line named with its problem) and job requests (each field named with its range).

A `JobsError` carries the HTTP status, the message (saying how to fix it), and the field
(`param`) at fault; the HTTP layer answers it in OpenAI's error shape.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from symbiont.adapters.flags import AdapterFlags, unused_by
from symbiont.adapters.names import JOB_METHODS, METHODS

FILE_PURPOSE = "fine-tune"
BASE_LEARNING_RATE = 2e-4  # times learning_rate_multiplier
MAX_EPOCHS = 50
MAX_BATCH_SIZE = 256
MAX_LR_MULTIPLIER = 10.0
MAX_RANK = 256
MAX_ALPHA = 1e6  # LoRA alpha (scale alpha / r): past it the adapter is noise
MAX_SUFFIX = 64
AUTO = {"n_epochs": 3, "batch_size": 4, "learning_rate_multiplier": 1.0}


class JobsError(ValueError):
    """Refused input: `status` is the HTTP status, `param` the field at fault."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code=None, retry_after=None
    ):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code
        self.retry_after = retry_after  # seconds, for 429 and a 503 while starting


def invalid(message: str, param: str | None) -> JobsError:
    return JobsError(400, message, param, "invalid_request_error")


# -- training files ---------------------------------------------------------------------


def parse_training_file(content: bytes, name: str = "file") -> list[tuple[int, dict]]:
    """(line number, record) of every non-blank line of a fine-tuning JSONL file; raises
    JobsError naming the first bad line and what is wrong with it."""
    if not content.strip():
        raise invalid(f"{name} is empty; upload JSONL with one training record per line", "file")
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError as err:
        raise invalid(
            f"{name} is not UTF-8 text (byte {err.start}); upload JSONL", "file"
        ) from None
    records = []
    # Lines end at "\n" only, as JSONL's and `symbiont finetune`'s: splitlines() would
    # also split at U+2028, U+0085 ... which JSON strings may hold raw.
    for number, line in enumerate(text.split("\n"), start=1):
        line = line.removesuffix("\r")
        if line.strip():
            records.append((number, _record(line, f"{name} line {number}")))
    return records


def _record(line: str, where: str) -> dict:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise invalid(
            f"{where}: not valid JSON ({err.msg} at column {err.colno})", "file"
        ) from None
    except (ValueError, RecursionError) as err:  # an int of over 4300 digits, deep nesting
        raise invalid(
            f"{where}: not valid JSON here ({err or 'nested too deep'})", "file"
        ) from None
    if not isinstance(record, dict):
        raise invalid(f"{where}: expected a JSON object, got {type(record).__name__}", "file")
    try:  # JSON may escape a lone UTF-16 surrogate, which no tokenizer takes
        json.dumps(record, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise invalid(
            f"{where}: a string holds a lone surrogate escape (\\ud800-\\udfff), which is not "
            "text; fix the encoding of this record",
            "file",
        ) from None
    if "messages" in record:
        _check_messages(record["messages"], where)
    elif "prompt" in record or "completion" in record:
        for key in ("prompt", "completion"):
            if not isinstance(record.get(key), str):
                raise invalid(f"{where}: '{key}' must be a string", "file")
        if not record["completion"]:
            raise invalid(f"{where}: 'completion' is empty; there is nothing to learn", "file")
    else:
        raise invalid(
            f"{where}: a record needs 'messages' (a chat) or 'prompt' and 'completion'; "
            f"it has {sorted(record)}",
            "file",
        )
    return record


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")  # OpenAI's chat roles


def _check_messages(messages: Any, where: str) -> None:
    if not isinstance(messages, list) or not messages:
        raise invalid(f"{where}: 'messages' must be a non-empty list", "file")
    for index, message in enumerate(messages):
        if not (
            isinstance(message, dict)
            and isinstance(message.get("role"), str)
            and isinstance(message.get("content"), str)
        ):
            raise invalid(
                f"{where}: messages[{index}] must be an object with string 'role' and 'content'",
                "file",
            )
        if message["role"] not in CHAT_ROLES:  # else refused only at job creation
            raise invalid(
                f"{where}: messages[{index}].role {_short(message['role'])} is not one of "
                f"{', '.join(CHAT_ROLES)}",
                "file",
            )
    if not any(m["role"] == "assistant" and m["content"] for m in messages):
        raise invalid(
            f"{where}: no assistant turn with content; each chat needs an 'assistant' message "
            "to learn from",
            "file",
        )


# -- job requests -----------------------------------------------------------------------


@dataclass(frozen=True)
class JobSpec:
    """A validated job request, stored with the job (so a restart trains the same way)."""

    model: str
    training_file: str
    validation_file: str | None
    suffix: str | None
    n_epochs: int
    batch_size: int
    learning_rate_multiplier: float
    seed: int
    peft: dict  # AdapterFlags fields
    checkpoint_every: int  # optimizer steps between checkpoints (0: a tenth of the run)
    metadata: dict | None = field(default=None)
    # positions per co-serving window (--slo-tpot-ms; 0: sized from the cost model when the
    # job first starts). Fixed per job, so its result does not depend on the load
    window_positions: int = 0

    @property
    def learning_rate(self) -> float:
        return BASE_LEARNING_RATE * self.learning_rate_multiplier

    def adapter_flags(self) -> AdapterFlags:
        return AdapterFlags(**self.peft)

    def as_record(self) -> dict:
        return asdict(self)


def job_spec(body: dict, base_model: str) -> JobSpec:
    """The JobSpec of a `POST /v1/fine_tuning/jobs` body (extra fields included: `peft`,
    `checkpoint_every`); raises JobsError naming the first bad field."""
    if not isinstance(body, dict):
        raise invalid("the body must be a JSON object", None)
    _known_fields(body)
    model = _required_str(body, "model")
    if model != base_model:
        raise JobsError(
            404,
            f"model: {model!r} cannot be fine-tuned here; this server fine-tunes its base "
            f"model {base_model!r}",
            "model",
            "model_not_found",
        )
    hyper = _hyperparameters(body)
    return JobSpec(
        model=model,
        training_file=_required_str(body, "training_file"),
        validation_file=_optional_str(body, "validation_file"),
        suffix=_suffix(body.get("suffix")),
        n_epochs=_int(hyper, "n_epochs", 1, MAX_EPOCHS),
        batch_size=_int(hyper, "batch_size", 1, MAX_BATCH_SIZE),
        learning_rate_multiplier=_multiplier(hyper),
        seed=_seed(body.get("seed")),
        peft=_peft(body.get("peft")),
        checkpoint_every=_checkpoint_every(body.get("checkpoint_every")),
        metadata=_metadata(body.get("metadata")),
        window_positions=_window_positions(body.get("window_positions")),
    )


JOB_FIELDS = (
    "model", "training_file", "validation_file", "suffix", "hyperparameters", "method",
    "seed", "metadata", "integrations", "peft", "checkpoint_every", "window_positions",
)  # fmt: skip


def _known_fields(body: dict) -> None:
    """400 for a field this server does not read (a typo was silently ignored, where a
    nested one was refused), and for `integrations`, which it does not offer."""
    unknown = sorted(key for key in body if key not in JOB_FIELDS)
    if unknown:
        raise invalid(
            f"{unknown[0]}: unknown field; a job takes {', '.join(JOB_FIELDS)}", unknown[0]
        )
    if body.get("integrations"):
        raise invalid("integrations: not offered by this server; leave it out", "integrations")


def _required_str(body: dict, key: str) -> str:
    value = body.get(key)
    if not isinstance(value, str) or not value:
        raise invalid(f"{key}: required, a non-empty string", key)
    return value


def _optional_str(body: dict, key: str) -> str | None:
    value = body.get(key)
    if value is not None and (not isinstance(value, str) or not value):
        raise invalid(f"{key}: must be a file id (a non-empty string) or null", key)
    return value


def _suffix(value) -> str | None:
    if value is None:
        return None
    ok = isinstance(value, str) and 0 < len(value) <= MAX_SUFFIX
    if not ok or not all(c.isalnum() or c in "-_." for c in value):
        raise invalid(
            f"suffix: up to {MAX_SUFFIX} letters, digits, '-', '_' or '.'; got {_short(value)}",
            "suffix",
        )
    return value


def _hyperparameters(body: dict) -> dict:
    """`hyperparameters`, or OpenAI's newer `method.supervised.hyperparameters`."""
    hyper = body.get("hyperparameters")
    method = body.get("method")
    if method is not None:
        if not isinstance(method, dict) or method.get("type", "supervised") != "supervised":
            kind = method.get("type") if isinstance(method, dict) else method
            raise invalid(
                f"method.type: only 'supervised' fine-tuning is offered, got {kind!r}",
                "method",
            )
        supervised = method.get("supervised") or {}
        if not isinstance(supervised, dict):
            raise invalid(
                "method.supervised: must be an object such as {'hyperparameters': {...}}",
                "method.supervised",
            )
        nested = supervised.get("hyperparameters")
        if nested is not None:
            if hyper is not None:
                raise invalid(
                    "hyperparameters: given twice (also in method.supervised); give one",
                    "hyperparameters",
                )
            hyper = nested
    if hyper is None:
        hyper = {}
    if not isinstance(hyper, dict):
        raise invalid("hyperparameters: must be an object", "hyperparameters")
    unknown = sorted(set(hyper) - set(AUTO))
    if unknown:
        raise invalid(
            f"hyperparameters.{unknown[0]}: unknown; the hyperparameters are {', '.join(AUTO)}",
            f"hyperparameters.{unknown[0]}",
        )
    return {key: AUTO[key] if hyper.get(key, "auto") == "auto" else hyper[key] for key in AUTO}


def _int(hyper: dict, key: str, low: int, high: int) -> int:
    value = hyper[key]
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise invalid(
            f"hyperparameters.{key}: must be 'auto' or an integer in [{low}, {high}], "
            f"got {_short(value)}",
            f"hyperparameters.{key}",
        )
    return value


def _multiplier(hyper: dict) -> float:
    value = hyper["learning_rate_multiplier"]
    if not _finite(value) or not 0 < value <= MAX_LR_MULTIPLIER:
        raise invalid(
            "hyperparameters.learning_rate_multiplier: must be 'auto' or a number in "
            f"(0, {MAX_LR_MULTIPLIER:g}], got {_short(value)}",
            "hyperparameters.learning_rate_multiplier",
        )
    return float(value)


def _seed(value) -> int:
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**31:
        raise invalid(f"seed: must be an integer in [0, 2147483647], got {_short(value)}", "seed")
    return value


def _checkpoint_every(value) -> int:
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise invalid(
            f"checkpoint_every: must be an integer >= 1 (optimizer steps), got {_short(value)}",
            "checkpoint_every",
        )
    return value


def _window_positions(value) -> int:
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise invalid(
            f"window_positions: must be an integer >= 1 (positions per co-serving window), "
            f"got {_short(value)}",
            "window_positions",
        )
    return value


def _metadata(value) -> dict | None:
    if value is None:
        return None
    ok = isinstance(value, dict) and len(value) <= 16
    if not ok or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise invalid("metadata: up to 16 string keys with string values", "metadata")
    return value


PEFT_KEYS = {"method", "r", "alpha", "dropout", "target_modules"}


def _peft(value) -> dict:
    """PEFT settings (`extra_body={"peft": {...}}`) as AdapterFlags fields."""
    if value is None:
        value = {}
    if not isinstance(value, dict):
        raise invalid("peft: must be an object such as {'method': 'lora', 'r': 8}", "peft")
    unknown = sorted(set(value) - PEFT_KEYS)
    if unknown:
        raise invalid(
            f"peft.{unknown[0]}: unknown; the PEFT settings are {', '.join(sorted(PEFT_KEYS))}",
            f"peft.{unknown[0]}",
        )
    method = value.get("method", "lora")
    if method not in JOB_METHODS:
        known = method in METHODS
        raise invalid(
            f"peft.method: {method!r} "
            + ("is not trained by jobs, which train " if known else "is not one of ")
            + f"{', '.join(JOB_METHODS)}; use one of those (or train it with `symbiont "
            "finetune` and serve the folder with --adapter-dir)",
            "peft.method",
        )
    r = value.get("r", 8)
    if isinstance(r, bool) or not isinstance(r, int) or not 1 <= r <= MAX_RANK:
        raise invalid(f"peft.r: must be an integer in [1, {MAX_RANK}], got {_short(r)}", "peft.r")
    alpha = value.get("alpha")
    if alpha is not None and (not _finite(alpha) or not 0 < alpha <= MAX_ALPHA):
        # a NaN stored in the job would make every read of the tenant's jobs fail
        raise invalid(
            f"peft.alpha: must be a number in (0, {MAX_ALPHA:g}], got {_short(alpha)}", "peft.alpha"
        )
    dropout = value.get("dropout", 0.0)
    if isinstance(dropout, bool) or not isinstance(dropout, int | float) or not 0 <= dropout < 1:
        raise invalid(f"peft.dropout: must be in [0, 1), got {dropout!r}", "peft.dropout")
    named = {"r": "r", "alpha": "alpha", "dropout": "dropout", "target_modules": "target"}
    unused = unused_by(method, {named[key] for key in named if key in value})
    if unused:
        key = next(k for k, field in named.items() if field == unused[0])
        raise invalid(f"peft.{key}: method {method!r} does not use it; leave it out", f"peft.{key}")
    flags = {"method": method, "r": r, "alpha": alpha, "dropout": float(dropout)}
    flags["target"] = _targets(value.get("target_modules"))
    try:
        AdapterFlags(**flags)
    except ValueError as err:
        raise invalid(f"peft: {err}", "peft") from None
    return flags


def _targets(value) -> str | None:
    if value is None or value == "all-linear":
        return value
    ok = isinstance(value, list) and value and all(isinstance(t, str) and t for t in value)
    if not ok:
        raise invalid(
            "peft.target_modules: 'all-linear' or a non-empty list of module names such as "
            f"['q_proj', 'v_proj'], got {_short(value)}",
            "peft.target_modules",
        )
    return ",".join(value)


def _finite(value) -> bool:
    """A JSON number that is not NaN or infinite (an int of any size is finite; math's
    isfinite overflows on one beyond a float's range)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return isinstance(value, int) or math.isfinite(value)


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
