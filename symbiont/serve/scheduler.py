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
line (DeltaZip preempts skippers when their parent finishes; we never preempt).

Which slot the waiting sequence gets is decided when it first finds none: the resident
folder adapter whose running sequences have the fewest positions left to compute (the
slot that frees first, reading `max_tokens` as the length) is *draining*, a reservation
as in EASY backfilling. Skippers whose adapter is another resident one start freely:
they do not delay that slot. Skippers onto the draining slot itself would keep it busy,
so at most `max_skips` of them start past one waiting sequence (0: strict arrival
order, no skipping at all). Without the reservation every skipper extended some slot's
life and the line closed after `max_skips` of them, so on a busy server admission of
folder adapters stopped for as long as the longest running request on any slot.
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
        self._drain: str | None = None  # the folder adapter whose slot it waits for
        self._skips = 0  # sequences that started on that slot since (skip-the-line)

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
        if self.cache is None:
            return Placement.NO_SLOT
        head = seq is self._blocked_head
        if self._slot_blocked and not head and not self._may_skip(seq):
            return Placement.NO_SLOT
        placement, slot = self.cache.place(seq.cached_adapter)
        if placement is Placement.NO_SLOT:
            self._slot_blocked = True
            if not head:  # a new sequence waits: its own reservation and skip count
                self._blocked_head, self._drain, self._skips = seq, None, 0
            if self._drain not in self._busy_adapters():  # none yet, or it freed and was taken
                self._drain = self._drain_target(seq)
        elif placement is Placement.READY and head:
            self._blocked_head = self._drain = None
        seq.adapter_slot = slot
        return placement

    def _may_skip(self, seq: Sequence) -> bool:
        """Whether `seq` may start ahead of the sequence waiting for a slot: its adapter
        is resident (no eviction needed), and if that is the draining slot, fewer than
        `max_skips` started on it already. `max_skips` 0: strict arrival order."""
        if self.config.max_skips == 0:
            return False
        if self.cache.state(seq.cached_adapter) is not AdapterState.RESIDENT:
            return False
        if seq.cached_adapter != self._drain:
            return True  # another slot: the waiting sequence does not wait for it
        if self._skips >= self.config.max_skips:
            return False  # the draining slot is closed until the waiting sequence has it
        self._skips += 1
        return True

    def head_waits_for_slot(self) -> bool:
        """Whether a sequence found no slot and still waits (its reservation holds)."""
        head = self._blocked_head
        return head is not None and head.status is SeqStatus.WAITING

    def _busy_adapters(self) -> dict[str, int]:
        """Folder adapters of running sequences -> the most positions one of them has left
        to compute (prompt chunks and up to `max_tokens` outputs): when its slot frees."""
        left: dict[str, int] = {}
        for seq in self.running:
            if seq.cached_adapter is not None:
                todo = self.reserved_len(seq) - seq.num_computed
                left[seq.cached_adapter] = max(left.get(seq.cached_adapter, 0), todo)
        return left

    def _drain_target(self, head: Sequence) -> str | None:
        """The busy folder adapter whose slot frees first (a delta's, if the waiting
        sequence needs a delta slot): reserved for `head`."""
        left = self._busy_adapters()
        if self.cache.needs_delta_slot(head.cached_adapter):
            left = {name: n for name, n in left.items() if self.cache.is_delta(name)}
        return min(left, key=lambda name: (left[name], name), default=None)

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
