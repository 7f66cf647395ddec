"""The simulated engine's prefix cache, kept as vLLM's block pool keeps it.

A cached prefix block lives in the same KV pool as the running requests' blocks:
- a block a running request uses (its prompt computed, or found cached at admission)
  is held, counted once however many requests share it, and never evicted;
- when its last user ends, it stays cached in the free pool, the most recently used
  (a request's deepest block first in line for eviction, as vLLM frees a request's
  blocks tail first);
- a free cached block is evicted, least recently used first, only when a new block
  is needed and no free block without a cached prefix is left.

So a step finds its context only where its blocks survived the running requests'
demand: an engine packed with long decodes keeps little. The engine core owns the
count of free blocks; this cache says how many of them hold a cached prefix, and
gives blocks up when that count would exceed the free ones.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from app.engines.prefix import PrefixDirectory, leading_cached


class BlockCache:
    """Ref-counted prefix entries (one per prompt hash, of `hash_block_size` tokens,
    `entry_blocks` KV blocks each) and the free ones in LRU order."""

    def __init__(self, block_size: int, enabled: bool = True) -> None:
        self.block_size = block_size
        self.enabled = enabled
        self._refs: dict[int, int] = {}  # block hash -> running requests holding it
        self._sizes: dict[int, int] = {}  # block hash -> its KV blocks
        self._free: OrderedDict[int, None] = OrderedDict()  # unheld entries, LRU first
        self.num_free_cached_blocks = 0
        self._directory: tuple[PrefixDirectory, int] | None = None  # (directory, bit)

    def entry_blocks(self, hash_block_size: int) -> int:
        return -(-hash_block_size // self.block_size)

    # ---- what is cached ------------------------------------------------------------
    def join(self, directory: PrefixDirectory, instance_id: str) -> None:
        """Keep `directory` told of every block this cache gains or loses."""
        bit = directory.bit(instance_id)
        self._directory = (directory, bit)
        for h in self._refs:
            directory.add(h, bit)

    def __len__(self) -> int:
        return len(self._refs)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._refs

    @property
    def num_cached_tokens(self) -> int:
        return sum(self._sizes.values()) * self.block_size

    def peek(self, block_hashes: Sequence[int]) -> int:
        """Number of leading entries cached (held or free), touching nothing."""
        return leading_cached(block_hashes, self._refs)

    def digest(self) -> frozenset[int]:
        return frozenset(self._refs)

    def free_blocks_of(self, block_hashes: Iterable[int]) -> int:
        """KV blocks of these (cached) entries that no running request holds: what
        holding them takes out of the free pool."""
        return sum(self._sizes[h] for h in block_hashes if self._refs[h] == 0)

    # ---- held by running requests ----------------------------------------------------
    def acquire(self, block_hashes: Iterable[int]) -> int:
        """A request admitted on these cached entries holds them; the blocks that
        leave the free pool."""
        taken = 0
        for h in block_hashes:
            if self._refs[h] == 0:
                del self._free[h]
                taken += self._sizes[h]
            self._refs[h] += 1
        self.num_free_cached_blocks -= taken
        return taken

    def add_held(self, block_hashes: Iterable[int], hash_block_size: int) -> list[int]:
        """A request's computed prompt entries become cached, held by it; those another
        request cached first stay its own private blocks (vLLM does not merge them).
        The entries added, which the request releases when it ends."""
        if not self.enabled:
            return []
        size = self.entry_blocks(hash_block_size)
        added = [h for h in block_hashes if h not in self._refs]
        for h in added:
            self._refs[h] = 1
            self._sizes[h] = size
            if self._directory is not None:
                self._directory[0].add(h, self._directory[1])
        return added

    def release(self, block_hashes: Sequence[int]) -> int:
        """A request that held these entries ended; the blocks that return to the free
        pool (still cached, its deepest entry the next to go)."""
        returned = 0
        for h in reversed(block_hashes):
            self._refs[h] -= 1
            if self._refs[h] == 0:
                self._free[h] = None
                returned += self._sizes[h]
        self.num_free_cached_blocks += returned
        return returned

    def add_free(self, block_hashes: Iterable[int], hash_block_size: int) -> None:
        """Entries whose KV arrived without a request (a moved context): cached in the
        free pool, the most recently used; the caller evicts to fit."""
        if not self.enabled:
            return
        size = self.entry_blocks(hash_block_size)
        for h in block_hashes:
            if h in self._refs:
                if self._refs[h] == 0:
                    self._free.move_to_end(h)
                continue
            self._refs[h] = 0
            self._sizes[h] = size
            self._free[h] = None
            self.num_free_cached_blocks += size
            if self._directory is not None:
                self._directory[0].add(h, self._directory[1])

    def evict(self, num_free_blocks: int) -> None:
        """Give up free entries, least recently used first, until the free pool's
        `num_free_blocks` can hold those left."""
        while self.num_free_cached_blocks > num_free_blocks:
            h, _ = self._free.popitem(last=False)
            self.num_free_cached_blocks -= self._sizes.pop(h)
            del self._refs[h]
            if self._directory is not None:
                self._directory[0].discard(h, self._directory[1])
