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

from app.serving.api import ChatMessage, render_chat

REPLACEMENT_CHAR = "\ufffd"  # what a decoder shows for an incomplete UTF-8 sequence


class Tokenizer(ABC):
    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Prompt text -> token ids (no special tokens added beyond the model's own)."""

    @abstractmethod
    def decode(self, token_ids: Sequence[int]) -> str:
        """Token ids -> text."""

    def render_chat(self, messages: Sequence[ChatMessage]) -> str:
        """Chat messages -> one prompt string."""
        return render_chat(messages)


class HfTokenizer(Tokenizer):
    """A Hugging Face tokenizer loaded from a local directory (never the hub)."""

    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer

        self._tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text))

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def render_chat(self, messages: Sequence[ChatMessage]) -> str:
        if not getattr(self._tokenizer, "chat_template", None):
            return render_chat(messages)
        return self._tokenizer.apply_chat_template(
            [m.model_dump() for m in messages], tokenize=False, add_generation_prompt=True
        )


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

    def decode(self, token_ids: Sequence[int]) -> str:
        return "".join(f" <{t}>" for t in token_ids)


class IncrementalDecoder:
    """Streams text for a growing list of token ids.

    Decodes the whole output each time and returns the new suffix, holding back a
    trailing incomplete UTF-8 character until the token that completes it arrives.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []
        self.text = ""

    def feed(self, token_ids: Sequence[int], final: bool = False) -> str:
        self.token_ids.extend(token_ids)
        text = self.tokenizer.decode(self.token_ids)
        if not final:
            text = text.rstrip(REPLACEMENT_CHAR)
        if not text.startswith(self.text):  # a merge rewrote earlier text: resend nothing
            return ""
        delta = text[len(self.text):]
        self.text = text
        return delta
