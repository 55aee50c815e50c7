"""Large CPU tensors on transparent huge pages.

Where a kernel streams a few hundred MB of scattered regions per step (the serving
engine's LoRA stacks: every running adapter's A and B in every layer), 4 KiB pages cost a
TLB miss per page and stop the hardware prefetcher at each page's end. On Linux with
transparent huge pages in "madvise" mode (the common default), memory is backed by 2 MiB
pages only where a program asks before the first touch. `zeros` maps fresh memory for the
tensor (the allocator's heap may hand back pages already touched, which the advice no
longer changes), asks, then zeroes it. Elsewhere (another OS, THP "never", a tensor
below 2 MiB) it is plain `torch.zeros`.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import sys

import torch

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14  # linux/mman.h


def zeros(*shape: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """`torch.zeros(shape)`, on huge pages where the OS gives them to a CPU tensor."""
    count = 1
    for size in shape:
        count *= size
    nbytes = count * dtype.itemsize
    if torch.device(device).type != "cpu" or nbytes < 2 * HUGE_PAGE or _madvise() is None:
        return torch.zeros(*shape, dtype=dtype, device=device)
    # a fresh anonymous mapping, one huge page longer so the tensor can start on one;
    # the tensor keeps the mapping alive
    # (private: a shared anonymous mapping is shmem, whose huge pages are set apart)
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    address = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
    offset = -address % HUGE_PAGE
    advise_huge_pages(address + offset, nbytes)
    flat = torch.frombuffer(mapping, dtype=dtype, count=count, offset=offset)
    return flat.view(*shape).zero_()  # the first touch: pages are faulted in after the advice


def advise_huge_pages(address: int, nbytes: int) -> bool:
    """Ask Linux to back the whole 2 MiB pages inside [address, address + nbytes) with
    huge pages; whether it took the advice (False elsewhere: nothing changes)."""
    madvise = _madvise()
    start = -(-address // HUGE_PAGE) * HUGE_PAGE
    end = (address + nbytes) // HUGE_PAGE * HUGE_PAGE
    if madvise is None or end <= start:
        return False
    return madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_HUGEPAGE) == 0


@functools.cache
def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    function.restype = ctypes.c_int
    return function
