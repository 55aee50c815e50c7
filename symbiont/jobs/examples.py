"""Training files to tokenized examples, checked against the model's context.

Used twice with the same result: when a job is created (so a record too long for the
context is refused with its line, before the job exists) and when the job runs.
"""

from __future__ import annotations

import threading

from symbiont.jobs.validation import invalid, parse_training_file
from symbiont.train.data import DataError, Example, Record, tokenize_records

_UNTRUNCATED = 1 << 40  # tokenize whole records; the context check below refuses long ones


class Tokenizing:
    """A tokenizer of the base model for the jobs API alone (fast tokenizers may not be
    used from two threads at once; the engine keeps its own), behind a lock."""

    def __init__(self, tokenizer, max_length: int):
        self.tokenizer = tokenizer
        self.max_length = max_length  # the serving context: prompt + completion tokens
        self._lock = threading.Lock()

    def examples(self, content: bytes, file_id: str, param: str) -> list[Example]:
        """Every record of a stored training file as an Example; JobsError (naming `param`
        and the line) for a malformed record or one longer than the context."""
        try:
            records = parse_training_file(content, file_id)
        except ValueError as err:  # JobsError: re-aimed at the job's field
            raise invalid(str(err), param) from None
        with self._lock:
            return [self._example(number, fields, file_id, param) for number, fields in records]

    def _example(self, number: int, fields: dict, file_id: str, param: str) -> Example:
        where = f"{file_id} line {number}"
        if "messages" in fields and not getattr(self.tokenizer, "chat_template", None):
            raise invalid(
                f"{where}: chat ('messages') records need a base model with a chat template; "
                "this one has none, so use 'prompt'/'completion' records",
                param,
            )
        try:
            (example,) = tokenize_records([Record(fields, where)], self.tokenizer, _UNTRUNCATED)
        except DataError as err:
            message = str(err) if str(err).startswith(where) else f"{where}: {err}"
            raise invalid(message, param) from None
        except Exception as err:  # noqa: BLE001 - the tokenizer or its chat template refused it
            raise invalid(
                f"{where}: the tokenizer refused this record ({type(err).__name__}: {err})", param
            ) from None
        if len(example.input_ids) > self.max_length:
            raise invalid(
                f"{where}: {len(example.input_ids)} tokens, longer than the model's context "
                f"({self.max_length} tokens); shorten or split this record",
                param,
            )
        return example
