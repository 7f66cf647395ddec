"""Request features: TF-IDF over the token window, length counts, declared task.

The features are one sparse row per request so the first network layer can be an
embedding bag (cost proportional to non-zeros, not to the vocabulary size).
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import chain, repeat
from typing import NamedTuple, Protocol, Self

import numpy as np
import scipy.sparse as sp
from numba import njit
from sklearn.base import BaseEstimator
from sklearn.feature_extraction.text import TfidfVectorizer
from sklearn.utils.validation import check_is_fitted

from predictor import ngrams, text_counts
from predictor.base import PredictionInput
from predictor.ngrams import NgramTfidf
from predictor.text_counts import COUNT_NAMES, NUM_COUNTS, count_prompts

__all__ = ["NUMERIC_FEATURES", "Featurizer", "SparseRows", "TextFeaturizer", "augment_truncated"]

# Order of the numeric columns; all are log1p counts. The prompt's numbers matter for
# math problems: more quantities -> more solution steps.
NUMERIC_FEATURES = (*COUNT_NAMES, "num_generated_tokens")


def generated_tokens(inputs: Sequence[PredictionInput]) -> np.ndarray:
    """int64 `num_generated_tokens` per input."""
    return np.fromiter((inp.num_generated_tokens for inp in inputs), dtype=np.int64,
                       count=len(inputs))


def log_counts(prompt_counts: np.ndarray, generated: np.ndarray) -> np.ndarray:
    """float64 `NUMERIC_FEATURES` rows: log1p of the prompt counts, then of the progress."""
    counts = np.empty((len(generated), len(NUMERIC_FEATURES)), dtype=np.float64)
    counts[:, :-1] = prompt_counts
    counts[:, -1] = generated
    return np.log1p(counts)


def numeric_features(inputs: Sequence[PredictionInput]) -> np.ndarray:
    """log1p counts that TF-IDF (length-normalised) cannot see."""
    return log_counts(count_prompts([inp.prompt for inp in inputs]), generated_tokens(inputs))


class SparseRows(NamedTuple):
    """Feature rows as CSR arrays with int64 column ids, as the network's embedding bag
    takes them. No scipy matrix on the prediction path: building one checks the arrays
    and converts them to int32, some 20 us per batch, and the net wants int64 again."""

    indptr: np.ndarray  # int64, per row and one past the last
    indices: np.ndarray  # int64
    data: np.ndarray  # float32
    num_columns: int

    @classmethod
    def from_csr(cls, matrix: sp.csr_matrix) -> SparseRows:
        return cls(matrix.indptr.astype(np.int64), matrix.indices.astype(np.int64),
                   matrix.data.astype(np.float32), matrix.shape[1])

    @property
    def num_rows(self) -> int:
        return len(self.indptr) - 1

    def rows(self, start: int, stop: int) -> SparseRows:
        """Rows `start` to `stop` (exclusive), sharing these arrays."""
        first, last = self.indptr[start], self.indptr[stop]
        return SparseRows(self.indptr[start : stop + 1] - first, self.indices[first:last],
                          self.data[first:last], self.num_columns)

    def to_csr(self) -> sp.csr_matrix:
        return sp.csr_matrix((self.data, self.indices, self.indptr),
                             shape=(self.num_rows, self.num_columns))


ROW_CACHE_MAX_VALUES = 4_000_000  # about 32 MB of cached TF-IDF values


class TextRows(NamedTuple):
    """What a batch of request texts and prompts give, whatever the requests' progress:
    TF-IDF rows in CSR form and the prompt counts."""

    indptr: np.ndarray  # int64, per row and one past the last
    columns: np.ndarray  # int32 TF-IDF columns
    values: np.ndarray  # float32 TF-IDF values
    counts: np.ndarray  # int64 (rows, NUM_COUNTS): `count_prompts`

    @classmethod
    def compute(cls, inputs: Sequence[PredictionInput], tfidf: NgramTfidf) -> TextRows:
        indptr, columns, values = tfidf.csr_arrays([inp.text for inp in inputs])
        return cls(indptr, columns, values, count_prompts([inp.prompt for inp in inputs]))

    @classmethod
    def gather(cls, rows: Sequence[TextRow]) -> TextRows:
        """Cached rows as one batch."""
        indptr = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(np.fromiter((end - start for _, start, end, _ in rows), dtype=np.int64,
                              count=len(rows)), out=indptr[1:])
        if not rows:
            return cls(indptr, np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.float32),
                       np.zeros((0, NUM_COUNTS), dtype=np.int64))
        flat_counts = chain.from_iterable([counts for _, _, _, counts in rows])
        return cls(indptr,
                   np.concatenate([batch.columns[start:end] for batch, start, end, _ in rows]),
                   np.concatenate([batch.values[start:end] for batch, start, end, _ in rows]),
                   np.fromiter(flat_counts, dtype=np.int64, count=len(rows) * NUM_COUNTS
                               ).reshape(len(rows), NUM_COUNTS))

    def cached_rows(self) -> Iterator[TextRow]:
        """Each row as `TextRowCache` keeps it."""
        bounds = self.indptr.tolist()
        return zip(repeat(self), bounds[:-1], bounds[1:], self.counts.tolist())


# A cached text's row: the batch it was computed in, where its TF-IDF values lie there
# (start, end) and its prompt counts. A plain tuple: the cache makes one per new request.
TextRow = tuple[TextRows, int, int, list[int]]


class TextRowCache:
    """Each recent request text's `TextRow`, oldest dropped first while the values held
    exceed `max_values`. A router predicts a running request's length again at every
    watchdog check with the same text and a new `num_generated_tokens`: only that
    column has to be computed again. A row refers to its batch's arrays, freed once all
    the batch's rows are dropped (together, as they came together). Thread-safe: the
    router's micro-batcher predicts arrivals on its own thread while the watchdog
    predicts on the event loop's."""

    def __init__(self, max_values: int = ROW_CACHE_MAX_VALUES) -> None:
        self.max_values = max_values
        # ordered by arrival: an OrderedDict drops its oldest in O(1), where a dict's
        # first key takes a scan past every key dropped before it
        self._rows: OrderedDict[tuple[str, str], TextRow] = OrderedDict()
        self._num_values = 0
        self._lock = threading.Lock()

    def rows(self, inputs: Sequence[PredictionInput], tfidf: NgramTfidf) -> TextRows:
        """The inputs' rows: from the cache, else computed (and kept)."""
        keys = [(inp.prompt, inp.generated_text) for inp in inputs]
        with self._lock:
            found = list(map(self._rows.get, keys))
        missing = {key: inp for key, inp, row in zip(keys, inputs, found, strict=True)
                   if row is None}
        if not missing:
            return TextRows.gather(found)  # type: ignore[arg-type]
        computed = TextRows.compute(list(missing.values()), tfidf)
        new = dict(zip(missing, computed.cached_rows(), strict=True))
        with self._lock:
            self._keep(new)
        if len(new) == len(inputs):  # every text new, as in an arrival batch
            return computed
        return TextRows.gather([new[key] if row is None else row
                                for key, row in zip(keys, found, strict=True)])

    def _keep(self, rows: dict[tuple[str, str], TextRow]) -> None:
        """Under the lock: `rows` kept as the newest, the oldest dropped while over
        `max_values`."""
        for key in rows.keys() & self._rows.keys():  # another thread computed it meanwhile
            _, start, end, _ = self._rows.pop(key)
            self._num_values -= end - start
        self._rows.update(rows)
        self._num_values += sum(end - start for _, start, end, _ in rows.values())
        while self._num_values > self.max_values and self._rows:
            _, (_, start, end, _) = self._rows.popitem(last=False)
            self._num_values -= end - start

    def __len__(self) -> int:
        return len(self._rows)


@njit(cache=True, nogil=True)
def feature_rows_kernel(text_indptr: np.ndarray, columns: np.ndarray, values: np.ndarray,
                        numeric: np.ndarray, tasks: np.ndarray, first_numeric_column: int
                        ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """CSR (indptr, int64 indices, data) of rows made of each row's TF-IDF entries, its
    numeric columns from `first_numeric_column` on, then its task's column after them
    (none for task -1). Zeros are left out, as a block stack of the parts leaves them."""
    num_rows, num_numeric = numeric.shape
    capacity = len(columns) + num_rows * (num_numeric + 1)
    indices = np.empty(capacity, dtype=np.int64)
    data = np.empty(capacity, dtype=np.float32)
    indptr = np.zeros(num_rows + 1, dtype=np.int64)
    nnz = 0
    for row in range(num_rows):
        for j in range(text_indptr[row], text_indptr[row + 1]):
            if values[j] != 0:
                indices[nnz] = columns[j]
                data[nnz] = values[j]
                nnz += 1
        for k in range(num_numeric):
            if numeric[row, k] != 0:
                indices[nnz] = first_numeric_column + k
                data[nnz] = numeric[row, k]
                nnz += 1
        if tasks[row] >= 0:
            indices[nnz] = first_numeric_column + num_numeric + tasks[row]
            data[nnz] = 1.0
            nnz += 1
        indptr[row + 1] = nnz
    return indptr, indices[:nnz], data[:nnz]


@functools.cache
def warm_up() -> None:
    """Compile `TextFeaturizer`'s kernels (or load them from numba's on-disk cache) and
    build their tables now, with the argument types requests pass, so that no request
    pays for them."""
    ngrams.warm_up()
    text_counts.warm_up()
    rows = TextRows.gather([])
    feature_rows_kernel(rows.indptr, rows.columns, rows.values,
                        np.zeros((0, len(NUMERIC_FEATURES)), dtype=np.float32),
                        np.zeros(0, dtype=np.int64), 0)


class Featurizer(Protocol):
    """Turns requests into one sparse row each; fitted on training requests."""

    num_features_: int

    def fit(self, inputs: Sequence[PredictionInput]) -> Self: ...

    def transform(self, inputs: Sequence[PredictionInput]) -> sp.csr_matrix: ...

    def sparse_rows(self, inputs: Sequence[PredictionInput]) -> SparseRows:
        """`transform`'s rows, for the network."""
        ...

    def fit_transform(self, inputs: Sequence[PredictionInput]) -> sp.csr_matrix: ...


class TextFeaturizer(BaseEstimator):
    """TF-IDF(prompt + generated text) | standardised numeric counts | task one-hot."""

    def __init__(
        self, max_features: int = 8192, ngram_max: int = 2, min_df: int = 2, use_task: bool = True
    ) -> None:
        self.max_features = max_features
        self.ngram_max = ngram_max
        self.min_df = min_df
        self.use_task = use_task

    def fit(self, inputs: Sequence[PredictionInput]) -> Self:
        # Document frequency counts distinct texts: a prompt answered (or augmented)
        # several times is still one document.
        self.__dict__.pop("_rows", None)  # rows of the previous vocabulary
        self.__dict__.pop("_tfidf", None)
        texts = list(dict.fromkeys(inp.text for inp in inputs))
        # Tiny corpora (tests, smoke runs) would lose every term to min_df.
        min_df = self.min_df if len(texts) >= 10 * self.min_df else 1
        self.vectorizer_ = TfidfVectorizer(
            max_features=self.max_features,
            ngram_range=(1, self.ngram_max),
            min_df=min_df,
            sublinear_tf=True,
            dtype=np.float32,
        ).fit(texts)
        self._prepare()  # the counts below run the compiled kernels
        numeric = numeric_features(inputs)
        self.numeric_mean_ = numeric.mean(axis=0)
        self.numeric_std_ = np.maximum(numeric.std(axis=0), 1e-6)
        tasks = {inp.task for inp in inputs if inp.task is not None} if self.use_task else set()
        self.task_index_ = {task: i for i, task in enumerate(sorted(tasks))}
        self.num_features_ = len(self.vectorizer_.vocabulary_) + len(NUMERIC_FEATURES) + len(tasks)
        return self

    def transform(self, inputs: Sequence[PredictionInput]) -> sp.csr_matrix:
        """One float32 CSR row per input: TF-IDF columns, the numeric columns, then the
        task's (none for an unseen task)."""
        return self.sparse_rows(inputs).to_csr()

    def sparse_rows(self, inputs: Sequence[PredictionInput]) -> SparseRows:
        """`transform`'s rows as arrays. A text seen lately is not featurised again
        (`TextRowCache`); the rows are laid out in one compiled pass."""
        check_is_fitted(self)
        text = self._row_cache.rows(inputs, self._tfidf)
        numeric = log_counts(text.counts, generated_tokens(inputs))
        numeric = ((numeric - self.numeric_mean_) / self.numeric_std_).astype(np.float32)
        tasks = np.fromiter((self.task_index_.get(inp.task, -1) for inp in inputs),
                            dtype=np.int64, count=len(inputs))
        indptr, indices, data = feature_rows_kernel(
            text.indptr, text.columns, text.values, numeric, tasks,
            len(self.vectorizer_.vocabulary_))
        return SparseRows(indptr, indices, data, self.num_features_)

    def fit_transform(self, inputs: Sequence[PredictionInput]) -> sp.csr_matrix:
        return self.fit(inputs).transform(inputs)

    @property
    def _row_cache(self) -> TextRowCache:
        """Made on first use and after loading: never saved, and `fit` drops it."""
        cache = self.__dict__.get("_rows")
        if cache is None:
            cache = self.__dict__["_rows"] = TextRowCache()
        return cache

    @property
    def _tfidf(self) -> NgramTfidf:
        """The vocabulary's n-gram tables: made at fit and load (`_prepare`), never saved."""
        tfidf = self.__dict__.get("_tfidf")
        return tfidf if tfidf is not None else self._prepare()

    def _prepare(self) -> NgramTfidf:
        """The n-gram tables built and the kernels compiled (or loaded from numba's disk
        cache) at fit and load, so that the first request pays for neither."""
        warm_up()
        tfidf = self.__dict__["_tfidf"] = NgramTfidf.from_vectorizer(self.vectorizer_)
        return tfidf

    def __getstate__(self) -> dict:
        state = dict(super().__getstate__())
        state.pop("_rows", None)
        state.pop("_tfidf", None)
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        if "vectorizer_" in state:  # a fitted featurizer, loaded to predict
            self._prepare()


@dataclass(frozen=True)
class AugmentedData:
    """Training rows after truncated-output augmentation."""

    inputs: list[PredictionInput]
    output_lengths: np.ndarray  # total output length of the request, per row
    source_rows: np.ndarray  # index of the original request, per row


def augment_truncated(
    inputs: Sequence[PredictionInput],
    output_lengths: np.ndarray,
    num_copies: int,
    rng: np.random.Generator,
) -> AugmentedData:
    """Add `num_copies` rows per request that pretend k tokens were already generated.

    k is uniform in [generated so far, total) and the target stays the total length, so
    the model learns the conditional total given the request survived k tokens.
    """
    low = np.array([inp.num_generated_tokens for inp in inputs], dtype=np.int64)
    lengths = np.asarray(output_lengths, dtype=np.int64)
    sources = np.tile(np.arange(len(inputs)), num_copies)
    ks = rng.integers(low[sources], lengths[sources])
    new_inputs = list(inputs) + [
        PredictionInput(inputs[i].prompt, inputs[i].generated_text, int(k), inputs[i].task)
        for i, k in zip(sources, ks, strict=True)
    ]
    source_rows = np.concatenate([np.arange(len(inputs)), sources])
    return AugmentedData(new_inputs, lengths[source_rows], source_rows)
