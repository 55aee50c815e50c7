"""Shared-memory segments: the pipes that wake the executor and the client.

A client and the executor each map the segment; these tests map it twice in one process
(two mappings of one memory file, as across processes) and wake one side from the other.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time

import pytest
import torch

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
        client.open_pipes()
        assert client.ring() is True
        assert os.read(read_end, 16) == b"x"
    finally:
        os.close(read_end)
        os.close(write_end)


def test_pipes_that_are_no_pipes_or_absent_are_not_opened(pair):
    owner, client = pair
    with tempfile.TemporaryFile() as file:
        owner.ctrl[shm.DOORBELL] = file.fileno()
        owner.ctrl[shm.CLIENT_BELL] = file.fileno()
        client.open_pipes()
        assert client.ring() is False, "a regular file is not an executor's doorbell"
        assert client.sleep(0) is False, "nor a bell"
    owner.ctrl[shm.DOORBELL] = owner.ctrl[shm.CLIENT_BELL] = 0
    client.open_pipes()
    assert client.ring() is False, "no doorbell offered: the client sends a RING instead"
    assert client.sleep(0) is False


def test_a_client_sleeping_on_its_bell_is_woken_by_the_executor(pair):
    owner, client = pair
    client.open_pipes()  # the bell the executor made with the segment
    woke = threading.Event()

    def sleeper():
        while client.ctrl[shm.RESP_SEQ] != 7:
            assert client.sleep(30.0)
        woke.set()

    thread = threading.Thread(target=sleeper, daemon=True)
    thread.start()
    time.sleep(0.2)  # let it fall asleep (if it has not, it sees the new value at once)
    assert not woke.is_set()
    owner.ctrl[shm.RESP_SEQ] = 7
    assert owner.wake_client()
    # Woken, not timed out: the sleep above would last 30 s.
    assert woke.wait(10), "the bell did not wake the client"
    thread.join(10)


def test_bytes_left_in_the_bell_are_read_and_a_closed_segment_has_none(pair):
    owner, client = pair
    client.open_pipes()
    for _ in range(3):
        owner.wake_client()  # rings nobody heard: one sleep reads them all
    assert client.sleep(30.0)
    started = time.monotonic()
    assert client.sleep(0.05)  # empty now: waits its timeout, and no longer
    assert time.monotonic() - started < 10
    client.close()
    assert client.sleep(30.0) is False
    assert client.ring() is False


def test_a_bell_the_executor_closed_wakes_the_sleeper_with_false(pair):
    owner, client = pair
    client.open_pipes()
    owner.close()  # the session freed, or the executor gone: its end of the bell closes
    started = time.monotonic()
    assert client.sleep(30.0) is False, "end of file on the bell: nobody will ring again"
    assert time.monotonic() - started < 10
    assert client.sleep(0) is False


def test_serve_base_raises_its_open_files_limit_for_its_clients():
    import resource
    import subprocess
    import sys

    script = (
        "import resource\n"
        "from symbiont.base.main import _allow_files\n"
        "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))\n"
        "_allow_files(300)\n"
        "print(resource.getrlimit(resource.RLIMIT_NOFILE)[0])\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    assert int(done.stdout) == (300 if hard == resource.RLIM_INFINITY else min(300, hard))


def test_a_bell_numbered_above_1024_still_sleeps_and_wakes():
    """A client process with many files open (a raised open-files limit, a data loader)
    gets descriptors from 1024 on, which `select` refuses: every call not answered while
    spinning failed with "filedescriptor out of range in select()"."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"the open-files hard limit ({hard}) is below what the test needs")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    held = []
    try:
        while not held or held[-1] < 1100:  # the next descriptors are numbered above 1024
            held.append(os.open(os.devnull, os.O_RDONLY))
        owner = shm.Segment.create(4096)
        client = shm.Segment.open(owner.path, 4096)
        client.open_pipes()
        assert client._bell_r > 1024
        assert client.sleep(0.01)  # nothing rang: times out
        assert owner.wake_client()
        started = time.monotonic()
        assert client.sleep(30.0)  # rung: returns at once
        assert time.monotonic() - started < 5
        owner.close()
        assert client.sleep(30.0) is False  # the executor closed the bell
        client.close()
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_areas_elsewhere_leave_the_segment_a_control_block(monkeypatch):
    """With its areas on a GPU the host segment is the control block alone: both sides
    read and write the one area through the same views, and a client expecting host
    areas is refused by size. (A CPU tensor stands in for the GPU memory here;
    tests/test_gpu.py runs the real thing.)"""
    from symbiont.protocol import gpu_areas

    area = torch.zeros(2 * 4096, dtype=torch.uint8)
    handle = [b"h" * 64, area.numel(), 0, b"/torch_1", 0, b"e" * 64, False]
    monkeypatch.setattr(gpu_areas, "allocate", lambda device, nbytes: (area, handle))
    monkeypatch.setattr(gpu_areas, "open_shared", lambda index, share, nbytes: area[:nbytes])
    owner = shm.Segment.create(4096, gpu=torch.device("cpu"))
    try:
        assert owner.gpu_share == handle and os.fstat(owner.fd).st_size == shm.HEADER_BYTES
        with pytest.raises(ValueError, match="has size"):
            shm.Segment.open(owner.path, 4096)
        client = shm.Segment.open(owner.path, 4096, gpu=(0, owner.gpu_share))
        x = torch.arange(6, dtype=torch.float32).reshape(2, 3)
        client.input(torch.float32, 2, 3).copy_(x)
        assert torch.equal(owner.input(torch.float32, 2, 3), x)
        owner.output_at(6, torch.float32, 2, 3).copy_(x * 2)
        assert torch.equal(client.output_at(6, torch.float32, 2, 3), x * 2)
        client.ctrl[shm.REQ_SEQ] = 7  # the control block is shared as before
        assert owner.ctrl[shm.REQ_SEQ] == 7
        client.close()

        def refuse(index, share, nbytes):
            raise RuntimeError("CUDA error: invalid resource handle")

        monkeypatch.setattr(gpu_areas, "open_shared", refuse)
        before = len(os.listdir("/proc/self/fd"))
        with pytest.raises(ValueError, match="cannot open the executor's GPU areas: CUDA"):
            shm.Segment.open(owner.path, 4096, gpu=(0, owner.gpu_share))
        assert len(os.listdir("/proc/self/fd")) == before, "the segment's descriptor leaked"
    finally:
        owner.close()
