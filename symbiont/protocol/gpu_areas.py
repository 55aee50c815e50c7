"""A shared-memory segment's input and output areas on the GPU (CUDA IPC).

When a client computes on the very GPU the executor computes on, copying each call's
tensors to the host segment and back costs four transfers over PCIe and two device
syncs per call. Instead the executor allocates the two areas on its GPU and hands the
client a CUDA IPC handle to them in its OK; the control block stays in host memory (the
client posts calls and spins on it as before). Each side makes its writes visible before
it bumps its sequence number (`settle`): the client after copying x in, the executor
after writing y out. Nothing else changes: the same views, checks and batching.

The GPU is matched by UUID, not by index: `cuda:0` of a client started with
CUDA_VISIBLE_DEVICES=1 is the host's second GPU. A client on another GPU, or on the
CPU, gets host areas.

Two processes taking turns on one GPU pay for the GPU switching between their contexts:
about 300 µs per call on an H200 without NVIDIA MPS, 40 µs under it, measured by
benchmarks/gpu_process_switch.py (BENCHMARKS.md, "On a GPU"). So a client that gets
areas here and finds no MPS daemon says how to start one (`MPS_HINT`).

The handle is what `torch.multiprocessing` sends for a CUDA tensor (`_share_cuda_`),
sent here as typed msgpack fields, never pickled. The executor owns the memory: a client
only maps it, and torch keeps it allocated until every process that mapped it let go.

Ordering without waiting (`new_event`): a segment on the GPU of a client that asks
(ATTACH.events) also gets an interprocess CUDA event. The executor records it after
queueing a call's output copies and answers at once, without waiting for the GPU; the
client's stream waits for the event before it reads the outputs, and before it writes
the next x on another stream (`Segment.inputs_writable`). So neither side's host blocks
on the other's kernels after a call, and the executor's loop queues the next batch while
the GPU still runs this one. The client still waits for its own stream before posting a
call: the executor never makes its stream wait on a client's event, since a client that
died with the event not yet reached would stall the executor's stream for every client.
SYMBIONT_GPU_EVENTS=0 (read by each side at each segment) falls back to waiting on both
sides, for comparison.
"""

from __future__ import annotations

import os

import torch

# The fields of torch's CUDA storage handle, in `_share_cuda_`'s order after the device
# index (which is not sent: each side names its own index of the one GPU).
SHARE_FIELDS = (
    "handle",  # bytes: the allocation's cudaIpcMemHandle (and torch's metadata)
    "size_bytes",  # int
    "offset_bytes",  # int: where the areas start inside that allocation
    "ref_counter",  # bytes: name of torch's shared reference-count file
    "ref_counter_offset",  # int
    "event_handle",  # bytes: cudaIpcEventHandle of the allocation's last use
    "event_sync_required",  # bool
)
MAX_HANDLE_BYTES = 1024
REF_COUNTER_SLOTS = 10000  # torch's CUDA_IPC_REF_COUNTER_FILE_SIZE


MPS_PIPE_DEFAULT = "/tmp/nvidia-mps"  # where CUDA looks for the daemon without the variable
MPS_HINT = (
    "without an NVIDIA MPS daemon the GPU switches between the client's and the "
    "executor's process at every call (about 0.3 ms each); start one before both, with "
    "the same CUDA_MPS_PIPE_DIRECTORY: `nvidia-cuda-mps-control -d` (docs/service.md)"
)


EVENT_HANDLE_BYTES = 64  # sizeof(cudaIpcEventHandle_t)


def events_enabled() -> bool:
    """Whether new GPU segments order their outputs by an event (see the module's doc)."""
    return os.environ.get("SYMBIONT_GPU_EVENTS", "1") != "0"


def new_event(device: torch.device) -> tuple[torch.cuda.Event, bytes]:
    """Executor side: an event another process can wait for, and its handle."""
    with torch.cuda.device(device):
        event = torch.cuda.Event(interprocess=True)  # (implies no timing)
        handle = event.ipc_handle()
    return event, handle


def open_event(index: int, handle: bytes) -> torch.cuda.Event:
    """Client side: the executor's event, on our GPU `index`."""
    if len(handle) != EVENT_HANDLE_BYTES:
        raise ValueError(f"a CUDA event handle has {EVENT_HANDLE_BYTES} bytes, got {len(handle)}")
    torch.cuda._lazy_init()
    return torch.cuda.Event.from_ipc_handle(torch.device("cuda", index), handle)


def mps_running() -> bool:
    """Whether an MPS control daemon listens where this process's CUDA looks for one.
    (A process started before the daemon still runs without it: CUDA asks once. A socket
    left by a killed daemon reads as running: this only decides whether to give advice.)"""
    pipes = os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or MPS_PIPE_DEFAULT
    return os.path.exists(os.path.join(pipes, "control"))


def uuid_of(device) -> str | None:
    """The UUID of a CUDA device (None for any other device, or without CUDA)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return str(torch.cuda.get_device_properties(index).uuid)


def index_of(uuid: str) -> int | None:
    """This process's index of the GPU with that UUID, if it sees that GPU."""
    if not torch.cuda.is_available():
        return None
    for index in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(index).uuid) == uuid:
            return index
    return None


def allocate(device: torch.device, nbytes: int) -> tuple[torch.Tensor, list]:
    """Executor side: `nbytes` of GPU memory (uint8) and the handle a client opens it by."""
    # Zeroed: fresh GPU memory holds whatever freed tensors left there (host segments
    # are zero-filled by the kernel).
    area = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    shared = area.untyped_storage()._share_cuda_()
    # (device index, handle, size, offset, ref counter, its offset, event, sync required)
    return area, list(shared[1:])


def open_shared(index: int, share: list, nbytes: int) -> torch.Tensor:
    """Client side: the executor's `nbytes` areas on our GPU `index` (uint8 [nbytes])."""
    if len(share) != len(SHARE_FIELDS):
        raise ValueError(f"a GPU area handle has {len(SHARE_FIELDS)} fields, got {len(share)}")
    handle, size, offset, counter, counter_offset, event, sync = share
    if size != nbytes:
        raise ValueError(f"the executor's GPU areas hold {size} bytes, {nbytes} expected")
    torch.cuda._lazy_init()
    storage = torch.UntypedStorage._new_shared_cuda(
        index, handle, size, offset, counter, counter_offset, event, sync
    )
    area = torch.empty(0, dtype=torch.uint8, device=f"cuda:{index}")
    return area.set_(storage, 0, (nbytes,), (1,))


def settle(area: torch.Tensor | None) -> None:
    """Wait until this thread's queued GPU work is done, so the other process reads what
    we wrote (and may overwrite what we read) once it sees the next sequence number."""
    if area is not None and area.is_cuda:
        torch.cuda.current_stream(area.device).synchronize()


def check_event(value) -> bytes:
    """The wire check of an event handle: EVENT_HANDLE_BYTES bytes."""
    if type(value) is not bytes or len(value) != EVENT_HANDLE_BYTES:
        raise ValueError
    return value


def check_share(value) -> list:
    """The wire check of a handle: raises ValueError unless it has SHARE_FIELDS' types and
    ranges. The client hands these to torch, which trusts them: the reference counter is
    a slot in a shared file of REF_COUNTER_SLOTS int64 that the client decrements when it
    lets go, and its name is a shared-memory object the client opens, so both are bounded
    to what torch itself makes."""
    if type(value) is not list or len(value) != len(SHARE_FIELDS):
        raise ValueError
    handle, size, offset, counter, counter_offset, event, sync = value
    for blob in (handle, counter, event):
        if type(blob) is not bytes or not 0 < len(blob) <= MAX_HANDLE_BYTES:
            raise ValueError
    if not counter.startswith(b"/torch_") or b"/" in counter[1:] or b"\0" in counter:
        raise ValueError
    if not 0 <= counter_offset < REF_COUNTER_SLOTS:
        raise ValueError
    for number in (size, offset):
        if type(number) is not int or not 0 <= number < 1 << 48:
            raise ValueError
    if type(counter_offset) is not int or type(sync) is not bool:
        raise ValueError
    return value
