"""The prediction hot path's fast forms equal the reference forms they replace."""

from __future__ import annotations

import re
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from sklearn.feature_extraction.text import TfidfVectorizer

from predictor.base import PredictionInput
from predictor.nets import FusedMixture, MixtureOfExperts, SparseBatch, for_inference
from predictor.ngrams import NgramTfidf
from predictor.text_counts import count_prompts
from tests.unit.torch_utils import one_torch_thread  # noqa: F401  (autouse fixture)

pytestmark = pytest.mark.unit

WORDS = ["alpha", "beta", "Gamma", "δέλτα", "x", "42", "3.14", "a_b", "naïve", "end."]


def random_texts(rng: np.random.Generator, count: int) -> list[str]:
    texts = []
    for _ in range(count):
        words = rng.choice(WORDS, size=int(rng.integers(0, 40)))
        separators = rng.choice([" ", "  ", "\n", ", ", "-"], size=len(words))
        texts.append("".join(w + s for w, s in zip(words, separators, strict=True)))
    return texts + ["", "x y z", "ALPHA alpha Alpha beta"]


def assert_sklearn_features(vectorizer: TfidfVectorizer, texts: list[str]) -> None:
    """The compiled rows are scikit-learn's, up to float32 rounding."""
    expected = vectorizer.transform(texts)
    got = NgramTfidf.from_vectorizer(vectorizer).transform(texts)
    assert got.dtype == expected.dtype == np.float32
    assert got.shape == expected.shape
    np.testing.assert_array_equal(got.indptr, expected.indptr)
    np.testing.assert_array_equal(got.indices, expected.indices)
    np.testing.assert_allclose(got.data, expected.data, rtol=1e-6, atol=1e-7)
    assert got.nnz > 0


@pytest.mark.parametrize("ngram_range", [(1, 1), (1, 2), (1, 3), (2, 2), (2, 3)])
@pytest.mark.parametrize("seed", [0, 1])
def test_ngram_tfidf_equals_sklearn_transform(ngram_range, seed):
    rng = np.random.default_rng(seed)
    vectorizer = TfidfVectorizer(
        ngram_range=ngram_range, sublinear_tf=True, min_df=2, dtype=np.float32
    ).fit(random_texts(rng, 200))
    assert_sklearn_features(vectorizer, random_texts(rng, 100))  # unseen: OOV terms too


PROSE = [
    "The café's crème brûlée costs 4.50 € — ΑΒΓ δέλτα, naïve Straße, 東京 タワー 2024.",
    "new york new york new york, said the New York Times about NEW YORK.",
    "Solve 3x + 12 = 42 for x; then 12 + 42 = 54 and 54 / 3 = 18.",
    "the cat sat on the mat the cat sat on the mat the cat sat",
    "",
    "   \n\t  ",
    "a b c d e f",  # one-letter words are no tokens
    "def tfidf_rows(vectorizer, texts): return vectorizer.transform(texts)  # code",
    "ask the model: what is the capital of france? and of new zealand?",
]
UNSEEN = [
    "new jersey york new brand york new york",  # OOV words inside and around bigrams
    "zyzzyva the cat quux sat on zorp the mat",
    "Straße straße STRASSE naïve naive 東京 京都 İstanbul ΟΔΟΣ 😀x 𝔘𝔫𝔦 lone\ud800surrogate",
    "4.50 450 4,50 42 42 42 42",
    "",
    "completely unseen words only here",
]


@pytest.mark.parametrize("ngram_max", [2, 3])
@pytest.mark.parametrize("max_features", [None, 12])
def test_ngram_tfidf_equals_sklearn_on_prose(ngram_max, max_features):
    """Few features keep n-grams whose words are no features themselves."""
    vectorizer = TfidfVectorizer(ngram_range=(1, ngram_max), sublinear_tf=True,
                                 max_features=max_features, dtype=np.float32).fit(PROSE)
    assert_sklearn_features(vectorizer, PROSE + UNSEEN)


# word characters of several scripts, ones whose lowercase is longer or depends on the
# context (İ, final Σ), marks, digits, "_" and separators of several kinds
ALPHABET = list("abcAB_19²éÉΣσςİı東京\u0301\u00a0 \t\n.,-'😀𝔘") + ["\ud800"]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ngram_tfidf_tokenises_as_the_regex_on_any_characters(seed):
    rng = np.random.default_rng(seed)
    texts = ["".join(rng.choice(ALPHABET, size=int(rng.integers(0, 80)))) for _ in range(300)]
    vectorizer = TfidfVectorizer(ngram_range=(1, 2), sublinear_tf=True, min_df=2,
                                 dtype=np.float32).fit(texts[:200])
    assert_sklearn_features(vectorizer, texts[200:])


def test_a_bigram_of_words_that_are_no_terms_is_still_counted():
    vocabulary = {"new york": 0, "york": 1, "sat on the": 2, "the cat": 3}
    vectorizer = TfidfVectorizer(ngram_range=(1, 3), sublinear_tf=True, vocabulary=vocabulary,
                                 dtype=np.float32).fit(PROSE)
    assert_sklearn_features(vectorizer, PROSE + UNSEEN)
    tfidf = NgramTfidf.from_vectorizer(vectorizer)
    row = tfidf.transform(["new york new jersey york new"])
    assert row.indices.tolist() == [0, 1]  # "new" alone and "new jersey" are no terms
    assert tfidf.transform([]).shape == (0, len(vocabulary))


NUMBER = re.compile(r"\d+(?:[.,]\d+)*")
SENTENCE_END = re.compile(r"[.!?](?:\s|$)")


def regex_counts(prompt: str) -> tuple[int, int, int, int, int]:
    """The prompt counts by the rules `count_prompts` follows: `split` and regexes."""
    return (len(prompt.split()), len(prompt), len(NUMBER.findall(prompt)),
            len(SENTENCE_END.findall(prompt)), prompt.count("\n"))


# Digits of several scripts and digit-like characters that are no `\d`; the whitespace
# that `split` and `\s` know beyond ASCII (separators \x1c-\x1f, NEL, NBSP, ogham,
# line/paragraph separators, ideographic) and look-alikes that are none (zero-width
# space, BOM, Mongolian vowel separator); the rules' punctuation; astral characters and
# lone surrogates.
COUNT_ALPHABET = [*"a7٣५９𝟘²½Ⅻ.,.,!? \t\n\r\x0b\x0c\x1c\x1f\x85\xa0\u1680\u2028\u2029\u3000",
                  *"\u200b\ufeff\u180e;-xΣ😀", "\ud800", "\udc00"]
TRICKY_PROMPTS = ["", "1.5.", "1..2", "1,234.56, 7", "v1.2.3.", "end.", "end.\n", "a. b! c? d",
                  "...", "!?", "x.\u3000y", "١٢٣.٤", "１２.３４", "2²", "x.\u200by", " \x1c ",
                  "new\nlines\n\n", "\ud800.\udc00 1"]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_prompt_counts_follow_the_split_and_regex_rules(seed):
    rng = np.random.default_rng(seed)
    prompts = ["".join(rng.choice(COUNT_ALPHABET, size=int(rng.integers(0, 60))))
               for _ in range(2000)] + TRICKY_PROMPTS + PROSE + UNSEEN
    expected = np.array([regex_counts(p) for p in prompts], dtype=np.int64)
    np.testing.assert_array_equal(count_prompts(prompts), expected)
    assert count_prompts([]).shape == (0, 5)


def reference_transform(featurizer, inputs):
    """`TextFeaturizer.transform` without its row cache, compiled counts and layout:
    every text featurised, counted by the regexes and the parts stacked by scipy."""
    import scipy.sparse as sp

    tfidf = NgramTfidf.from_vectorizer(featurizer.vectorizer_).transform(
        [inp.text for inp in inputs])
    counts = [(*regex_counts(inp.prompt), inp.num_generated_tokens) for inp in inputs]
    numeric = np.log1p(np.asarray(counts, dtype=np.float64).reshape(len(inputs), 6))
    numeric = (numeric - featurizer.numeric_mean_) / featurizer.numeric_std_
    tasks = np.array([featurizer.task_index_.get(inp.task, -1) for inp in inputs])
    rows = np.flatnonzero(tasks >= 0)
    one_hot = sp.csr_matrix((np.ones(len(rows), dtype=np.float32), (rows, tasks[rows])),
                            shape=(len(inputs), len(featurizer.task_index_)))
    return sp.hstack([tfidf, sp.csr_matrix(numeric.astype(np.float32)), one_hot],
                     format="csr", dtype=np.float32)


@pytest.mark.parametrize("seed", [0, 1])
def test_cached_text_rows_give_the_features_of_a_fresh_featurisation(seed):
    """Batches that repeat texts, with new progress, generated text and texts the
    cache dropped, featurise exactly as computing every row again does."""
    import pickle

    from predictor.base import PredictionInput
    from predictor.features import TextFeaturizer

    rng = np.random.default_rng(seed)
    texts = random_texts(rng, 60) + PROSE + UNSEEN + TRICKY_PROMPTS
    tasks = ["chat", "math", None]
    train = [PredictionInput(t, task=tasks[i % 3]) for i, t in enumerate(texts)]
    featurizer = TextFeaturizer(ngram_max=2, min_df=1).fit(train)
    featurizer._row_cache.max_values = 200  # small: rows are dropped along the way
    for _ in range(6):
        picks = rng.integers(0, len(texts), size=25)
        batch = [PredictionInput(texts[i], num_generated_tokens=int(rng.integers(0, 300)),
                                 generated_text="beta x" if i % 7 == 0 else "",
                                 task=tasks[i % 3]) for i in picks]
        got, expected = featurizer.transform(batch), reference_transform(featurizer, batch)
        np.testing.assert_array_equal(got.indptr, expected.indptr)
        np.testing.assert_array_equal(got.indices, expected.indices)
        np.testing.assert_array_equal(got.data, expected.data)
    assert 0 < featurizer._row_cache._num_values <= 200
    saved = pickle.dumps(featurizer)
    assert b"NgramTfidf" not in saved
    restored = pickle.loads(saved)
    assert "_rows" not in restored.__dict__ and len(restored._row_cache) == 0
    assert "_tfidf" in restored.__dict__  # tables made at load, not by the first request


def test_a_request_predicted_again_is_not_featurised_again(monkeypatch):
    from predictor import features
    from predictor.base import PredictionInput

    texts = random_texts(np.random.default_rng(3), 30)
    featurizer = features.TextFeaturizer(min_df=1).fit([PredictionInput(t) for t in texts])
    first = featurizer.transform([PredictionInput(t) for t in texts[:10]])

    def featurised(*args):
        raise AssertionError("featurised again")

    monkeypatch.setattr(features.NgramTfidf, "transform", featurised)
    again = featurizer.transform([PredictionInput(t, num_generated_tokens=40)
                                  for t in texts[:10]])
    assert again.shape == first.shape and (again != first).nnz > 0  # progress moved


@pytest.mark.parametrize("setting", [{"sublinear_tf": False}, {"token_pattern": r"\S+"},
                                     {"stop_words": "english"}, {"norm": "l1"}])
def test_ngram_tfidf_rejects_a_configuration_it_does_not_reproduce(setting):
    texts = ["alpha beta gamma", "beta gamma delta", "gamma delta epsilon"]
    vectorizer = TfidfVectorizer(**({"sublinear_tf": True} | setting)).fit(texts)
    with pytest.raises(ValueError, match=next(iter(setting))):
        NgramTfidf.from_vectorizer(vectorizer)


def random_batch(rng: np.random.Generator, rows: int, in_dim: int) -> SparseBatch:
    sizes = rng.integers(0, 12, size=rows)
    indices = np.concatenate([rng.choice(in_dim, size=s, replace=False) for s in sizes])
    return SparseBatch(
        torch.from_numpy(indices.astype(np.int64)),
        torch.from_numpy(np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)),
        torch.from_numpy(rng.normal(size=len(indices)).astype(np.float32)),
    )


@pytest.mark.parametrize("num_experts", [1, 4, 10])
def test_fused_mixture_predicts_what_the_trained_modules_do(num_experts):
    moe = MixtureOfExperts(
        in_dim=300,
        num_experts=num_experts,
        expert_hidden_dim=16,
        gate_hidden_dim=8,
        gen=torch.Generator().manual_seed(num_experts),
    ).eval()
    fused = for_inference(moe)
    assert isinstance(fused, FusedMixture)
    batch = random_batch(np.random.default_rng(num_experts), rows=50, in_dim=300)
    with torch.inference_mode():
        torch.testing.assert_close(fused(batch), moe(batch), rtol=1e-5, atol=1e-5)


def test_two_threads_featurising_at_once_share_the_rows_safely():
    """The router's micro-batcher and its watchdog predict on different threads: the
    cache stays within its bound and every matrix is the fresh featurisation's."""
    from concurrent.futures import ThreadPoolExecutor

    from predictor.base import PredictionInput
    from predictor.features import TextFeaturizer

    texts = random_texts(np.random.default_rng(4), 80)
    featurizer = TextFeaturizer(min_df=1).fit([PredictionInput(t) for t in texts])
    featurizer._row_cache.max_values = 300  # rows dropped while both threads add theirs

    def featurise(worker: int) -> bool:
        rng = np.random.default_rng(worker)
        for _ in range(150):
            batch = [PredictionInput(texts[i], num_generated_tokens=int(i))
                     for i in rng.integers(0, len(texts), size=12)]
            got, expected = featurizer.transform(batch), reference_transform(featurizer, batch)
            if (got != expected).nnz:
                return False
        return True

    with ThreadPoolExecutor(2) as pool:
        assert all(pool.map(featurise, range(2)))
    cache = featurizer._row_cache
    kept = sum(end - start for _, start, end, _ in cache._rows.values())
    assert cache._num_values == kept <= 300


def test_a_refit_featurises_again_with_its_new_vocabulary():
    from predictor.base import PredictionInput
    from predictor.features import TextFeaturizer

    rng = np.random.default_rng(5)
    first, second = random_texts(rng, 40), random_texts(rng, 40)
    batch = [PredictionInput(t) for t in first[:10]]
    featurizer = TextFeaturizer(min_df=1).fit([PredictionInput(t) for t in first])
    featurizer.transform(batch)
    featurizer.fit([PredictionInput(t) for t in second])
    got, expected = featurizer.transform(batch), reference_transform(featurizer, batch)
    np.testing.assert_array_equal(got.indices, expected.indices)
    np.testing.assert_array_equal(got.data, expected.data)


def test_the_row_cache_drops_its_oldest_rows_first():
    from predictor.features import TextFeaturizer

    texts = [f"text {i} alpha beta" for i in range(10, 50)]  # as many terms each
    featurizer = TextFeaturizer(min_df=1).fit([PredictionInput(t) for t in texts])
    cache = featurizer._row_cache
    featurizer.transform([PredictionInput(texts[0])])
    values_per_row = cache._num_values
    cache.max_values = 10 * values_per_row
    for first in range(0, 40, 8):
        featurizer.transform([PredictionInput(t) for t in texts[first:first + 8]])
    assert [prompt for prompt, _ in cache._rows] == texts[30:]
    assert cache._num_values == 10 * values_per_row


def test_no_kernel_compiles_at_the_first_request():
    """Fit and load compile every kernel of the featurisation with the types requests
    pass (`features.warm_up`)."""
    import pickle

    from predictor.features import TextFeaturizer, feature_rows_kernel
    from predictor.ngrams import tfidf_kernel
    from predictor.text_counts import count_kernel

    texts = random_texts(np.random.default_rng(6), 30)
    fitted = TextFeaturizer(min_df=1).fit([PredictionInput(t, task="chat") for t in texts])
    featurizer = pickle.loads(pickle.dumps(fitted))
    kernels = (tfidf_kernel, count_kernel, feature_rows_kernel)
    compiled = [len(kernel.signatures) for kernel in kernels]
    batch = [PredictionInput(t, task=("chat", None)[i % 2]) for i, t in enumerate(texts[:9])]
    featurizer.transform(batch)  # every text new
    featurizer.transform(batch[:4] + [PredictionInput("new words", generated_text="x y")])
    featurizer.transform([replace(inp, num_generated_tokens=7) for inp in batch])  # cached
    assert [len(kernel.signatures) for kernel in kernels] == compiled


def reference_forward(fused: FusedMixture, batch: SparseBatch) -> torch.Tensor:
    """`FusedMixture.forward` with every operation out of place."""
    first = F.embedding_bag(batch.indices, fused.input_weight, batch.offsets, mode="sum",
                            per_sample_weights=batch.values) + fused.input_bias
    gate = first[:, : fused.gate_width]
    for weight, bias in fused.gate_layers:
        gate = torch.addmm(bias, torch.relu(gate), weight)
    hidden = first[:, fused.gate_width :].reshape(len(first), fused.num_experts, -1)
    hidden = hidden.transpose(0, 1)
    for weight, bias in fused.expert_layers:
        hidden = torch.baddbmm(bias, torch.relu(hidden), weight)
    return (torch.softmax(gate, dim=1) * hidden.squeeze(2).t()).sum(dim=1)


def test_moe_predicts_bitwise_the_lengths_of_the_reference_path():
    """Through the row cache, the compiled counts and layout and the in-place forward,
    `predict` gives exactly the lengths of regex counts, a scipy stack of the parts and
    an out-of-place forward, for new texts and for cached ones."""
    from predictor.moe import MoEPredictor
    from predictor.synthetic import make_synthetic_records

    records = make_synthetic_records(60, seed=2)
    moe = MoEPredictor(num_experts=4, expert_hidden_dim=16, gate_hidden_dim=8,
                       expert_epochs=2, gate_epochs=2, max_features=256, device="cpu").fit(
        [r.to_input() for r in records], [r.output_tokens for r in records])
    prompts = PROSE + UNSEEN + TRICKY_PROMPTS + [r.prompt for r in records[:30]]
    inputs = [PredictionInput(p, task=("chat", "code", None)[i % 3])
              for i, p in enumerate(prompts)]
    inputs += inputs[:5]  # a text twice in one batch
    with torch.inference_mode():
        batch = SparseBatch.from_csr(reference_transform(moe.featurizer_, inputs), moe.device_)
        log_lengths = reference_forward(moe.inference_net_, batch).numpy()
    expected = np.maximum(np.exp(np.clip(log_lengths, 0.0, moe.max_log_length_)), 1.0)
    np.testing.assert_array_equal(moe.predict(inputs), expected)
    np.testing.assert_array_equal(moe.predict(inputs[::-1]), expected[::-1])  # cached
