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

from app.engines.messages import TokenLogprobs
from app.serving.tokenizer import REPLACEMENT_CHAR, Tokenizer

MIN_LOGPROB = -9999.0  # -inf is not JSON; vLLM reports this floor
MAX_CONTEXT_TOKENS = 4  # enough preceding tokens to complete any UTF-8 character


def _finite(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


class LogprobsFormatter:
    """Formats one choice's logprobs, chunk by chunk (text offsets run on)."""

    def __init__(self, tokenizer: Tokenizer, chat: bool) -> None:
        self.tokenizer = tokenizer
        self.chat = chat
        self._text_offset = 0
        self._context: list[int] = []  # the last sampled token ids, oldest first

    def format(self, token_ids: Sequence[int],
               entries: Sequence[TokenLogprobs | None]) -> dict[str, Any]:
        """The `logprobs` object of a reply or chunk carrying these tokens."""
        if len(token_ids) != len(entries) or any(e is None for e in entries):
            raise ValueError("every token needs its logprobs")
        steps = []
        for token_id, entry in zip(token_ids, entries, strict=True):
            steps.append((self._text(token_id), entry, self._alternatives(entry)))
            self._context = [*self._context, token_id][-MAX_CONTEXT_TOKENS:]
        if self.chat:
            return {"content": [self._chat_entry(text, e, top) for text, e, top in steps]}
        offsets = []
        for text, _, _ in steps:
            offsets.append(self._text_offset)
            self._text_offset += len(text)
        return {
            "tokens": [text for text, _, _ in steps],
            "token_logprobs": [_finite(e.logprob) for _, e, _ in steps],
            "top_logprobs": [{alt: _finite(lp) for alt, lp in top} | (
                {} if text in dict(top) else {text: _finite(e.logprob)})
                for text, e, top in steps],
            "text_offset": offsets,
        }

    def _alternatives(self, entry: TokenLogprobs) -> list[tuple[str, float]]:
        return [(self._text(t), lp) for t, lp in entry.top]

    def _text(self, token_id: int) -> str:
        """A token's text at this position, as vLLM shows it: a token that ends in part
        of a UTF-8 character is read with the sampled tokens before it, and shows what
        it adds to them ("" while the character is still incomplete)."""
        text = self.tokenizer.token_text(token_id)
        if not text.endswith(REPLACEMENT_CHAR):
            return text
        for num_context in range(1, len(self._context) + 1):
            context = self._context[-num_context:]
            whole = self.tokenizer.decode([*context, token_id])
            if whole.endswith(REPLACEMENT_CHAR):
                continue
            clean_end = len(context)  # context tokens that are whole text on their own
            while clean_end > 0 and self.tokenizer.token_text(
                    context[clean_end - 1]).endswith(REPLACEMENT_CHAR):
                clean_end -= 1
            prefix = self.tokenizer.decode(context[:clean_end]) if clean_end else ""
            if whole.startswith(prefix):
                return whole[len(prefix):]
            pairs = zip(prefix, whole, strict=False)
            common = next((i for i, (a, b) in enumerate(pairs) if a != b),
                          min(len(prefix), len(whole)))
            return whole[common:]
        return ""

    @staticmethod
    def _chat_entry(text: str, entry: TokenLogprobs,
                    top: list[tuple[str, float]]) -> dict[str, Any]:
        return {
            "token": text,
            "logprob": _finite(entry.logprob),
            "bytes": list(text.encode()),
            "top_logprobs": [{"token": alt, "logprob": _finite(lp), "bytes": list(alt.encode())}
                             for alt, lp in top],
        }
