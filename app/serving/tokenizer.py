"""Text <-> token ids for the router.

The router works in token ids (block hashes for prefix hits, migration by token
ids), so it tokenizes prompts itself and detokenizes what engines stream back.
- `HfTokenizer`: the served model's own tokenizer, from its local directory.
- `WordHashTokenizer`: for clusters of simulated engines, which generate no
  language: whitespace words map to stable ids, ids decode to `<id>` words.
`OutputText` turns an output's ids into the text a client sees, decoding each new
token once (`IncrementalDecoder`) rather than the whole output per streamed chunk.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from app.serving.api import ChatMessage, render_chat

REPLACEMENT_CHAR = "\ufffd"  # what a decoder shows for an incomplete UTF-8 sequence


class Tokenizer(ABC):
    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Prompt text -> token ids (no special tokens added beyond the model's own)."""

    @abstractmethod
    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Token ids -> text (special tokens left out unless asked for)."""

    @property
    def backend(self) -> Any:
        """The tokenizer object vLLM's tool parsers read (None: none)."""
        return None

    def render_chat(self, messages: Sequence[ChatMessage],
                    tools: Sequence[dict[str, Any]] | None = None) -> str:
        """Chat messages (and the tools offered) -> one prompt string."""
        return render_chat(messages)

    def token_text(self, token_id: int) -> str:
        """One token's text on its own (as logprobs show it, like vLLM)."""
        return self.decode([token_id])

    def incremental_decoder(self, skip_special_tokens: bool = True) -> IncrementalDecoder:
        """A decoder for an output that grows a few tokens at a time, which decodes each
        step's new ids rather than all of them again."""
        return IncrementalDecoder(partial(self.decode, skip_special_tokens=skip_special_tokens))


class HfTokenizer(Tokenizer):
    """A Hugging Face tokenizer loaded from a local directory (never the hub)."""

    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer

        self._tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text))

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    @property
    def backend(self) -> Any:
        return self._tokenizer

    def token_text(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id])  # special tokens by name, as vLLM's

    def incremental_decoder(self, skip_special_tokens: bool = True) -> IncrementalDecoder:
        """Steps decode with the Rust `tokenizers` backend itself: transformers' decode is
        the backend's plus a few microseconds a call (and a clean-up of spaces it skips
        for BPE models, which served LLMs are)."""
        backend = getattr(self._tokenizer, "backend_tokenizer", None)
        if backend is None:  # a Python ("slow") tokenizer
            return super().incremental_decoder(skip_special_tokens)
        return IncrementalDecoder(partial(backend.decode, skip_special_tokens=skip_special_tokens))

    def render_chat(self, messages: Sequence[ChatMessage],
                    tools: Sequence[dict[str, Any]] | None = None) -> str:
        if not getattr(self._tokenizer, "chat_template", None):
            return render_chat(messages)
        return self._tokenizer.apply_chat_template(
            [m.for_template() for m in messages], tools=list(tools) if tools else None,
            tokenize=False, add_generation_prompt=True)


class WordHashTokenizer(Tokenizer):
    """Stable word ids in [first_id, vocab_size) for simulated engines."""

    def __init__(self, vocab_size: int, first_id: int = 2) -> None:
        if vocab_size <= first_id:
            raise ValueError(f"vocab_size must exceed {first_id}, got {vocab_size}")
        self.vocab_size = vocab_size
        self.first_id = first_id

    def encode(self, text: str) -> list[int]:
        span = self.vocab_size - self.first_id
        return [
            self.first_id
            + int.from_bytes(hashlib.blake2b(w.encode(), digest_size=8).digest(), "little") % span
            for w in text.split()
        ]

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(f" <{t}>" for t in token_ids)


class _AppendOnlyText:
    """Text that only grows, kept in pieces: reading its last characters costs their
    number, not the whole text's (a stream reads a few per token)."""

    def __init__(self) -> None:
        self._pieces: list[str] = []
        self._starts: list[int] = []  # where each piece starts in the text
        self.length = 0

    def append(self, piece: str) -> None:
        if piece:
            self._pieces.append(piece)
            self._starts.append(self.length)
            self.length += len(piece)

    def since(self, start: int) -> str:
        """The text from character `start` on."""
        if not self._pieces:
            return ""
        first = bisect_right(self._starts, start) - 1
        return "".join(self._pieces[first:])[start - self._starts[first]:]


class IncrementalDecoder:
    """The text of a growing list of token ids, decoding per step only the ids whose text
    is not confirmed yet and the ids confirmed just before them (vLLM's prefix and read
    offsets): decoding all the ids at every step costs quadratic time in their number.

    The text is what `decode` gives for all the ids, trailing U+FFFD included, when
    `decode` is local: where the text of some ids ends in a whole character, the ids after
    them decode (behind the few before, which give SentencePiece its leading space) to the
    rest of the text. Byte-level BPE, SentencePiece and one-word-per-id decoders are.
    """

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self._confirmed = _AppendOnlyText()  # the text through the last whole character
        self._window: list[int] = []  # the ids decoded at each step
        self._num_context = 0  # the window's first ids: confirmed, decoded for context
        self._context_text = ""  # what those ids decode to on their own
        self._pending = ""  # the other ids' text: empty or ending in U+FFFD

    def extend(self, token_ids: Sequence[int]) -> None:
        """Decode more ids."""
        self._window.extend(token_ids)
        new_text = self._decode(self._window)[len(self._context_text):]
        if not new_text or new_text.endswith(REPLACEMENT_CHAR):  # the next id may complete it
            self._pending = new_text
            return
        self._confirmed.append(new_text)
        self._pending = ""
        self._window = self._window[self._num_context:]
        self._num_context = len(self._window)
        self._context_text = self._decode(self._window)

    @property
    def length(self) -> int:
        return self._confirmed.length + len(self._pending)

    @property
    def whole_length(self) -> int:
        """The length short of trailing U+FFFD: a character the next id may complete (the
        confirmed text never ends in one)."""
        return self._confirmed.length + len(self._pending.rstrip(REPLACEMENT_CHAR))

    @property
    def confirmed_length(self) -> int:
        """The length of the text no later id changes."""
        return self._confirmed.length

    def since(self, start: int, end: int | None = None) -> str:
        """The text from character `start` (to `end`)."""
        confirmed = self._confirmed.length
        if start >= confirmed:
            tail = self._pending[start - confirmed:]
        else:
            tail = self._confirmed.since(start) + self._pending
        return tail if end is None else tail[:end - start]


@dataclass(frozen=True)
class StopHit:
    """Where a stop condition ended the output within a batch of new tokens."""

    num_tokens: int  # the batch's tokens kept, through the one that completed the stop
    reason: str | int  # the stop string or stop token id (vLLM's `stop_reason`)


class OutputText:
    """One choice's output as the client sees it: detokenized, ended by a stop string or
    stop token id, streamed in deltas.

    The router feeds every generated token (`observe`), on whichever engine it ran, so a
    stop string spanning a move is found like any other. As in vLLM, the output ends
    with the token that completes a stop, whose text (the stop string, or the stop
    token's text) is left out unless `include_stop`; no stop counts among the first
    `min_tokens` tokens; a stream holds back the last
    `len(longest stop) - 1` characters (they may begin a stop) and a trailing incomplete
    UTF-8 character until the token that completes it arrives. Special tokens are left
    out of the text unless not `skip_special_tokens`.

    The text is decoded incrementally (`Tokenizer.incremental_decoder`) and every search
    and delta reads only its end, so a chunk costs the same however long the output is.
    """

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = (),
                 stop_token_ids: Sequence[int] = (), include_stop: bool = False,
                 min_tokens: int = 0, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = tuple(stop)
        self.stop_token_ids = frozenset(stop_token_ids)
        self.include_stop = include_stop
        self.min_tokens = min_tokens
        self._longest_stop = max(map(len, self.stop), default=0)
        self.reset()

    def reset(self) -> None:
        """Forget the output (the request starts over)."""
        self.token_ids: list[int] = []
        self.stop_reason: str | int | None = None
        self._decoded = self.tokenizer.incremental_decoder(self.skip_special_tokens)
        self._cut: str | None = None  # the text a stop string ended
        self._num_sent = 0  # characters streamed so far

    @property
    def text(self) -> str:
        """The output text so far (final once a stop ended it). As in vLLM, trailing
        U+FFFD are held back: an incomplete UTF-8 character the next token may complete,
        and never shown when it ends the output."""
        if self._cut is not None:  # the text before a stop string is whole
            return self._cut
        return self._decoded.since(0, self._decoded.whole_length)

    def observe(self, token_ids: Sequence[int]) -> StopHit | None:
        """Take new output tokens; the hit when a stop ends the output among them."""
        if self.stop_reason is not None:
            raise ValueError("the output already ended at a stop")
        batch = list(token_ids)
        eligible = max(self.min_tokens - len(self.token_ids), 0)  # first index a stop counts
        token_stop = next((i for i, t in enumerate(batch)
                           if i >= eligible and t in self.stop_token_ids), None)
        if token_stop is not None:
            batch = batch[:token_stop + 1]
        # the stop token's own text is left out before stop strings are looked for
        shown = batch[:-1] if token_stop is not None and not self.include_stop else batch
        if self.stop and len(shown) > eligible:
            found = self._decode_to_stop_string(shown, eligible)
            if found is not None:
                num_tokens, self._cut, self.stop_reason = found
                self.token_ids.extend(batch[:num_tokens])
                return StopHit(num_tokens, self.stop_reason)
        else:
            self._decoded.extend(shown)
        self.token_ids.extend(batch)
        if token_stop is None:
            return None
        self.stop_reason = batch[-1]
        return StopHit(len(batch), batch[-1])

    def _decode_to_stop_string(self, batch: list[int],
                               eligible: int) -> tuple[int, str, str] | None:
        """Decode the batch token by token: (tokens through the one completing the
        earliest stop string, the text cut there, the stop string), or None when no stop
        string ends in this batch at or after its token `eligible`.

        A stop string counts only if the batch's whole text has one as well (text ending
        in U+FFFD may still change). After the first token, a search starts at the first
        character the token can have changed, less the longest stop: the earlier ones
        were searched already.
        """
        decoded = self._decoded
        if eligible:
            decoded.extend(batch[:eligible])
            before = decoded.length
        else:
            before = decoded.whole_length
        start = max(before - self._longest_stop + 1, 0)
        search_from, found = start, None
        for k in range(eligible + 1, len(batch) + 1):  # the token that completes it
            decoded.extend(batch[k - 1:k])
            if found is not None:
                continue
            hit = self._earliest_stop(search_from)
            if hit is not None:
                position, stop = hit
                end = position + len(stop) if self.include_stop else position
                found = k, decoded.since(0, end), stop
            search_from = max(search_from, decoded.confirmed_length - self._longest_stop + 1)
        if found is None or found[0] == len(batch) or self._earliest_stop(start) is not None:
            return found
        return None

    def _earliest_stop(self, start: int) -> tuple[int, str] | None:
        """(position, stop string) of the earliest stop string in the text from `start`."""
        text = self._decoded.since(start)
        hits = [(start + pos, stop) for stop in self.stop if (pos := text.find(stop)) >= 0]
        return min(hits, default=None)

    def delta(self, final: bool = False) -> str:
        """The text not streamed yet (all of it when `final` or stopped).

        Streamed text is never rewritten (a later token only adds to the text), except
        by a stop string's cut, which can fall before the end of what was streamed with
        `include_stop` or `min_tokens`: then nothing more is sent."""
        length = len(self._cut) if self._cut is not None else self._decoded.whole_length
        if length < self._num_sent:
            return ""
        end = length
        if not final and self.stop_reason is None and self.stop and not self.include_stop:
            end = max(length - self._longest_stop + 1, self._num_sent)
        start, self._num_sent = self._num_sent, end
        if self._cut is not None:
            return self._cut[start:end]
        return self._decoded.since(start, end)
