"""Per-layer queues and the policies that decide which layer runs next (Symbiosis 3.7).

The executor is stateless per call (3.6), so calls of one layer from any clients, in
either direction, may run in one visit of that layer: forward calls are concatenated
along the token dimension into one matmul, backward calls into another, and the
results are split back per call. No padding: calls are [n_tokens, width] already.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from symbiont.base.config import BatchingPolicy, PolicyKind
from symbiont.protocol.executor import Op

FORWARD_OPS = frozenset({Op.FORWARD, Op.EXPERTS_FORWARD})
GAP_EMA = 0.25  # weight of the newest sample in a client's pace
GAP_SAMPLE_CAP_S = 0.1  # a pause between requests is not the client's pace
LATE_SLACK_S = 1e-3  # a client later than twice its pace plus this is not waited for
MAX_HOPS = 8  # how many calls ahead a client's arrival is predicted


@dataclass(eq=False)
class Session:
    """One connected client, as the executor sees it."""

    key: bytes  # ZeroMQ routing id of its connection
    label: str
    pid: int
    host: str
    endpoint: str
    connected_at: float
    segment: object = None  # shm.Segment once the client attached shared memory
    seen_seq: int = 0  # last shared-memory request sequence number taken
    spin: bool = True  # False: its client asked (ATTACH) that the executor not spin
    pending: object = None  # (Call message, x, bytes received) of a CALL sent in DATA parts
    waiting: bool = False  # has a call queued or running
    last_reply: float = float("-inf")  # monotonic time its last call was answered
    last_seen: float = 0.0
    last_layer: int = 0  # layer and direction of its latest call: where it is in the model
    last_op: Op = Op.FORWARD
    calls: int = 0
    tokens: int = 0
    # Learned by the scheduler, for arrival-aware batching: how long the client computes
    # between an answer and its next call (moving average), and which call follows which
    # ((op, layer) -> (op, layer)); a client repeats the same sequence every model pass.
    gap_s: float | None = None
    next_of: dict = field(default_factory=dict)


@dataclass(eq=False)
class Call:
    """One queued layer call. x [n_tokens, in] for FORWARD, [n_tokens, out] for BACKWARD."""

    session: Session
    call_id: int
    op: Op
    layer: int
    x: torch.Tensor
    arrived: float
    via_shm: bool = False
    extra: tuple[int, ...] = ()  # forward only: more layers fed the same x (q/k/v, gate/up)
    # experts ops (`layer` is then the experts' slot, after the linear layers): x is
    # hidden [n_tokens, H], with ids and routing weights [n_tokens, k] and grad_y [n_tokens, H]
    ids: torch.Tensor | None = None
    weights: torch.Tensor | None = None
    grad_y: torch.Tensor | None = None
    frames: list = field(default_factory=list)  # keeps received buffers alive
    answered: bool = False  # a worker already wrote its answer into shared memory

    @property
    def tokens(self) -> int:
        return self.x.shape[0]


class Scheduler:
    """Queues calls per layer; `pop_ready` hands out the next batch under the policy."""

    def __init__(
        self,
        policy: BatchingPolicy,
        sessions: dict[bytes, Session],
        n_layers: int,
        positions: list[int] | None = None,
    ):
        self.policy = policy
        self.n_layers = n_layers
        # queue key -> its place in a forward pass (experts stacks sit between linear layers)
        self.pos = positions or list(range(n_layers))
        self.sessions = sessions
        self.queues: dict[int, list[Call]] = {}
        self.fifo: deque[Call] = deque()  # arrival order, for no-lockstep
        self.deadline: dict[int, float] = {}  # layer -> when its most impatient call is due
        self.lockstep_timeout_s = max(policy.max_wait_s, 1.0)
        # Whether the opportunistic policy may hold calls to merge them; the server turns
        # it off while every client can have a worker thread of its own (see the server's
        # `_fit_to_sessions`), and the calls then run one by one in arrival order.
        self.merge = True

    def __len__(self) -> int:
        return len(self.fifo)

    def submit(self, call: Call) -> None:
        session = call.session
        if session.last_reply > float("-inf"):  # learn its pace and its call sequence
            gap = min(max(call.arrived - session.last_reply, 0.0), GAP_SAMPLE_CAP_S)
            old = session.gap_s
            session.gap_s = gap if old is None else old + GAP_EMA * (gap - old)
            session.next_of[(session.last_op, session.last_layer)] = (call.op, call.layer)
        session.waiting = True
        session.last_layer = call.layer
        session.last_op = call.op
        self.fifo.append(call)
        queue = self.queues.setdefault(call.layer, [])
        queue.append(call)
        due = call.arrived + self.policy.wait_for(call.tokens)
        self.deadline[call.layer] = min(self.deadline.get(call.layer, due), due)

    def pop_ready(self, now: float) -> list[Call] | None:
        """The calls of one layer to run now, or None if the policy says wait."""
        if not self.fifo:
            return None
        kind = self.policy.kind
        if kind is PolicyKind.NO_LOCKSTEP or (kind is PolicyKind.OPPORTUNISTIC and not self.merge):
            return self._take(self.fifo[0].layer, limit=1)
        layer = self._lockstep(now) if kind is PolicyKind.LOCKSTEP else self._opportunistic(now)
        return None if layer is None else self._take(layer)

    def next_wake(self, now: float) -> float | None:
        """Seconds until a waiting queue may become due (None: nothing waits)."""
        if not self.fifo:
            return None
        if self.policy.kind is PolicyKind.LOCKSTEP:
            return max(0.0, self.fifo[0].arrived + self.lockstep_timeout_s - now)
        return max(0.0, min(self.deadline.values()) - now)

    def drop_session(self, session: Session) -> None:
        """Forget the queued calls of a client that left."""
        for layer in list(self.queues):
            rest = [c for c in self.queues[layer] if c.session is not session]
            self.queues.pop(layer)
            self.deadline.pop(layer)
            if rest:
                self._requeue(layer, rest)
        self.fifo = deque(c for c in self.fifo if c.session is not session)

    # -- policies -------------------------------------------------------------

    def _opportunistic(self, now: float) -> int | None:
        """A call that waited `max_wait_s` runs first. Otherwise, of the queues that are due
        (a call's own wait is over, they are full, or no client worth waiting for is on its
        way), the one earliest in the model pass runs: clients behind catch up with those
        ahead, which wait for them, and their calls merge into one batch."""
        oldest = self.fifo[0]
        if now - oldest.arrived >= self.policy.max_wait_s:
            return oldest.layer
        due = [
            layer
            for layer, queue in self.queues.items()
            if self.deadline[layer] <= now
            or sum(c.tokens for c in queue) >= self.policy.max_batch_tokens
            or not self._could_join(layer, queue, now)
        ]
        return min(due, key=self._position) if due else None

    def _position(self, layer: int) -> int:
        """Order of a queue in a model pass: forward 0..N-1, then backward N-1..0."""
        if any(c.op in FORWARD_OPS for c in self.queues[layer]):
            return self.pos[layer]
        return 2 * self.n_layers - 1 - self.pos[layer]

    def _could_join(self, layer: int, queue: list[Call], now: float) -> bool:
        """Is a client not in `queue` expected at `layer` before the queue must run anyway?
        Arrival-aware: a client's next calls are predicted from the sequence it called
        in earlier passes, and when each comes from its pace (its compute between an
        answer and its next call); a client that is idle, overdue by more than its pace,
        or not due here before the queue's deadline holds nobody. With every active
        client queued here, the queue runs at once (lockstep's batch, without its wait)."""
        inside = {c.session for c in queue}
        deadline = self.deadline[layer]
        for s in self.sessions.values():
            if s not in inside:
                eta = self._eta(s, layer, now)
                if eta is not None and eta <= deadline:
                    return True
        return False

    def _eta(self, s: Session, layer: int, now: float) -> float | None:
        """When `s` is expected to call `layer` (None: not soon)."""
        if s.gap_s is None or not s.next_of:
            return self._eta_unlearned(s, layer, now)
        if s.waiting:
            # Queued elsewhere: its call runs first, then it computes and calls again. Not
            # waited for if that queue comes later in the pass (it would wait for us too).
            mine = self.pos[s.last_layer]
            if s.last_op not in FORWARD_OPS:
                mine = 2 * self.n_layers - 1 - mine
            if mine >= self._position(layer):
                return None
            base = now
        else:
            late = now - s.last_reply - s.gap_s
            if late > s.gap_s + LATE_SLACK_S:
                return None  # idle, between requests, or stalled: do not wait for it
            base = s.last_reply
        step = (s.last_op, s.last_layer)
        for hops in range(1, MAX_HOPS + 1):
            step = s.next_of.get(step)
            if step is None:
                return None
            if step[1] == layer:
                return max(base + hops * s.gap_s, now)
        return None

    def _eta_unlearned(self, s: Session, layer: int, now: float) -> float | None:
        """Before a client's pace is known: clients call layers in model order (ids
        ascending forward, descending backward), so one that last called a layer up to
        half a model pass before `layer` and was active within `max_wait_s` may arrive."""
        if not s.waiting and now - s.last_reply >= self.policy.max_wait_s:
            return None
        ahead = self.pos[layer] - self.pos[s.last_layer]
        ahead = ahead if s.last_op in FORWARD_OPS else -ahead
        return now if 0 < ahead % self.n_layers <= max(1, self.n_layers // 2) else None

    def _lockstep(self, now: float) -> int | None:
        oldest = self.fifo[0]
        if now - oldest.arrived >= self.lockstep_timeout_s:
            return oldest.layer
        active = self._active(now)
        for layer, queue in self.queues.items():
            if active <= {c.session for c in queue}:
                return layer
        if not self._others_expected(now, self.lockstep_timeout_s):
            # Everyone waits, at different layers: nobody can catch up, run the fullest.
            return max(self.queues, key=lambda layer: len(self.queues[layer]))
        return None

    def _active(self, now: float) -> set[Session]:
        window = self.lockstep_timeout_s
        return {s for s in self.sessions.values() if s.waiting or now - s.last_reply < window}

    def _others_expected(self, now: float, window: float) -> bool:
        """Could a client that is not waiting send a call soon? (it did within `window`)"""
        return any(not s.waiting and now - s.last_reply < window for s in self.sessions.values())

    # -- queue bookkeeping ----------------------------------------------------

    def _take(self, layer: int, limit: int | None = None) -> list[Call]:
        """Remove and return calls of `layer` (up to `limit` or `max_batch_tokens`)."""
        queue = self.queues.pop(layer)
        self.deadline.pop(layer)
        taken, rest, tokens = [], [], 0
        for call in queue:
            full = (limit is not None and len(taken) >= limit) or (
                taken and tokens + call.tokens > self.policy.max_batch_tokens
            )
            if full:
                rest.append(call)
            else:
                taken.append(call)
                tokens += call.tokens
        if rest:
            self._requeue(layer, rest)
        gone = set(map(id, taken))
        self.fifo = deque(c for c in self.fifo if id(c) not in gone)
        return taken

    def _requeue(self, layer: int, calls: list[Call]) -> None:
        self.queues[layer] = calls
        self.deadline[layer] = min(c.arrived + self.policy.wait_for(c.tokens) for c in calls)
