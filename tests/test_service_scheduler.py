"""Batching policies on fake sessions and calls: no sockets, no model."""

from __future__ import annotations

import pytest
import torch

from symbiont.base.config import BatchingPolicy, PolicyKind, ServiceConfig
from symbiont.base.scheduler import Call, Scheduler, Session
from symbiont.protocol.executor import Op


def sessions(count: int) -> dict[bytes, Session]:
    return {bytes([i]): Session(bytes([i]), f"c{i}", 0, "h", "local", 0.0) for i in range(count)}


def call(session, layer, tokens, at, op=Op.FORWARD):
    return Call(session, 0, op, layer, torch.zeros(tokens, 4), at)


def scheduler(kind=PolicyKind.OPPORTUNISTIC, count=3, **kw):
    table = sessions(count)
    return Scheduler(BatchingPolicy(kind=kind, **kw), table, n_layers=16), list(table.values())


def test_waits_grow_with_size_and_are_capped():
    policy = BatchingPolicy(max_wait_s=0.01, wait_per_token_s=1e-4)
    assert policy.wait_for(1) == pytest.approx(1e-4)
    assert policy.wait_for(50) == pytest.approx(5e-3)
    assert policy.wait_for(10_000) == 0.01, "the cap bounds every call's wait"


def test_alone_a_call_runs_at_once():
    sched, (a, *_) = scheduler()
    sched.submit(call(a, 3, 1000, at=0.0))
    # Nobody else has been active: waiting for company would only add latency.
    assert [c.session for c in sched.pop_ready(0.0)] == [a]


def test_calls_of_one_layer_batch_across_clients_and_directions():
    sched, (a, b, c) = scheduler(max_wait_s=0.01, wait_per_token_s=1e-3)
    c.last_reply, c.last_layer = 0.0, 1  # c was active just now, one layer behind
    sched.submit(call(a, 2, 5, at=0.0))
    sched.submit(call(b, 2, 7, at=0.001, op=Op.BACKWARD))
    assert sched.pop_ready(0.002) is None, "a 5-token call may wait 5 ms for company"
    batch = sched.pop_ready(0.0051)
    assert batch is not None and {x.session for x in batch} == {a, b}
    assert {x.op for x in batch} == {Op.FORWARD, Op.BACKWARD}, "both directions share a visit"


def test_small_call_never_waits_longer_than_its_own_bound_behind_a_big_one():
    sched, (big, small, other) = scheduler(max_wait_s=0.05, wait_per_token_s=1e-4)
    other.last_reply, other.last_layer = 0.0, 15  # finishing its pass: layer 0 comes next
    sched.submit(call(big, 0, 4000, at=0.0))  # fine-tuning: may wait the full 50 ms
    sched.submit(call(small, 0, 1, at=0.001))  # decode: may wait 0.1 ms
    assert sched.pop_ready(0.0010) is None
    batch = sched.pop_ready(0.0012)
    assert batch is not None and len(batch) == 2, "the decode call takes the big one along"


def test_queue_runs_when_everyone_active_is_waiting():
    sched, (a, b, _) = scheduler(max_wait_s=1.0, wait_per_token_s=1.0)
    a.last_reply = b.last_reply = 0.0
    sched.submit(call(a, 1, 10, at=0.0))
    assert sched.pop_ready(0.001) is None, "b was active at layer 0 and may join"
    sched.submit(call(b, 1, 10, at=0.001))
    assert len(sched.pop_ready(0.001)) == 2, "nobody else can add work: no reason to wait"


def test_no_wait_for_a_client_already_past_the_layer():
    sched, (a, b, _) = scheduler(max_wait_s=1.0, wait_per_token_s=1.0)
    b.last_reply, b.last_layer = 0.0, 9  # active, but past layer 5 until its next pass
    sched.submit(call(a, 5, 10, at=0.0))
    assert len(sched.pop_ready(0.001)) == 1


def test_backward_passes_run_down_the_layers():
    sched, (a, b, _) = scheduler(max_wait_s=1.0, wait_per_token_s=1.0)
    b.last_reply, b.last_layer, b.last_op = 0.0, 9, Op.BACKWARD  # on its way down to 5
    sched.submit(call(a, 5, 10, at=0.0, op=Op.BACKWARD))
    assert sched.pop_ready(0.001) is None


def test_max_batch_tokens_splits_a_queue():
    sched, (a, b, c) = scheduler(max_batch_tokens=10)
    for s in (a, b, c):
        sched.submit(call(s, 0, 6, at=0.0))
    assert [len(sched.pop_ready(1.0)) for _ in range(3)] == [1, 1, 1]
    assert sched.pop_ready(1.0) is None


def test_no_lockstep_runs_calls_one_by_one_in_arrival_order():
    sched, (a, b, _) = scheduler(PolicyKind.NO_LOCKSTEP)
    sched.submit(call(a, 5, 1, at=0.0))
    sched.submit(call(b, 5, 1, at=0.1))
    assert [c.session for c in sched.pop_ready(0.2)] == [a]
    assert [c.session for c in sched.pop_ready(0.2)] == [b]


def test_opportunistic_without_merging_runs_calls_one_by_one_without_waiting():
    """The server turns merging off while each client has a worker thread of its own."""
    sched, (a, b, c) = scheduler(max_wait_s=0.01, wait_per_token_s=1e-3)
    c.last_reply, c.last_layer = 0.0, 1  # would be waited for, were merging on
    sched.merge = False
    sched.submit(call(a, 2, 5, at=0.0))
    sched.submit(call(b, 2, 7, at=0.001))
    assert [x.session for x in sched.pop_ready(0.001)] == [a], "no wait for company"
    assert [x.session for x in sched.pop_ready(0.001)] == [b]
    assert sched.pop_ready(0.001) is None
    sched.merge = True
    sched.submit(call(a, 2, 5, at=0.002))
    sched.submit(call(b, 2, 7, at=0.002))
    batch = sched.pop_ready(0.0071)
    assert batch is not None and {x.session for x in batch} == {a, b}


def test_lockstep_waits_for_every_active_client():
    sched, (a, b, _) = scheduler(PolicyKind.LOCKSTEP, max_wait_s=0.01)
    a.last_reply = b.last_reply = 0.0
    sched.submit(call(a, 0, 1, at=0.0))
    assert sched.pop_ready(0.5) is None, "b is active: lockstep waits for it"
    sched.submit(call(b, 0, 100, at=0.5))
    assert len(sched.pop_ready(0.5)) == 2


def test_lockstep_does_not_deadlock_on_clients_at_different_layers():
    sched, (a, b, _) = scheduler(PolicyKind.LOCKSTEP)
    a.last_reply = b.last_reply = 0.0
    sched.submit(call(a, 0, 1, at=0.0))
    sched.submit(call(b, 7, 1, at=0.0))
    assert sched.pop_ready(0.001) is not None, "everyone waits: someone must run"


def test_dropping_a_session_forgets_its_calls():
    sched, (a, b, _) = scheduler()
    sched.submit(call(a, 0, 1, at=0.0))
    sched.submit(call(b, 0, 1, at=0.0))
    sched.drop_session(a)
    assert [c.session for c in sched.pop_ready(1.0)] == [b] and len(sched) == 0


def test_exposed_endpoint_needs_a_token():
    with pytest.raises(ValueError, match="--token"):
        ServiceConfig(bind=("tcp://0.0.0.0:7100",))
    with pytest.raises(ValueError, match="--token"):
        ServiceConfig(bind=("tcp://*:7100",))
    ServiceConfig(bind=("tcp://0.0.0.0:7100",), token="s3cret")
    ServiceConfig(bind=("tcp://127.0.0.1:7100", "tcp://[::1]:7101", "ipc:///tmp/x"))
    with pytest.raises(ValueError, match="tcp://HOST:PORT"):
        ServiceConfig(bind=("http://127.0.0.1:80",))


F = Op.FORWARD
PASS = [(F, 0), (F, 3), (F, 4), (F, 6), (F, 7), (F, 10), (F, 11), (F, 13), (F, 0)]


def learned(session, at, gap, last_reply):
    """Give `session` a learned pace and call sequence (PASS, a decode step of a 2-layer
    llama with fused q/k/v and gate/up), its last call `PASS[at]` answered at `last_reply`."""
    session.gap_s = gap
    session.next_of = dict(zip(PASS, PASS[1:], strict=False))
    session.last_op, session.last_layer = PASS[at]
    session.last_reply = last_reply


def test_released_as_soon_as_every_active_client_is_queued():
    sched, (a, b, c) = scheduler(max_wait_s=0.05, wait_per_token_s=1e-2)
    for s in (a, b, c):
        learned(s, 2, gap=0.002, last_reply=0.0)  # all just answered at layer 4
    sched.submit(call(a, 6, 4, at=0.001))
    sched.submit(call(b, 6, 4, at=0.002))
    assert sched.pop_ready(0.002) is None, "c is due at layer 6 within the wait"
    sched.submit(call(c, 6, 4, at=0.0025))
    batch = sched.pop_ready(0.0025)
    assert batch is not None and {x.session for x in batch} == {a, b, c}, "nobody left to wait for"


def test_holds_for_a_client_one_call_behind_and_learns_its_pace():
    sched, (a, b, _) = scheduler(max_wait_s=0.05, wait_per_token_s=1e-2)
    learned(a, 3, gap=0.002, last_reply=0.0)
    learned(b, 2, gap=0.002, last_reply=0.0)  # b's next call is layer 6, a's layer 7
    sched.submit(call(a, 7, 4, at=0.002))
    assert sched.pop_ready(0.002) is None, "b is two calls behind, due within a's wait"
    sched.submit(call(b, 6, 4, at=0.003))
    assert b.gap_s == pytest.approx(0.002 + 0.25 * (0.003 - 0.002)), "pace is a moving average"
    assert b.next_of[(F, 4)] == (F, 6)
    batch = sched.pop_ready(0.003)
    assert [x.session for x in batch] == [b], "the client behind catches up first"


def test_a_lone_small_call_never_waits_longer_than_its_bound():
    sched, (a, b, _) = scheduler(max_wait_s=0.05, wait_per_token_s=1e-4)
    learned(b, 2, gap=0.00005, last_reply=0.0)  # b is coming to layer 6, soon
    sched.submit(call(a, 6, 1, at=0.0))  # decode call: may wait 0.1 ms
    assert sched.pop_ready(0.00005) is None
    assert sched.next_wake(0.00005) <= 0.0001
    assert [x.session for x in sched.pop_ready(0.0001)] == [a], "its bound is over: it runs"


def test_an_idle_client_does_not_hold_others():
    sched, (a, b, _) = scheduler(max_wait_s=0.05, wait_per_token_s=1e-2)
    learned(b, 2, gap=0.002, last_reply=0.0)  # would call layer 6 next...
    sched.submit(call(a, 6, 4, at=0.010))  # ...but has been silent for 5 paces
    assert [x.session for x in sched.pop_ready(0.010)] == [a]


def test_a_client_not_due_before_the_deadline_holds_nobody():
    sched, (a, b, _) = scheduler(max_wait_s=0.05, wait_per_token_s=1e-4)
    learned(b, 1, gap=0.003, last_reply=0.0)  # layer 6 is 2 calls ahead: ~6 ms
    sched.submit(call(a, 6, 10, at=0.0))  # may wait 1 ms: b will not make it
    assert [x.session for x in sched.pop_ready(0.0)] == [a]
