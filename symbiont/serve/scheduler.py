"""Iteration-level scheduling with chunked prefill (Orca, Sarathi; FlexLLM 6.2).

Every iteration: each running sequence that is decoding gets one token, then prefills
(running ones first, then newly admitted ones in admission order) get chunks of what is
left of the token budget. A sequence is admitted only when KV blocks for its prompt
and all of its `max_tokens` can be reserved, so a running sequence is never preempted.

`Scheduler` admits in arrival order (FIFO); `symbiont.serve.mlq.MLQScheduler` orders
admission by Chameleon's queues. Both stop at the first sequence that does not fit (no
running room or KV blocks), so a large request is not overtaken forever. A sequence whose
`--adapter-dir` adapter is still loading is skipped (others go on meanwhile); one that
needs a slot when every slot is in use by running sequences stops the admission of
other folder adapters until a slot frees, so it cannot starve behind popular ones;
except that, as in DeltaZip, sequences whose adapter or delta is resident may skip the
line, at most `max_skips` past one waiting sequence (DeltaZip preempts skippers when
their parent finishes; we never preempt, so skipping is bounded by count instead).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

import torch

from symbiont.serve.adapter_cache import AdapterCache, AdapterState, Placement
from symbiont.serve.config import EngineConfig
from symbiont.serve.kv_cache import PagedKVCache
from symbiont.serve.sequence import SeqStatus, Sequence
from symbiont.serve.virtual_tokens import VirtualTokens, write_prefix


class QueueFull(RuntimeError):
    """The waiting queue is at `max_queue`; retry later (HTTP 429)."""


@dataclass(frozen=True, slots=True)
class ScheduledSeq:
    seq: Sequence
    n_tokens: int  # positions of this sequence computed this iteration (1 when decoding)

    @property
    def start(self) -> int:
        """The chunk's first position (virtual positions of a prompt-learning adapter
        come first: `Sequence.num_virtual`)."""
        return self.seq.num_computed

    @property
    def reaches_end(self) -> bool:
        """Whether this chunk reaches the end of the sequence's tokens."""
        return self.seq.num_computed + self.n_tokens == self.seq.num_positions

    @property
    def samples(self) -> bool:
        """Whether a token is sampled after this chunk (not for a prompt-only request,
        `max_tokens` 0, which ends once its prompt is scored)."""
        return self.reaches_end and self.seq.params.max_tokens > 0

    @property
    def prompt_rows(self) -> range:
        """Positions of this chunk whose logits score the next prompt token: only for
        choice 0 of a request that asked for prompt log-probabilities."""
        seq = self.seq
        if seq.index != 0 or seq.params.prompt_logprobs is None:
            return range(0)
        first, last = seq.num_virtual, seq.num_virtual + seq.prompt_len - 1
        return range(max(self.start, first), min(self.start + self.n_tokens, last))


class Admit(Enum):
    OK = "ok"
    NO_ROOM = "no_room"  # no running room or KV blocks: admission stops here
    LOADING = "loading"  # its adapter is being read from disk: skipped this iteration
    WAIT = "wait"  # its adapter needs a slot none can give now: skipped this iteration


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        kv_cache: PagedKVCache,
        max_model_len: int,
        cache: AdapterCache | None = None,
        virtual_tokens: Callable[[int], VirtualTokens | None] | None = None,
    ):
        self.config = config
        self.kv_cache = kv_cache
        self.max_model_len = max_model_len
        self.cache = cache  # adapters of --adapter-dir, placed in slots at admission
        # slot -> the prompt-learning positions of its adapter (the registry's answer)
        self.virtual_tokens = virtual_tokens or _no_virtual_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._slot_blocked = False  # this iteration, a folder adapter found no slot
        self._blocked_head: Sequence | None = None  # the last sequence that found none
        self._skips = 0  # sequences admitted ahead of it since (skip-the-line)

    def add(self, seqs: list[Sequence]) -> None:
        if len(self.waiting) + len(seqs) > self.config.max_queue:
            raise QueueFull(
                f"the request queue is full ({len(self.waiting)} waiting, max_queue="
                f"{self.config.max_queue}); retry later"
            )
        self.waiting.extend(seqs)

    def schedule(self) -> list[ScheduledSeq]:
        budget = self.config.max_batched_tokens
        batch = [ScheduledSeq(s, 1) for s in self.running if s.num_pending == 1]
        budget -= len(batch)
        for seq in self.running:
            if seq.num_pending > 1 and budget > 0:
                batch.append(ScheduledSeq(seq, min(seq.num_pending, budget)))
                budget -= batch[-1].n_tokens
        self._slot_blocked = False
        self.admit_waiting(batch, budget)
        return batch

    def admit_waiting(self, batch: list[ScheduledSeq], budget: int) -> int:
        """Admit waiting sequences in arrival order into `batch`; -> the budget left."""
        for seq in list(self.waiting):
            if budget <= 0:
                break
            verdict = self.try_admit(seq)
            if verdict is Admit.NO_ROOM:
                break
            if verdict is Admit.OK:
                budget = self.start(seq, batch, budget)
        return budget

    def start(self, seq: Sequence, batch: list[ScheduledSeq], budget: int) -> int:
        """Schedule the first chunk of a just-admitted sequence; -> the budget left."""
        batch.append(ScheduledSeq(seq, min(seq.num_pending, budget)))
        return budget - batch[-1].n_tokens

    def try_admit(self, seq: Sequence) -> Admit:
        """Move `seq` from waiting to running if there is room and its adapter is resident."""
        if len(self.running) >= self.config.max_running:
            return Admit.NO_ROOM
        need = self.kv_cache.blocks_for(self.reserved_len(seq))
        if not self.kv_cache.allocator.can_allocate(need):
            return Admit.NO_ROOM
        placement = self._place_adapter(seq)
        if placement is not Placement.READY:
            return Admit.LOADING if placement is Placement.LOADING else Admit.WAIT
        virtual = self.virtual_tokens(seq.adapter_slot) if seq.num_computed == 0 else None
        if virtual is not None:  # known once the adapter has its slot
            seq.num_virtual = virtual.count
            need = self.kv_cache.blocks_for(self.reserved_len(seq))
            if not self.kv_cache.allocator.can_allocate(need):
                return Admit.NO_ROOM  # it keeps its slot: admission stops at it
        seq.blocks = self.kv_cache.allocator.allocate(need)
        if virtual is not None and virtual.precomputed:  # a prefix: in the cache already
            slots = self.kv_cache.slots(seq.blocks, 0, virtual.count)
            write_prefix(self.kv_cache, virtual, torch.tensor(slots, device=self.kv_cache.device))
            seq.num_computed = virtual.count
        seq.status = SeqStatus.RUNNING
        seq.admitted_at = time.monotonic()
        self.running.append(seq)
        self.waiting.remove(seq)
        return Admit.OK

    def _place_adapter(self, seq: Sequence) -> Placement:
        """Put `seq`'s adapter in a slot if it can (READY), or say why not."""
        if seq.cached_adapter is None or seq.adapter_slot:
            return Placement.READY
        if self.cache is None or (self._slot_blocked and not self._may_skip(seq)):
            return Placement.NO_SLOT
        placement, slot = self.cache.place(seq.cached_adapter)
        if placement is Placement.NO_SLOT:
            self._slot_blocked = True
            if seq is not self._blocked_head:  # a new sequence waits: its own skip count
                self._blocked_head, self._skips = seq, 0
        seq.adapter_slot = slot
        return placement

    def _may_skip(self, seq: Sequence) -> bool:
        """Whether `seq` may start ahead of the sequence waiting for a slot: its adapter
        is resident (no eviction needed) and fewer than `max_skips` did so already."""
        if self._skips >= self.config.max_skips:
            return False  # the line is closed until the waiting sequence has its slot
        if self.cache.state(seq.cached_adapter) is not AdapterState.RESIDENT:
            return False
        self._skips += 1
        return True

    def reserved_len(self, seq: Sequence) -> int:
        return min(seq.prompt_len + seq.params.max_tokens, self.max_model_len) + seq.num_virtual

    def finish(self, seq: Sequence) -> None:
        """Drop a finished (or aborted) sequence and free its KV blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv_cache.allocator.free(seq.blocks)
        seq.blocks = []
        seq.status = SeqStatus.FINISHED

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)


def _no_virtual_tokens(slot: int) -> None:
    """No adapter adds positions (a scheduler without an adapter registry)."""
    return None
