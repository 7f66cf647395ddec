"""Token log-probabilities in OpenAI's two shapes.

Engines report, per generated token, its logprob, its rank and the top alternatives
(`TokenLogprobs`); the router keeps them with the tokens, whichever engine produced
them, so a moved request's logprobs are those of the tokens the client got. Shapes
as vLLM's OpenAI server gives them: completions list tokens, their logprobs, the top
alternatives (the sampled token included) and text offsets; chat lists content
entries with the token's UTF-8 bytes and the top alternatives.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from app.engine_types import TokenLogprobs
from app.serving.tokenizer import Tokenizer

MIN_LOGPROB = -9999.0  # -inf is not JSON; vLLM reports this floor


def _finite(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


class LogprobsFormatter:
    """Formats one choice's logprobs, chunk by chunk (text offsets run on)."""

    def __init__(self, tokenizer: Tokenizer, chat: bool) -> None:
        self.tokenizer = tokenizer
        self.chat = chat
        self._text_offset = 0

    def format(self, token_ids: Sequence[int],
               entries: Sequence[TokenLogprobs | None]) -> dict[str, Any]:
        """The `logprobs` object of a reply or chunk carrying these tokens."""
        if len(token_ids) != len(entries) or any(e is None for e in entries):
            raise ValueError("every token needs its logprobs")
        steps = [(self.tokenizer.token_text(t), e) for t, e in zip(token_ids, entries, strict=True)]
        if self.chat:
            return {"content": [self._chat_entry(text, e) for text, e in steps]}
        offsets = []
        for text, _ in steps:
            offsets.append(self._text_offset)
            self._text_offset += len(text)
        return {
            "tokens": [text for text, _ in steps],
            "token_logprobs": [_finite(e.logprob) for _, e in steps],
            "top_logprobs": [self._top_with_sampled(text, e) for text, e in steps],
            "text_offset": offsets,
        }

    def _top_with_sampled(self, text: str, entry: TokenLogprobs) -> dict[str, float]:
        top = {self.tokenizer.token_text(t): _finite(lp) for t, lp in entry.top}
        top.setdefault(text, _finite(entry.logprob))
        return top

    def _chat_entry(self, text: str, entry: TokenLogprobs) -> dict[str, Any]:
        return {
            "token": text,
            "logprob": _finite(entry.logprob),
            "bytes": list(text.encode()),
            "top_logprobs": [
                {"token": (alt := self.tokenizer.token_text(t)), "logprob": _finite(lp),
                 "bytes": list(alt.encode())}
                for t, lp in entry.top
            ],
        }
