"""Shared-memory segments: the executor's doorbell pipe and the futex on the control block.

A client and the executor each map the segment; these tests map it twice in one process
(two mappings of one memory file, as across processes) and wake one side from the other.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time

import pytest

from symbiont.protocol import shm

pytestmark = pytest.mark.skipif(not shm.AVAILABLE, reason="needs Linux memfd")


@pytest.fixture
def pair():
    """(executor's segment, client's mapping of it)."""
    owner = shm.Segment.create(4096)
    client = shm.Segment.open(owner.path, 4096)
    yield owner, client
    client.close()
    owner.close()


def test_ring_writes_into_the_pipe_the_executor_names(pair):
    owner, client = pair
    read_end, write_end = os.pipe()
    try:
        owner.ctrl[shm.DOORBELL] = write_end
        client.open_doorbell()
        assert client.ring() is True
        assert os.read(read_end, 16) == b"x"
    finally:
        os.close(read_end)
        os.close(write_end)


def test_a_doorbell_that_is_no_pipe_is_not_opened(pair):
    owner, client = pair
    with tempfile.TemporaryFile() as file:
        owner.ctrl[shm.DOORBELL] = file.fileno()
        client.open_doorbell()
        assert client.ring() is False, "a regular file is not an executor's doorbell"
    owner.ctrl[shm.DOORBELL] = 0
    client.open_doorbell()
    assert client.ring() is False, "no doorbell offered: the client sends a RING instead"


@pytest.mark.skipif(not shm.FUTEX_SAFE, reason="futexes on the control block: x86-64 only")
def test_a_sleeper_on_the_futex_is_woken_through_the_other_mapping(pair):
    owner, client = pair
    woke = threading.Event()

    def sleeper():
        while client.ctrl[shm.RESP_SEQ] != 7:
            client.sleep_on(shm.RESP_SEQ, client.ctrl[shm.RESP_SEQ], 30.0)
        woke.set()

    thread = threading.Thread(target=sleeper, daemon=True)
    thread.start()
    time.sleep(0.2)  # let it fall asleep (if it has not, it sees the new value at once)
    assert not woke.is_set()
    owner.ctrl[shm.RESP_SEQ] = 7
    owner.wake(shm.RESP_SEQ)
    # Woken, not timed out: the sleep above would last 30 s.
    assert woke.wait(10), "the futex wake did not reach the other mapping"


@pytest.mark.skipif(not shm.FUTEX_SAFE, reason="futexes on the control block: x86-64 only")
def test_sleep_on_a_value_that_already_changed_returns_at_once(pair):
    owner, client = pair
    owner.ctrl[shm.RESP_SEQ] = (1 << 32) + 5  # the kernel compares the low 32 bits
    started = time.monotonic()
    client.sleep_on(shm.RESP_SEQ, 4, 30.0)
    assert time.monotonic() - started < 10
    client.close()
    client.sleep_on(shm.RESP_SEQ, 5, 30.0)  # closed: returns, never faults
    client.wake(shm.RESP_SEQ)
