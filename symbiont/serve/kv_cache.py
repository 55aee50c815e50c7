"""A paged KV cache: fixed-size blocks shared by all sequences, one block table each.

Sequences hold lists of block ids; a token at position p lives in slot
`blocks[p // block_size] * block_size + p % block_size` of every layer's K and V pools.
Pools are allocated per attention layer on first use, shaped from the keys that layer
produces, so any architecture's head count and head size work without configuration.
"""

from __future__ import annotations

import torch


class OutOfBlocks(RuntimeError):
    """Not enough free KV blocks; the scheduler checks `can_allocate` first."""


class BlockAllocator:
    """Free list of KV blocks."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocks(f"asked for {n} KV blocks, {len(self._free)} free")
        taken = self._free[-n:] if n else []
        del self._free[len(self._free) - n :]
        return taken[::-1]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))
        assert len(self._free) <= self.num_blocks, "a KV block was freed twice"


class PagedKVCache:
    """Per-layer K/V pools `[num_blocks * block_size, kv_heads, head_dim]`."""

    def __init__(self, num_blocks: int, block_size: int, device: torch.device):
        self.block_size = block_size
        self.num_slots = num_blocks * block_size
        self.device = device
        self.allocator = BlockAllocator(num_blocks)
        self._keys: dict[int, torch.Tensor] = {}
        self._values: dict[int, torch.Tensor] = {}

    def blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    def pools(self, layer: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V pools of `layer`, created like `like` [n_tokens, kv_heads, head_dim]."""
        if layer not in self._keys:
            shape = (self.num_slots, *like.shape[1:])
            self._keys[layer] = torch.zeros(shape, dtype=like.dtype, device=self.device)
            self._values[layer] = torch.zeros(shape, dtype=like.dtype, device=self.device)
        return self._keys[layer], self._values[layer]

    def slots(self, blocks: list[int], start: int, stop: int) -> list[int]:
        """Cache slots of positions [start, stop) of a sequence with block table `blocks`."""
        size = self.block_size
        return [blocks[p // size] * size + p % size for p in range(start, stop)]

    def memory_bytes(self) -> int:
        pools = list(self._keys.values()) + list(self._values.values())
        return sum(t.numel() * t.element_size() for t in pools)
