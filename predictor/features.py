"""Request features: TF-IDF over the token window, length counts, declared task.

The features are one sparse row per request so the first network layer can be an
embedding bag (cost proportional to non-zeros, not to the vocabulary size).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, Self

import numpy as np
import scipy.sparse as sp
from sklearn.base import BaseEstimator
from sklearn.feature_extraction.text import TfidfVectorizer
from sklearn.utils.validation import check_is_fitted

from predictor.base import PredictionInput
from predictor.ngrams import NgramTfidf, warm_up

__all__ = ["NUMERIC_FEATURES", "Featurizer", "TextFeaturizer", "augment_truncated"]

_NUMBER = re.compile(r"\d+(?:[.,]\d+)*")
_SENTENCE_END = re.compile(r"[.!?](?:\s|$)")

# Order of the numeric columns; all are log1p counts.
NUMERIC_FEATURES = (
    "prompt_words",
    "prompt_chars",
    "prompt_numbers",  # math problems: more quantities -> more solution steps
    "prompt_sentences",
    "prompt_lines",
    "num_generated_tokens",
)


def prompt_counts(prompt: str) -> tuple[int, int, int, int, int]:
    """The prompt's words, characters, numbers, sentences and lines."""
    return (len(prompt.split()), len(prompt), len(_NUMBER.findall(prompt)),
            len(_SENTENCE_END.findall(prompt)), prompt.count("\n"))


def log_counts(rows: Sequence[tuple[int, ...]]) -> np.ndarray:
    """`NUMERIC_FEATURES` rows (prompt counts, then progress) as log1p."""
    return np.log1p(np.asarray(rows, dtype=np.float64).reshape(len(rows), len(NUMERIC_FEATURES)))


def numeric_features(inputs: Sequence[PredictionInput]) -> np.ndarray:
    """log1p counts that TF-IDF (length-normalised) cannot see."""
    return log_counts([(*prompt_counts(inp.prompt), inp.num_generated_tokens)
                       for inp in inputs])


ROW_CACHE_MAX_VALUES = 4_000_000  # about 32 MB of cached TF-IDF values


@dataclass(frozen=True)
class TextRow:
    """What a request's text and prompt give, whatever its progress."""

    columns: np.ndarray  # int32 TF-IDF columns
    values: np.ndarray  # float32 TF-IDF values
    counts: tuple[int, int, int, int, int]  # `prompt_counts`


class TextRowCache:
    """Each recent request text's `TextRow`, oldest dropped first while the values held
    exceed `max_values`. A router predicts a running request's length again at every
    watchdog check with the same text and a new `num_generated_tokens`: only that
    column has to be computed again. Thread-safe: the router's micro-batcher predicts
    arrivals on its own thread while the watchdog predicts on the event loop's."""

    def __init__(self, max_values: int = ROW_CACHE_MAX_VALUES) -> None:
        self.max_values = max_values
        self._rows: dict[tuple[str, str], TextRow] = {}
        self._num_values = 0
        self._lock = threading.Lock()

    def rows(self, inputs: Sequence[PredictionInput], tfidf: NgramTfidf) -> list[TextRow]:
        """Each input's row: from the cache, else computed (and kept)."""
        keys = [(inp.prompt, inp.generated_text) for inp in inputs]
        with self._lock:
            found = {key: self._rows.get(key) for key in keys}
        missing, asked = [], set()
        for i, key in enumerate(keys):
            if found[key] is None and key not in asked:
                missing.append(i)
                asked.add(key)
        if missing:
            matrix = tfidf.transform([inputs[i].text for i in missing])
            computed = []
            for row, i in enumerate(missing):
                start, end = matrix.indptr[row], matrix.indptr[row + 1]
                found[keys[i]] = TextRow(matrix.indices[start:end].copy(),
                                         matrix.data[start:end].copy(),
                                         prompt_counts(inputs[i].prompt))
                computed.append(keys[i])
            with self._lock:
                for key in computed:
                    self._keep(key, found[key])  # type: ignore[arg-type]
        return [found[key] for key in keys]  # type: ignore[misc]

    def _keep(self, key: tuple[str, str], row: TextRow) -> None:
        """Under the lock: `row` kept, the oldest dropped while over `max_values`."""
        previous = self._rows.pop(key, None)  # another thread computed it meanwhile
        if previous is not None:
            self._num_values -= len(previous.values)
        self._rows[key] = row
        self._num_values += len(row.values)
        while self._num_values > self.max_values and self._rows:
            oldest = next(iter(self._rows))
            self._num_values -= len(self._rows.pop(oldest).values)

    def __len__(self) -> int:
        return len(self._rows)


class Featurizer(Protocol):
    """Turns requests into one sparse row each; fitted on training requests."""

    num_features_: int

    def fit(self, inputs: Sequence[PredictionInput]) -> Self: ...

    def transform(self, inputs: Sequence[PredictionInput]) -> sp.csr_matrix: ...

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
        numeric = numeric_features(inputs)
        self.numeric_mean_ = numeric.mean(axis=0)
        self.numeric_std_ = np.maximum(numeric.std(axis=0), 1e-6)
        tasks = {inp.task for inp in inputs if inp.task is not None} if self.use_task else set()
        self.task_index_ = {task: i for i, task in enumerate(sorted(tasks))}
        self.num_features_ = len(self.vectorizer_.vocabulary_) + len(NUMERIC_FEATURES) + len(tasks)
        self._prepare()
        return self

    def transform(self, inputs: Sequence[PredictionInput]) -> sp.csr_matrix:
        """One float32 CSR row per input: TF-IDF columns, the numeric columns, then the
        task's (none for an unseen task). A text seen lately is not featurised again
        (`TextRowCache`); the matrix is built in one piece, not stacked from blocks."""
        check_is_fitted(self)
        rows = self._row_cache.rows(inputs, self._tfidf)
        numeric = log_counts([(*r.counts, inp.num_generated_tokens)
                              for r, inp in zip(rows, inputs, strict=True)])
        numeric = ((numeric - self.numeric_mean_) / self.numeric_std_).astype(np.float32)
        tasks = np.array([self.task_index_.get(inp.task, -1) for inp in inputs], dtype=np.int64)
        sizes = np.fromiter((len(r.columns) for r in rows), dtype=np.int64, count=len(rows))
        has_task = tasks >= 0
        indptr = np.concatenate([[0], np.cumsum(sizes + len(NUMERIC_FEATURES) + has_task)])
        indices = np.empty(indptr[-1], dtype=np.int32)
        data = np.empty(indptr[-1], dtype=np.float32)
        firsts = indptr[:-1]
        in_row = np.arange(sizes.sum()) - np.repeat(np.cumsum(sizes) - sizes, sizes)
        tfidf_at = np.repeat(firsts, sizes) + in_row
        if len(tfidf_at):
            indices[tfidf_at] = np.concatenate([r.columns for r in rows])
            data[tfidf_at] = np.concatenate([r.values for r in rows])
        vocabulary = len(self.vectorizer_.vocabulary_)
        numeric_at = (firsts + sizes)[:, None] + np.arange(len(NUMERIC_FEATURES))
        indices[numeric_at] = vocabulary + np.arange(len(NUMERIC_FEATURES))
        data[numeric_at] = numeric
        task_at = (firsts + sizes + len(NUMERIC_FEATURES))[has_task]
        indices[task_at] = vocabulary + len(NUMERIC_FEATURES) + tasks[has_task]
        data[task_at] = 1.0
        matrix = sp.csr_matrix((data, indices, indptr), shape=(len(inputs), self.num_features_))
        matrix.eliminate_zeros()  # as a block stack leaves out a numeric value of 0
        return matrix

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
        """The n-gram tables built and their kernel compiled (or loaded from numba's disk
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
