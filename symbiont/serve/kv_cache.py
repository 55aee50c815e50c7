"""A paged KV cache: fixed-size blocks shared by all sequences, one block table each.

Sequences hold lists of block ids; a token at position p lives in slot
`blocks[p // block_size] * block_size + p % block_size` of every layer's K and V pools.
Pools are allocated per attention layer on first use, shaped from the keys that layer
produces, so any architecture's head count and head size work without configuration.

Layout, for reading in place. Each pool is stored head-major, `[kv_heads, slots, head_dim]`,
so a sequence whose blocks form one contiguous run has, per KV head, its keys as one
contiguous `[length, head_dim]` stretch: the layout `scaled_dot_product_attention` reads
fastest. The allocator hands a sequence such a run when one is free, starting at a
multiple of its size rounded up to a power of two (a run of 9-16 blocks starts at a
multiple of 16 blocks). Runs of the same size class then sit on one lattice, so the
decoding sequences of a step are rows of one strided view of the pool (`row_view`) and
their attention reads the pool where it lies, with no per-layer copy (see attention.py).
When no aligned run is free (a fragmented pool) the sequence gets scattered blocks and
its context is gathered as before. The token-major `[slots, kv_heads, head_dim]` view
(`pools`) stays for writers that index by slot.
"""

from __future__ import annotations

import torch


class OutOfBlocks(RuntimeError):
    """Not enough free KV blocks; the scheduler checks `can_allocate` first."""


class BlockAllocator:
    """Free KV blocks, handed out as an aligned contiguous run where one is free.

    `allocate(n)` returns, in order of preference: the lowest free run of `n` blocks that
    starts at a multiple of `alignment(n)` (the next power of two >= n, capped by the
    pool); else the lowest free run of `n` blocks anywhere; else `n` scattered free
    blocks, taken from the top of the pool down, away from where aligned runs are
    placed. Every block is usable by some allocation, so alignment costs no capacity.
    """

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free = bytearray(b"\x01") * num_blocks  # 1 where the block is free
        self._num_free = num_blocks
        self._runs: dict[int, int] = {}  # first block -> length, of runs handed out

    @property
    def num_free(self) -> int:
        return self._num_free

    def can_allocate(self, n: int) -> bool:
        return n <= self._num_free

    def alignment(self, n: int) -> int:
        """Blocks a run of `n` is aligned to: n rounded up to a power of two, at most the
        largest power of two that fits the pool."""
        align = 1 << max(n - 1, 0).bit_length()
        while align > 1 and align > self.num_blocks:
            align >>= 1
        return align

    def allocate(self, n: int) -> list[int]:
        if n > self._num_free:
            raise OutOfBlocks(f"asked for {n} KV blocks, {self._num_free} free")
        if n == 0:
            return []
        first = self._find_run(n, self.alignment(n))
        if first is None and self.alignment(n) > 1:
            first = self._find_run(n, 1)
        if first is not None:
            self._free[first : first + n] = bytes(n)
            self._num_free -= n
            self._runs[first] = n
            return list(range(first, first + n))
        taken = []
        for block in range(self.num_blocks - 1, -1, -1):
            if self._free[block]:
                taken.append(block)
                if len(taken) == n:
                    break
        for block in taken:
            self._free[block] = 0
        self._num_free -= n
        return taken

    def _find_run(self, n: int, align: int) -> int | None:
        """The lowest start, a multiple of `align`, of `n` free blocks; None if none."""
        full, pos = b"\x01" * n, 0
        while (found := self._free.find(full, pos)) >= 0:  # a free stretch starts here
            first = -(-found // align) * align  # the first aligned start at or after it
            if first + n > self.num_blocks:
                return None
            if self._free[first : first + n] == full:
                return first
            pos = first  # no aligned start before `first` can hold the run
        return None

    def is_run(self, blocks: list[int]) -> bool:
        """Whether `blocks` is one contiguous run this allocator handed out (in order)."""
        return bool(blocks) and self._runs.get(blocks[0]) == len(blocks)

    def free(self, blocks: list[int]) -> None:
        for block in blocks:
            if self._free[block]:
                raise RuntimeError(f"KV block {block} was freed twice")
            self._free[block] = 1
        self._num_free += len(blocks)
        if blocks and self._runs.get(blocks[0]) == len(blocks):
            del self._runs[blocks[0]]


class PagedKVCache:
    """Per-layer K/V pools, stored `[kv_heads, num_blocks * block_size, head_dim]`."""

    def __init__(self, num_blocks: int, block_size: int, device: torch.device):
        self.block_size = block_size
        self.num_slots = num_blocks * block_size
        self.device = device
        self.allocator = BlockAllocator(num_blocks)
        self._keys: dict[int, torch.Tensor] = {}  # layer -> [kv_heads, slots, head_dim]
        self._values: dict[int, torch.Tensor] = {}

    def blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    def head_major(self, layer: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V pools of `layer` as stored, `[kv_heads, slots, head_dim]` (contiguous),
        created like `like` `[n_tokens, kv_heads, head_dim]` on first use."""
        if layer not in self._keys:
            shape = (like.shape[1], self.num_slots, like.shape[2])
            # never inference tensors, wherever first used (a prefix written at admission
            # under inference_mode): the forward may run under no_grad and write into them
            with torch.inference_mode(False):
                self._keys[layer] = torch.zeros(shape, dtype=like.dtype, device=self.device)
                self._values[layer] = torch.zeros(shape, dtype=like.dtype, device=self.device)
        return self._keys[layer], self._values[layer]

    def pools(self, layer: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V pools of `layer` as `[slots, kv_heads, head_dim]` views (writes through
        them land in the pools), created like `like` [n_tokens, kv_heads, head_dim]."""
        keys, values = self.head_major(layer, like)
        return keys.transpose(0, 1), values.transpose(0, 1)

    def slots(self, blocks: list[int], start: int, stop: int) -> list[int]:
        """Cache slots of positions [start, stop) of a sequence with block table `blocks`."""
        size = self.block_size
        return [blocks[p // size] * size + p % size for p in range(start, stop)]

    def memory_bytes(self) -> int:
        pools = list(self._keys.values()) + list(self._values.values())
        return sum(t.numel() * t.element_size() for t in pools)
