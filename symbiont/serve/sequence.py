"""Typed requests, sequences and outputs that flow through the engine."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import StrEnum

import torch


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request samples; temperature 0 means greedy (argmax)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    n: int = 1
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class SeqStatus(StrEnum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(StrEnum):
    STOP = "stop"  # end-of-sequence token or a stop string
    LENGTH = "length"  # max_tokens or the context length reached
    ABORT = "abort"  # cancelled or client disconnected
    ERROR = "error"  # failed; the request's error says why


@dataclass(eq=False)
class Sequence:
    """One generated continuation (a request with n=3 has three)."""

    request_id: str
    index: int  # choice index within the request
    prompt_len: int
    token_ids: list[int]  # prompt followed by generated tokens
    params: SamplingParams
    adapter_slot: int  # 0 = base model, no adapter
    generator: torch.Generator | None
    status: SeqStatus = SeqStatus.WAITING
    num_computed: int = 0  # tokens whose keys/values are in the KV cache
    blocks: list[int] = field(default_factory=list)  # KV block table
    finish_reason: FinishReason | None = None
    text: str = ""  # detokenized output, stop string removed
    sent_chars: int = 0  # text already delivered to the client
    last_token_time: float | None = None

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    @property
    def num_pending(self) -> int:
        """Tokens not yet in the KV cache (the whole prompt at first, then 1 per decode)."""
        return len(self.token_ids) - self.num_computed

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED


@dataclass(eq=False)
class Request:
    """What a client asked for: a prompt, an adapter (by name), sampling parameters."""

    request_id: str
    prompt_ids: list[int]
    adapter: str | None  # None = the base model
    params: SamplingParams
    arrival: float = field(default_factory=time.monotonic)
    sequences: list[Sequence] = field(default_factory=list)
    error: str | None = None
    first_token_time: float | None = None

    @property
    def finished(self) -> bool:
        return bool(self.sequences) and all(s.finished for s in self.sequences)


@dataclass(frozen=True, slots=True)
class SeqDelta:
    """New output of one sequence after an iteration."""

    index: int
    token_ids: tuple[int, ...]  # tokens generated this iteration
    text: str  # text newly safe to show (stop strings are held back until resolved)
    finish_reason: FinishReason | None


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """What one iteration produced for one request."""

    request_id: str
    deltas: tuple[SeqDelta, ...]
    prompt_tokens: int
    completion_tokens: int
    finished: bool
    error: str | None = None
