"""Typed requests, sequences and outputs that flow through the engine.

Sampling parameters and finish reasons are the ones every decoding path shares
(`symbiont.decoding`); they are re-exported here for the engine's users.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING

from symbiont.decoding import FinishReason, SamplingParams, TextTracker, TokenLogprob

if TYPE_CHECKING:  # the API process imports this module without torch
    import torch

__all__ = [
    "FinishReason",
    "Request",
    "RequestOutput",
    "SamplingParams",
    "SeqDelta",
    "SeqStatus",
    "Sequence",
    "TokenLogprob",
]


class SeqStatus(StrEnum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One generated continuation (a request with n=3 has three)."""

    request_id: str
    index: int  # choice index within the request
    prompt_len: int
    token_ids: list[int]  # prompt followed by generated tokens
    params: SamplingParams
    adapter_slot: int  # 0 = base model, no adapter
    generator: torch.Generator | None  # None when greedy
    text: TextTracker | None = None  # None without a tokenizer (token ids only)
    status: SeqStatus = SeqStatus.WAITING
    num_computed: int = 0  # positions whose keys/values are in the KV cache
    # positions before the prompt from a prompt-learning adapter (virtual tokens or a
    # prefix; `symbiont.serve.virtual_tokens`): token_ids[i] is at position num_virtual + i
    num_virtual: int = 0
    blocks: list[int] = field(default_factory=list)  # KV block table
    finish_reason: FinishReason | None = None
    last_token_time: float | None = None
    # an --adapter-dir adapter: its slot (adapter_slot) is given at admission
    cached_adapter: str | None = None
    adapter_rank: int = 0  # LoRA rank of its adapter (0: none or not LoRA)
    level: int = 0  # MLQ queue, 0 = smallest requests
    admitted_at: float | None = None  # time.monotonic() when it started running

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    @property
    def num_positions(self) -> int:
        """Virtual positions plus tokens: what the KV cache holds once all are computed."""
        return self.num_virtual + len(self.token_ids)

    @property
    def num_pending(self) -> int:
        """Positions not yet in the KV cache (the whole prompt at first, then 1 per decode)."""
        return self.num_positions - self.num_computed

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
    # with params.prompt_logprobs: one entry per prompt token (None for the first, which
    # nothing predicts), filled chunk by chunk as choice 0 prefills
    prompt_logprobs: list[TokenLogprob | None] | None = None
    prompt_logprobs_sent: bool = False
    adapter_counted: bool = False  # its server already counted the adapter cache lookup

    @property
    def finished(self) -> bool:
        return bool(self.sequences) and all(s.finished for s in self.sequences)

    @property
    def prompt_scored(self) -> bool:
        """Whether every prompt token asked for has its log-probability."""
        scores = self.prompt_logprobs
        return scores is not None and len(scores) == len(self.prompt_ids)


@dataclass(frozen=True, slots=True)
class SeqDelta:
    """New output of one sequence after an iteration."""

    index: int
    token_ids: tuple[int, ...]  # tokens generated this iteration
    text: str  # text newly safe to show (stop strings are held back until resolved)
    finish_reason: FinishReason | None
    logprobs: tuple[TokenLogprob, ...] | None = None  # one per token, when asked for


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """What one iteration produced for one request."""

    request_id: str
    deltas: tuple[SeqDelta, ...]
    prompt_tokens: int
    completion_tokens: int
    finished: bool
    error: str | None = None
    # once, in the output of the iteration that scored the prompt's last token
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
