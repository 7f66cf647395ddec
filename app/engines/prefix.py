"""Prefix index: chained block hashes of prompts and an LRU of cached blocks.

Engines (simulated) keep one per instance as their prefix cache; the live router
keeps one per instance of the hashes it sent there (an approximate prefix index).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import numpy as np

PREFIX_BLOCK_SIZE = 16  # tokens per prefix-hash block (vLLM's KV block size)


def prefix_block_hashes(
    token_ids: Sequence[int], block_size: int = PREFIX_BLOCK_SIZE
) -> tuple[int, ...]:
    """Chained hashes of full blocks: equal hash <=> equal prefix up to that block."""
    hashes: list[int] = []
    parent = b""
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = ",".join(map(str, token_ids[start : start + block_size])).encode()
        digest = hashlib.blake2b(parent + block, digest_size=8).digest()
        hashes.append(int.from_bytes(digest, "little"))
        parent = digest
    return tuple(hashes)


class PrefixCache:
    """LRU of prefix block hashes, sized in tokens (vLLM keeps freed KV blocks as
    reusable cache, so the cache can hold as many tokens as the KV memory)."""

    def __init__(self, capacity_tokens: int) -> None:
        self.capacity_tokens = capacity_tokens
        self.num_cached_tokens = 0
        self._lru: OrderedDict[int, int] = OrderedDict()  # block hash -> tokens in block
        self._directory: tuple[PrefixDirectory, int] | None = None  # (directory, bit)

    def join(self, directory: PrefixDirectory, instance_id: str) -> None:
        """Keep `directory` told of every block this cache gains or loses."""
        bit = directory.bit(instance_id)
        self._directory = (directory, bit)
        for h in self._lru:
            directory.add(h, bit)

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._lru

    def match(self, block_hashes: Sequence[int]) -> int:
        """Number of leading blocks cached; touches them."""
        hits = self.peek(block_hashes)
        for h in block_hashes[:hits]:
            self._lru.move_to_end(h)
        return hits

    def peek(self, block_hashes: Sequence[int]) -> int:
        """Number of leading blocks cached, without touching the LRU order."""
        hits = 0
        for h in block_hashes:
            if h not in self._lru:
                break
            hits += 1
        return hits

    def insert(self, block_hashes: Iterable[int], block_size: int) -> None:
        for h in block_hashes:
            if h in self._lru:
                self._lru.move_to_end(h)
                continue
            self._lru[h] = block_size
            self.num_cached_tokens += block_size
            if self._directory is not None:
                self._directory[0].add(h, self._directory[1])
        while self.num_cached_tokens > self.capacity_tokens and self._lru:
            h, size = self._lru.popitem(last=False)
            self.num_cached_tokens -= size
            if self._directory is not None:
                self._directory[0].discard(h, self._directory[1])

    def digest(self) -> frozenset[int]:
        return frozenset(self._lru)


class PrefixDirectory:
    """Which instances cache each block: block hash -> bitmask of instances, kept by
    the instances' `PrefixCache`s (`join`). One query answers every instance's leading
    hit count for a prompt at once (vectorised routing), where asking each cache walks
    the prompt once per instance."""

    def __init__(self) -> None:
        self._bits: dict[str, int] = {}  # instance id -> bit position
        self._masks: dict[int, int] = {}
        self._slots: tuple[tuple[str, ...], np.ndarray] = ((), np.zeros(0, np.int64))

    def bit(self, instance_id: str) -> int:
        if instance_id not in self._bits:
            self._bits[instance_id] = len(self._bits)
            self._slots = ((), self._slots[1])  # an unknown id's slot now means this one
        return self._bits[instance_id]

    def add(self, block_hash: int, bit: int) -> None:
        self._masks[block_hash] = self._masks.get(block_hash, 0) | (1 << bit)

    def discard(self, block_hash: int, bit: int) -> None:
        mask = self._masks.get(block_hash, 0) & ~(1 << bit)
        if mask:
            self._masks[block_hash] = mask
        else:
            self._masks.pop(block_hash, None)

    def hit_blocks(self, block_hashes: Sequence[int], instance_ids: Sequence[str]) -> np.ndarray:
        """Leading blocks of `block_hashes` cached on each instance (`PrefixCache.peek`
        for all of them; 0 for an instance not in the directory)."""
        blocks = np.zeros(len(self._bits) + 1, dtype=np.int64)  # last: unknown instances
        alive = self._masks.get(block_hashes[0], 0) if block_hashes else 0
        run = 1
        for h in block_hashes[1:]:
            if not alive:
                break
            narrower = alive & self._masks.get(h, 0)
            if narrower != alive:
                blocks[:-1] += run * self._unpack(alive)
                alive, run = narrower, 0
            run += 1
        if alive:
            blocks[:-1] += run * self._unpack(alive)
        return blocks[self._slots_of(instance_ids)]

    def _unpack(self, mask: int) -> np.ndarray:
        size = len(self._bits)
        raw = np.frombuffer(mask.to_bytes((size + 7) // 8, "little"), dtype=np.uint8)
        # int64: runs of more than 255 blocks must not wrap (long agent contexts)
        return np.unpackbits(raw, bitorder="little")[:size].astype(np.int64)

    def _slots_of(self, instance_ids: Sequence[str]) -> np.ndarray:
        if self._slots[0] is not instance_ids and self._slots[0] != instance_ids:
            unknown = len(self._bits)
            self._slots = (tuple(instance_ids), np.array(
                [self._bits.get(i, unknown) for i in instance_ids], dtype=np.int64))
        return self._slots[1]
