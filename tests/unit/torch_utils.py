"""Shared by the torch-based predictor tests."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Train on one thread: deterministic timing and no fight for the 2 cores."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]


def build_tiny_encoder(directory: Path, texts: list[str]) -> Path:
    """A 2-layer BERT with a WordPiece tokenizer trained on `texts`, saved to `directory`."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import BertConfig, BertModel, PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordPieceTrainer(vocab_size=300, special_tokens=SPECIAL_TOKENS)
    tokenizer.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
    )
    fast.save_pretrained(directory)
    config = BertConfig(
        vocab_size=len(fast),
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=128,
    )
    with torch.random.fork_rng():  # random weights without touching the caller's RNG
        torch.manual_seed(0)
        BertModel(config).save_pretrained(directory)
    return directory
