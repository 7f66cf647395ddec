"""Prefix index: chained block hashes of prompts and an LRU of cached blocks.

Engines (simulated) keep one per instance as their prefix cache; the live router
keeps one per instance of the hashes it sent there (an approximate prefix index).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence

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
        while self.num_cached_tokens > self.capacity_tokens and self._lru:
            self.num_cached_tokens -= self._lru.popitem(last=False)[1]

    def digest(self) -> frozenset[int]:
        return frozenset(self._lru)
