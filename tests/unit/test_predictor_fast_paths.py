"""The prediction hot path's fast forms equal the reference forms they replace."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sklearn.feature_extraction.text import TfidfVectorizer

from predictor.features import tfidf_rows
from predictor.nets import FusedMixture, MixtureOfExperts, SparseBatch, for_inference
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


@pytest.mark.parametrize("ngram_max", [1, 2, 3])
@pytest.mark.parametrize("seed", [0, 1])
def test_tfidf_rows_equal_sklearn_transform(ngram_max, seed):
    rng = np.random.default_rng(seed)
    vectorizer = TfidfVectorizer(
        ngram_range=(1, ngram_max), sublinear_tf=True, min_df=2, dtype=np.float32
    ).fit(random_texts(rng, 200))
    texts = random_texts(rng, 100)  # unseen texts: out-of-vocabulary terms too
    expected = vectorizer.transform(texts)
    got = tfidf_rows(vectorizer, texts)
    assert got.dtype == expected.dtype == np.float32
    assert got.shape == expected.shape
    np.testing.assert_array_equal(got.indptr, expected.indptr)
    np.testing.assert_array_equal(got.indices, expected.indices)
    np.testing.assert_allclose(got.data, expected.data, rtol=1e-6, atol=1e-7)
    assert got.nnz > 0


def test_tfidf_rows_reject_a_configuration_they_do_not_reproduce():
    texts = ["one two three", "two three four", "three four five"]
    vectorizer = TfidfVectorizer(sublinear_tf=False).fit(texts)
    with pytest.raises(ValueError, match="sublinear_tf"):
        tfidf_rows(vectorizer, texts)


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
