"""Word n-gram TF-IDF rows in compiled code, equal to scikit-learn's
`TfidfVectorizer.transform` for the configuration `TextFeaturizer` fits.

Counting n-grams one Python step each was most of the MoE's per-request prediction
time, and the regex tokeniser with a dict look-up per token was most of what remained.
Here Python only lowercases the texts and hands their code points to one numba kernel,
which splits the tokens of the default pattern (runs of two or more word characters),
finds each token's word id in a hash table, walks each position's n-grams through a trie
of the vocabulary's terms, counts the columns and applies sublinear tf, idf and the l2
norm.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp
from numba import njit
from numba.cpython.unsafe.numbers import trailing_zeros
from sklearn.feature_extraction.text import TfidfVectorizer

__all__ = ["NgramTfidf", "warm_up"]

# A token of this pattern is a maximal run of two or more word characters: no space in
# it, so a vocabulary term splits back into its words at the spaces scikit-learn put in.
DEFAULT_TOKEN_PATTERN = TfidfVectorizer().token_pattern
SUPPORTED = {"analyzer": "word", "lowercase": True, "stop_words": None, "binary": False,
             "preprocessor": None, "tokenizer": None, "strip_accents": None, "norm": "l2",
             "use_idf": True, "sublinear_tf": True, "input": "content",
             "token_pattern": DEFAULT_TOKEN_PATTERN}
NUM_CODE_POINTS = 0x110000
FNV_OFFSET = np.uint64(14695981039346656037)
FNV_PRIME = np.uint64(1099511628211)


def code_points(text: str) -> np.ndarray:
    """`text` as uint32 code points, one per character (lone surrogates included)."""
    return np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)


@functools.cache
def word_characters() -> np.ndarray:
    """Per code point: whether the regex `\\w` (so the token pattern) matches it."""
    every = "".join(map(chr, range(NUM_CODE_POINTS)))
    return code_points(re.sub(r"\W", "\0", every)) != 0


@dataclass(frozen=True, eq=False)
class NgramTfidf:
    """A fitted vectorizer's vocabulary as tables for `tfidf_kernel`.

    Words: every word of a vocabulary term, whether or not it is a term itself, as code
    points `word_text[word_starts[w]:word_starts[w + 1]]`, found through the open
    addressing table `word_slots`. A token that is no such word ends every n-gram
    through it. Terms: a trie whose node ids below the number of words are the one-word
    prefixes (node = word id); the children of node p are
    `child_nodes[child_start[p]:child_end[p]]`, sorted by their word, `child_words`.
    """

    min_n: int
    max_n: int
    word_text: np.ndarray  # uint32 code points
    word_starts: np.ndarray  # int64, per word and one past the last
    word_slots: np.ndarray  # int64 word id or -1, a power of two of them
    child_start: np.ndarray  # int64, per node
    child_end: np.ndarray  # int64, per node
    child_words: np.ndarray  # int64
    child_nodes: np.ndarray  # int64
    node_columns: np.ndarray  # int64 vocabulary column per node, -1 for a bare prefix
    idf: np.ndarray  # float32 per column

    @classmethod
    def from_vectorizer(cls, vectorizer: TfidfVectorizer) -> NgramTfidf:
        """The tables of a fitted vectorizer; ValueError for a configuration whose
        features these rows would not reproduce."""
        # attributes, not get_params(): that walks the signature
        params = {key: getattr(vectorizer, key) for key in SUPPORTED}
        if params != SUPPORTED:
            raise ValueError(f"NgramTfidf supports only {SUPPORTED}, not {params}")
        terms = [term.split(" ") for term in vectorizer.vocabulary_]
        word_ids: dict[str, int] = {}
        for words in terms:
            for word in words:
                word_ids.setdefault(word, len(word_ids))
        edges: dict[tuple[int, int], int] = {}  # (parent node, word id) -> node
        node_columns = [-1] * len(word_ids)
        for words, column in zip(terms, vectorizer.vocabulary_.values(), strict=True):
            node = word_ids[words[0]]
            for word in words[1:]:
                edge = (node, word_ids[word])
                if edge not in edges:
                    edges[edge] = len(node_columns)
                    node_columns.append(-1)
                node = edges[edge]
            node_columns[node] = column
        pairs = np.array(list(edges), dtype=np.int64).reshape(-1, 2)
        order = np.lexsort((pairs[:, 1], pairs[:, 0]))
        parents = pairs[order, 0]
        nodes = np.arange(len(node_columns))
        word_starts = np.zeros(len(word_ids) + 1, dtype=np.int64)
        np.cumsum(np.fromiter(map(len, word_ids), dtype=np.int64, count=len(word_ids)),
                  out=word_starts[1:])
        word_text = code_points("".join(word_ids))
        min_n, max_n = vectorizer.ngram_range
        return cls(
            min_n=int(min_n),
            max_n=int(max_n),
            word_text=word_text,
            word_starts=word_starts,
            word_slots=word_table(word_text, word_starts),
            child_start=np.searchsorted(parents, nodes, side="left").astype(np.int64),
            child_end=np.searchsorted(parents, nodes, side="right").astype(np.int64),
            child_words=np.ascontiguousarray(pairs[order, 1]),
            child_nodes=np.fromiter(edges.values(), dtype=np.int64, count=len(edges))[order],
            node_columns=np.asarray(node_columns, dtype=np.int64),
            idf=np.asarray(vectorizer.idf_, dtype=np.float32),
        )

    @property
    def num_columns(self) -> int:
        return len(self.idf)

    def transform(self, texts: Sequence[str]) -> sp.csr_matrix:
        """`vectorizer.transform(texts)` as float32 CSR with sorted indices (up to
        float32 rounding)."""
        indptr, indices, data = self.csr_arrays(texts)
        return sp.csr_matrix((data, indices, indptr), shape=(len(texts), self.num_columns))

    def csr_arrays(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`transform`'s int64 indptr, int32 indices and float32 data, for callers that
        build no scipy matrix: building one checks the arrays, some 15 us per batch."""
        lowered = [text.lower() for text in texts]  # per text: a final sigma's context
        row_starts = np.zeros(len(texts) + 1, dtype=np.int64)
        np.cumsum(np.fromiter(map(len, lowered), dtype=np.int64, count=len(texts)),
                  out=row_starts[1:])
        return tfidf_kernel(
            code_points("".join(lowered)), row_starts, word_characters(), self.word_text,
            self.word_starts, self.word_slots, self.min_n, self.max_n, self.child_start,
            self.child_end, self.child_words, self.child_nodes, self.node_columns, self.idf)


@njit(cache=True, nogil=True)
def text_hash(text: np.ndarray, start: int, end: int) -> np.uint64:
    """FNV-1a of the code points `text[start:end]`."""
    value = FNV_OFFSET
    for i in range(start, end):
        value = (value ^ np.uint64(text[i])) * FNV_PRIME
    return value


@njit(cache=True, nogil=True)
def word_table(word_text: np.ndarray, word_starts: np.ndarray) -> np.ndarray:
    """Open addressing slots (linear probing, at most half full) of the words' ids."""
    num_words = len(word_starts) - 1
    size = 2
    while size < 2 * num_words:
        size *= 2
    slots = np.full(size, -1, dtype=np.int64)
    for word in range(num_words):
        slot = np.int64(text_hash(word_text, word_starts[word], word_starts[word + 1])
                        & np.uint64(size - 1))
        while slots[slot] >= 0:
            slot = (slot + 1) & (size - 1)
        slots[slot] = word
    return slots


@njit(cache=True, nogil=True)
def word_id(text: np.ndarray, start: int, end: int, word_text: np.ndarray,
            word_starts: np.ndarray, word_slots: np.ndarray) -> int:
    """The id of the word `text[start:end]`, -1 when it is in no vocabulary term."""
    size = len(word_slots)
    slot = np.int64(text_hash(text, start, end) & np.uint64(size - 1))
    while word_slots[slot] >= 0:
        word = word_slots[slot]
        first = word_starts[word]
        if word_starts[word + 1] - first == end - start:
            i = 0
            while i < end - start and word_text[first + i] == text[start + i]:
                i += 1
            if i == end - start:
                return word
        slot = (slot + 1) & (size - 1)
    return -1


@njit(cache=True, nogil=True)
def child_of(node: int, word: int, child_start: np.ndarray, child_end: np.ndarray,
             child_words: np.ndarray, child_nodes: np.ndarray) -> int:
    """The trie node one `word` below `node`, -1 where no vocabulary term goes on so."""
    low, high = child_start[node], child_end[node]
    while low < high:
        middle = (low + high) // 2
        if child_words[middle] < word:
            low = middle + 1
        else:
            high = middle
    if low < child_end[node] and child_words[low] == word:
        return child_nodes[low]
    return -1


@njit(cache=True, nogil=True)
def tfidf_kernel(text: np.ndarray, row_starts: np.ndarray, word_characters: np.ndarray,
                 word_text: np.ndarray, word_starts: np.ndarray, word_slots: np.ndarray,
                 min_n: int, max_n: int, child_start: np.ndarray, child_end: np.ndarray,
                 child_words: np.ndarray, child_nodes: np.ndarray, node_columns: np.ndarray,
                 idf: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """CSR (indptr, indices, data) of the rows whose lowercased code points are
    `text[row_starts[r]:row_starts[r + 1]]`.

    As scikit-learn: tokens are the runs of two or more word characters, n-grams run
    over consecutive tokens, tf = 1 + log(count) in float32, times idf, over the row's
    l2 norm summed in float64 as `normalize` sums it; only the float32 log may round
    otherwise. A row's columns are marked in a bitmap as they are found and read back
    from it in order, cheaper than sorting them.
    """
    num_rows = len(row_starts) - 1
    counts = np.zeros(len(idf), dtype=np.int64)
    found = np.zeros((len(idf) + 63) // 64, dtype=np.uint64)  # a bit per column
    token_ids = np.empty(len(text) // 2 + 1, dtype=np.int64)
    capacity = len(token_ids) * (max_n - min_n + 1)
    indices = np.empty(capacity, dtype=np.int32)
    data = np.empty(capacity, dtype=np.float32)
    indptr = np.zeros(num_rows + 1, dtype=np.int64)
    nnz = 0
    for row in range(num_rows):
        num_tokens = 0
        start, end = row_starts[row], row_starts[row + 1]
        while start < end:
            if not word_characters[text[start]]:
                start += 1
                continue
            stop = start + 1
            while stop < end and word_characters[text[stop]]:
                stop += 1
            if stop - start >= 2:
                token_ids[num_tokens] = word_id(text, start, stop, word_text, word_starts,
                                                word_slots)
                num_tokens += 1
            start = stop
        row_first = nnz
        for first in range(num_tokens):
            node = token_ids[first]
            n = 1
            while node >= 0:
                if n >= min_n:
                    column = node_columns[node]
                    if column >= 0:
                        if counts[column] == 0:
                            found[column >> 6] |= np.uint64(1) << np.uint64(column & 63)
                            nnz += 1
                        counts[column] += 1
                if n == max_n or first + n == num_tokens or token_ids[first + n] < 0:
                    break
                node = child_of(node, token_ids[first + n], child_start, child_end,
                                child_words, child_nodes)
                n += 1
        at = row_first
        for block in range(len(found)):
            bits = found[block]
            if bits:
                found[block] = 0
                while bits:
                    indices[at] = block * 64 + trailing_zeros(bits)
                    at += 1
                    bits &= bits - np.uint64(1)
        norm = 0.0
        for j in range(row_first, nnz):
            column = indices[j]
            tf = np.float32(math.log(counts[column])) + np.float32(1.0)
            value = tf * idf[column]
            counts[column] = 0
            data[j] = value
            norm += value * value
        if norm > 0.0:
            norm = math.sqrt(norm)
            for j in range(row_first, nnz):
                data[j] = data[j] / norm
        indptr[row + 1] = nnz
    return indptr, indices[:nnz].copy(), data[:nnz].copy()


@functools.cache
def warm_up() -> None:
    """Compile the kernels (or load them from numba's on-disk cache) and build the
    word-character table now, with the argument types `NgramTfidf` passes, so that no
    request pays for them."""
    vectorizer = TfidfVectorizer(ngram_range=(1, 2), sublinear_tf=True, dtype=np.float32)
    NgramTfidf.from_vectorizer(vectorizer.fit(["warm up"])).transform(["warm up", ""])
