"""Text <-> token ids for the router.

The router works in token ids (block hashes for prefix hits, migration by token
ids), so it tokenizes prompts itself and detokenizes what engines stream back.
- `HfTokenizer`: the served model's own tokenizer, from its local directory.
- `WordHashTokenizer`: for clusters of simulated engines, which generate no
  language: whitespace words map to stable ids, ids decode to `<id>` words.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
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
        self.reset()

    def reset(self) -> None:
        """Forget the output (the request starts over)."""
        self.token_ids: list[int] = []
        self.stop_reason: str | int | None = None
        self._text: str | None = ""  # decoded token_ids (None: not decoded since a change)
        self._sent = ""  # text streamed so far

    @property
    def text(self) -> str:
        """The output text so far (final once a stop ended it). As in vLLM, trailing
        U+FFFD are held back: an incomplete UTF-8 character the next token may complete,
        and never shown when it ends the output."""
        if self._text is None:
            self._text = self._decode(self.token_ids)
        if isinstance(self.stop_reason, str):  # the text before a stop string is whole
            return self._text
        return self._text.rstrip(REPLACEMENT_CHAR)

    def _decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(token_ids, self.skip_special_tokens)

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
        shown_text = None  # the output through `shown`, once decoded
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
        self._text = shown_text  # shown is the whole batch here; None: decoded when read
        return None

    def _end(self, kept: list[int], text: str, reason: str | int) -> None:
        self.token_ids.extend(kept)
        self._text = text
        self.stop_reason = reason

    def _stop_string_in(self, batch: list[int], eligible: int,
                        whole: str) -> tuple[int, str, str] | None:
        """(tokens through the one completing the earliest stop string, the text cut
        there, the stop string), or None when no stop string ends in this batch at or
        after its token `eligible`; `whole` is the output decoded through the batch."""
        before = self._decode(self.token_ids + batch[:eligible]) if eligible else self.text
        start = max(len(before) - max(map(len, self.stop)) + 1, 0)
        if self._earliest_stop(whole, start) is None:
            return None
        for k in range(eligible + 1, len(batch) + 1):  # the token that completes it
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
        """The text not streamed yet (all of it when `final` or stopped)."""
        text = self.text
        if not final and self.stop_reason is None and self.stop and not self.include_stop:
            text = text[:max(len(text) - max(map(len, self.stop)) + 1, len(self._sent))]
        if not text.startswith(self._sent):  # a merge rewrote earlier text: resend nothing
            return ""
        delta = text[len(self._sent):]
        self._sent = text
        return delta
