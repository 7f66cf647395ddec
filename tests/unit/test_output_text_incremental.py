"""`OutputText` decodes incrementally yet shows exactly what decoding the whole output
per chunk showed: every hit, delta and text is compared with `WholeDecodeOutputText`
(that earlier implementation, kept here as the reference) over random outputs, chunkings
and stops, on the tiny model's byte-level BPE, `WordHashTokenizer` and one token per
UTF-8 byte; and a long stream must not decode more ids per token as it grows.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import pytest

from app.engines.tiny_model import TINY_MODEL_NAME
from app.hardware.specs import get_model
from app.serving.tokenizer import (
    REPLACEMENT_CHAR,
    HfTokenizer,
    OutputText,
    StopHit,
    Tokenizer,
    WordHashTokenizer,
)
from tests.unit.test_live_router import Utf8Bytes

pytestmark = pytest.mark.unit

# characters of 1 to 4 UTF-8 bytes: byte-level BPE splits the longer ones across tokens
SAMPLE_TEXTS = ("the quick brown fox", "prix: 5€ (café)", "naïve 😀 emoji 🚀!", "日本語のテキスト",
                "a hash table works", "x€y€z", "Ωmega ok 🙂🙃")


class WholeDecodeOutputText:
    """The reference: `OutputText` as it was, decoding the whole output at each step."""

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = (),
                 stop_token_ids: Sequence[int] = (), include_stop: bool = False,
                 min_tokens: int = 0, skip_special_tokens: bool = True) -> None:
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self.stop, self.stop_token_ids = tuple(stop), frozenset(stop_token_ids)
        self.include_stop, self.min_tokens = include_stop, min_tokens
        self.token_ids: list[int] = []
        self.stop_reason: str | int | None = None
        self._text: str | None = ""
        self._sent = ""

    @property
    def text(self) -> str:
        if self._text is None:
            self._text = self._decode(self.token_ids)
        if isinstance(self.stop_reason, str):
            return self._text
        return self._text.rstrip(REPLACEMENT_CHAR)

    def _decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(token_ids, self.skip_special_tokens)

    def observe(self, token_ids: Sequence[int]) -> StopHit | None:
        batch = list(token_ids)
        eligible = max(self.min_tokens - len(self.token_ids), 0)
        token_stop = next((i for i, t in enumerate(batch)
                           if i >= eligible and t in self.stop_token_ids), None)
        if token_stop is not None:
            batch = batch[:token_stop + 1]
        shown = batch[:-1] if token_stop is not None and not self.include_stop else batch
        shown_text = None
        if self.stop and len(shown) > eligible:
            shown_text = self._decode(self.token_ids + shown)
            found = self._stop_string_in(shown, eligible, shown_text)
            if found is not None:
                num_tokens, text, reason = found
                self._end(batch[:num_tokens], text, reason)
                return StopHit(num_tokens, reason)
        if shown_text is None and token_stop is not None:
            shown_text = self._decode(self.token_ids + shown)
        if token_stop is not None:
            self._end(batch, shown_text, batch[-1])
            return StopHit(len(batch), batch[-1])
        self.token_ids.extend(batch)
        self._text = shown_text
        return None

    def _end(self, kept: list[int], text: str | None, reason: str | int) -> None:
        self.token_ids.extend(kept)
        self._text = text
        self.stop_reason = reason

    def _stop_string_in(self, batch: list[int], eligible: int,
                        whole: str) -> tuple[int, str, str] | None:
        before = self._decode(self.token_ids + batch[:eligible]) if eligible else self.text
        start = max(len(before) - max(map(len, self.stop)) + 1, 0)
        if self._earliest_stop(whole, start) is None:
            return None
        for k in range(eligible + 1, len(batch) + 1):
            text = self._decode(self.token_ids + batch[:k])
            found = self._earliest_stop(text, start)
            if found is not None:
                position, stop = found
                end = position + len(stop) if self.include_stop else position
                return k, text[:end], stop
        raise AssertionError("a stop string found in the whole batch is in some prefix")

    def _earliest_stop(self, text: str, start: int) -> tuple[int, str] | None:
        hits = [(pos, stop) for stop in self.stop if (pos := text.find(stop, start)) >= 0]
        return min(hits, default=None)

    def delta(self, final: bool = False) -> str:
        text = self.text
        if not final and self.stop_reason is None and self.stop and not self.include_stop:
            text = text[:max(len(text) - max(map(len, self.stop)) + 1, len(self._sent))]
        if not text.startswith(self._sent):
            return ""
        delta = text[len(self._sent):]
        self._sent = text
        return delta


@pytest.fixture(scope="module")
def tiny_hf(tiny_tokenizer_dir) -> HfTokenizer:
    return HfTokenizer(str(tiny_tokenizer_dir))


def random_output(rng: random.Random, tokenizer: Tokenizer, vocab_size: int) -> list[int]:
    """Sample texts' tokens (characters split across tokens) mixed with random ids, which
    make special tokens and invalid or unfinished UTF-8."""
    ids: list[int] = []
    while len(ids) < rng.randint(1, 40):
        if rng.random() < 0.5:
            ids.extend(tokenizer.encode(rng.choice(SAMPLE_TEXTS)))
        else:
            ids.extend(rng.randrange(vocab_size) for _ in range(rng.randint(1, 4)))
    return ids


def random_stops(rng: random.Random, text: str) -> list[str]:
    """Spans of the output's own text (so they match, often across chunks), and strings
    that never do."""
    stops = ["\x00never\x00"] if rng.random() < 0.3 else []
    for _ in range(rng.randint(0, 3)):
        if text:
            start = rng.randrange(len(text))
            stops.append(text[start:start + rng.randint(1, 6)])
    return stops


def random_chunks(rng: random.Random, ids: list[int]) -> list[list[int]]:
    chunks, i = [], 0
    while i < len(ids):
        size = rng.choice((1, 1, 1, 2, 3, 7))
        chunks.append(ids[i:i + size])
        i += size
    return chunks


def assert_same_stream(tokenizer: Tokenizer, ids: list[int], chunks: list[list[int]],
                       options: dict[str, Any]) -> None:
    incremental = OutputText(tokenizer, **options)
    reference = WholeDecodeOutputText(tokenizer, **options)
    for chunk in chunks:
        hit = incremental.observe(chunk)
        assert hit == reference.observe(chunk), (ids, chunk, options)
        assert incremental.delta() == reference.delta(), (ids, chunk, options)
        assert incremental.text == reference.text, (ids, chunk, options)
        if hit is not None:
            break
    assert incremental.delta(final=True) == reference.delta(final=True)
    assert incremental.text == reference.text
    assert incremental.token_ids == reference.token_ids
    assert incremental.stop_reason == reference.stop_reason


def check_random_streams(tokenizer: Tokenizer, vocab_size: int, seed: int,
                         num_streams: int) -> None:
    rng = random.Random(seed)
    for _ in range(num_streams):
        ids = random_output(rng, tokenizer, vocab_size)
        skip_special_tokens = rng.random() < 0.7
        text = tokenizer.decode(ids, skip_special_tokens)
        options = {
            "stop": random_stops(rng, text),
            "stop_token_ids": rng.sample(ids, rng.randint(0, 1)),
            "include_stop": rng.random() < 0.3,
            "min_tokens": rng.choice((0, 0, 2, 5)),
            "skip_special_tokens": skip_special_tokens,
        }
        assert_same_stream(tokenizer, ids, random_chunks(rng, ids), options)


@pytest.mark.parametrize("seed", range(4))
def test_the_byte_level_bpe_streams_exactly_what_whole_decoding_did(tiny_hf, seed):
    check_random_streams(tiny_hf, get_model(TINY_MODEL_NAME).vocab_size, seed, 150)


@pytest.mark.parametrize("seed", range(2))
def test_word_hash_streams_exactly_what_whole_decoding_did(seed):
    check_random_streams(WordHashTokenizer(vocab_size=50), 50, seed, 150)


@pytest.mark.parametrize("seed", range(2))
def test_utf8_bytes_stream_exactly_what_whole_decoding_did(seed):
    check_random_streams(Utf8Bytes(), 256, seed, 150)


def test_a_character_split_across_tokens_is_shown_once_whole(tiny_hf):
    ids = tiny_hf.encode("🚀")
    assert len(ids) > 1  # the tiny vocabulary has no such character: one token per byte
    output = OutputText(tiny_hf)
    for token in ids[:-1]:
        output.observe([token])
        assert output.delta() == "" and output.text == ""
    output.observe(ids[-1:])
    assert output.delta() == "🚀" == output.text


def test_a_stop_string_across_chunks_and_characters_ends_the_output(tiny_hf):
    ids = tiny_hf.encode("price 5€ then more")
    output = OutputText(tiny_hf, stop=["5€ t"])
    hit = next(hit for token in ids if (hit := output.observe([token])) is not None)
    assert hit.reason == "5€ t" and output.text == "price "
    assert tiny_hf.decode(output.token_ids).endswith("5€ t")


class CountingWordHash(WordHashTokenizer):
    """Counts the ids each `decode` call is given."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__(vocab_size)
        self.ids_per_call: list[int] = []

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        self.ids_per_call.append(len(token_ids))
        return super().decode(token_ids, skip_special_tokens)


class CountingBackend:
    """A `tokenizers.Tokenizer` stand-in that counts the ids each `decode` call is given."""

    def __init__(self, backend: Any) -> None:
        self._backend = backend
        self.ids_per_call: list[int] = []

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        self.ids_per_call.append(len(token_ids))
        return self._backend.decode(token_ids, skip_special_tokens=skip_special_tokens)


def stream_one_token_per_chunk(tokenizer: Tokenizer, ids: list[int]) -> str:
    """Stream with a stop string that never matches, reading a delta per token."""
    output = OutputText(tokenizer, stop=["\x00never\x00"])
    streamed = []
    for token in ids:
        assert output.observe([token]) is None
        streamed.append(output.delta())
    streamed.append(output.delta(final=True))
    return "".join(streamed)


NUM_STREAMED = 3000


def test_a_word_hash_stream_decodes_a_bounded_number_of_ids_per_token():
    tokenizer = CountingWordHash(vocab_size=1000)
    ids = [2 + i % 997 for i in range(NUM_STREAMED)]
    assert stream_one_token_per_chunk(tokenizer, ids) == WordHashTokenizer(1000).decode(ids)
    assert max(tokenizer.ids_per_call) <= 2  # the new token behind the one before
    assert sum(tokenizer.ids_per_call) <= 4 * NUM_STREAMED  # whole decoding: ~n * n / 2


def test_a_byte_level_bpe_stream_decodes_a_bounded_number_of_ids_per_token(tiny_hf,
                                                                            monkeypatch):
    ids = tiny_hf.encode(" ".join(SAMPLE_TEXTS * 200))[:NUM_STREAMED]
    whole_text = tiny_hf.decode(ids).rstrip(REPLACEMENT_CHAR)  # may end inside a character
    hf = tiny_hf.backend
    backend = CountingBackend(hf.backend_tokenizer)
    whole_decodes: list[int] = []

    def counted_hf_decode(token_ids: list[int], **kwargs: Any) -> str:
        whole_decodes.append(len(token_ids))
        return hf.decode(token_ids, **kwargs)

    monkeypatch.setattr(tiny_hf, "_tokenizer",
                        SimpleNamespace(backend_tokenizer=backend, decode=counted_hf_decode))
    assert stream_one_token_per_chunk(tiny_hf, ids) == whole_text
    assert not whole_decodes  # transformers' decode is never called
    # a character's byte tokens, behind the tokens of the one before (whole decoding: n)
    assert max(backend.ids_per_call) <= 8
    assert sum(backend.ids_per_call) <= 8 * NUM_STREAMED  # whole decoding: ~n * n / 2
