"""Prefix index: chained block hashes of prompts and an LRU of cached blocks.

Engines (simulated) keep one per instance as their prefix cache; the live router
keeps one per instance of the hashes it sent there (an approximate prefix index).
"""

from __future__ import annotations

import functools
import hashlib
from collections import OrderedDict
from collections.abc import Container, Iterable, Sequence

import numpy as np
from numba import njit

from app.routing.slots import SlotsOfLastList

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


def leading_cached(block_hashes: Iterable[int], cached: Container[int]) -> int:
    """How many of a prompt's leading block hashes `cached` holds (a prefix hit stops at
    the first block missing)."""
    hits = 0
    for h in block_hashes:
        if h not in cached:
            break
        hits += 1
    return hits


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
        return leading_cached(block_hashes, self._lru)

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
    """Which instances cache each block: a row of bit words per block hash (bit i: the
    instance of slot i holds it), kept by the instances' `PrefixCache`s (`join`). One
    query answers every instance's leading hit count for a prompt in one compiled pass
    (vectorised routing), where asking each cache walks the prompt once per instance.
    Words, not a bool per instance: a 512-instance fleet's caches hold millions of
    blocks."""

    def __init__(self) -> None:
        warm_up()
        self._bits: dict[str, int] = {}  # instance id -> bit position (its slot)
        self._row_of: dict[int, int] = {}  # block hash -> row of `_held`
        self._held = np.zeros((0, 1), dtype=np.int64)  # (rows, words): holders' bits
        self._words = memoryview(self._held.reshape(-1))  # `_held` flat, for add/discard
        self._num_holders: list[int] = []  # per row; 0: free (listed in `_free_rows`)
        self._free_rows: list[int] = []
        self._slots = SlotsOfLastList()

    def bit(self, instance_id: str) -> int:
        if instance_id not in self._bits:
            bit = self._bits[instance_id] = len(self._bits)
            if bit >= 64 * self._held.shape[1]:
                self._resize(np.hstack([self._held, np.zeros_like(self._held)]))
            self._slots.forget()  # an unknown id's slot now means this one
        return self._bits[instance_id]

    def add(self, block_hash: int, bit: int) -> None:
        row = self._row_of.get(block_hash)
        if row is None:
            row = self._row_of[block_hash] = self._free_row()
        at, mask = row * self._held.shape[1] + (bit >> 6), _BIT_MASKS[bit & 63]
        held = self._words[at]
        if not held & mask:
            self._words[at] = held | mask
            self._num_holders[row] += 1

    def discard(self, block_hash: int, bit: int) -> None:
        row = self._row_of.get(block_hash)
        if row is None:
            return
        at, mask = row * self._held.shape[1] + (bit >> 6), _BIT_MASKS[bit & 63]
        held = self._words[at]
        if held & mask:
            self._words[at] = held & ~mask
            self._num_holders[row] -= 1
            if not self._num_holders[row]:
                del self._row_of[block_hash]
                self._free_rows.append(row)

    def _free_row(self) -> int:
        if not self._free_rows:
            num_rows = len(self._held)
            grown = max(num_rows, 64)
            self._resize(np.vstack([self._held, np.zeros((grown, self._held.shape[1]),
                                                         dtype=np.int64)]))
            self._num_holders.extend([0] * grown)
            self._free_rows.extend(range(num_rows + grown - 1, num_rows - 1, -1))
        return self._free_rows.pop()

    def _resize(self, held: np.ndarray) -> None:
        self._held, self._words = held, memoryview(held.reshape(-1))

    def hit_tokens(self, block_hashes: Sequence[int], instance_ids: Sequence[str],
                   block_size: int, max_tokens: int) -> np.ndarray:
        """Tokens of the leading blocks of `block_hashes` cached on each instance
        (`PrefixCache.peek` x `block_size` for all of them, at most `max_tokens`; 0 for
        an instance not in the directory). The leading blocks some instance holds are
        found here; which instances hold how many of them, in one compiled pass."""
        rows = []
        row_of = self._row_of
        for h in block_hashes:
            row = row_of.get(h)
            if row is None:
                break
            rows.append(row)
        if not rows:
            return np.zeros(len(instance_ids), dtype=np.int64)
        return _leading_tokens(self._held, np.array(rows, dtype=np.int64),
                               self._slots.of(instance_ids, self._slot_of), block_size,
                               max_tokens)

    def _slot_of(self, instance_id: str) -> int:
        """The instance's bit; one past every word (no bit) when it is unknown."""
        return self._bits.get(instance_id, 64 * self._held.shape[1])


# bit b of a word as a signed 64-bit value (bit 63 is the sign bit)
_BIT_MASKS = [1 << b if b < 63 else -(1 << 63) for b in range(64)]


@njit(cache=True)
def _set_bits(leading: np.ndarray, word: int, bits: int, value: int) -> None:
    """leading[64 x word + b] = value for each bit b set in `bits`."""
    for bit in range(64):
        if (bits >> bit) & 1:
            leading[64 * word + bit] = value


@njit(cache=True)
def _leading_tokens(held: np.ndarray, rows: np.ndarray, slots: np.ndarray, block_size: int,
                    max_tokens: int) -> np.ndarray:
    """Per slot, how many of `rows` (blocks, in prompt order) lead with its bit set, in
    tokens of `block_size`, at most `max_tokens`. The set of instances still matching
    narrows block by block, so the pass costs the blocks' words plus one step per
    instance however long the shared prefix. A slot past the words (an unknown
    instance) has none."""
    num_words = held.shape[1]
    alive = held[rows[0]].copy()
    leading = np.zeros(64 * num_words, dtype=np.int64)
    k = 1
    while k < len(rows) and alive.any():
        for word in range(num_words):
            dropped = alive[word] & ~held[rows[k], word]
            if dropped:
                _set_bits(leading, word, dropped, k)
                alive[word] &= ~dropped
        k += 1
    for word in range(num_words):  # still set: they hold every block
        if alive[word]:
            _set_bits(leading, word, alive[word], k)
    tokens = np.zeros(len(slots), dtype=np.int64)
    for i in range(len(slots)):
        if slots[i] < len(leading):
            tokens[i] = min(leading[slots[i]] * block_size, max_tokens)
    return tokens


@functools.cache
def warm_up() -> None:
    """Compile (or load from the on-disk cache) the directory's pass, once per
    process."""
    _leading_tokens(np.ones((1, 1), dtype=np.int64), np.zeros(1, dtype=np.int64),
                    np.zeros(1, dtype=np.int64), 16, 16)
