"""The prompt counts of `TextFeaturizer`'s numeric columns, in one compiled pass.

Three regex passes and a `split` per prompt cost more than the TF-IDF kernel (about
6 us per request against 4). Here one numba kernel walks the prompts' code points once,
with the character classes of the rules taken from `re` and `str` themselves, so the
counts are exactly the rules':

- words: `len(prompt.split())` (runs of characters that are not `str.isspace`)
- chars: `len(prompt)`
- numbers: `len(re.findall(r"\\d+(?:[.,]\\d+)*", prompt))`
- sentences: `len(re.findall(r"[.!?](?:\\s|$)", prompt))` (sentence ends)
- lines: `prompt.count("\\n")`
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence

import numpy as np
from numba import njit

from predictor.ngrams import NUM_CODE_POINTS, code_points

__all__ = ["COUNT_NAMES", "NUM_COUNTS", "count_prompts", "warm_up"]

COUNT_NAMES = ("prompt_words", "prompt_chars", "prompt_numbers", "prompt_sentences",
               "prompt_lines")

NUM_COUNTS = len(COUNT_NAMES)

# Bits of `character_classes`.
REGEX_DIGIT = 1  # `\d`
REGEX_SPACE = 2  # `\s`
SPLIT_SPACE = 4  # `str.isspace`, where `str.split()` splits
PERIOD, COMMA, EXCLAMATION, QUESTION, NEWLINE = map(ord, ".,!?\n")


def regex_class(pattern: str, every: str) -> np.ndarray:
    """Per code point: whether the one-character regex class `pattern` matches it."""
    return code_points(re.sub(f"[^{pattern}]", "\0", every)) != 0


@functools.cache
def character_classes() -> np.ndarray:
    """uint8 per code point: the class bits the counting rules look up."""
    every = "".join(map(chr, range(NUM_CODE_POINTS)))
    split_space = np.fromiter(map(str.isspace, every), dtype=bool, count=NUM_CODE_POINTS)
    return (regex_class(r"\d", every) * REGEX_DIGIT + regex_class(r"\s", every) * REGEX_SPACE
            + split_space * SPLIT_SPACE).astype(np.uint8)


def count_prompts(prompts: Sequence[str]) -> np.ndarray:
    """int64 (prompts, `NUM_COUNTS`): each prompt's counts, as `COUNT_NAMES` orders them."""
    row_starts = np.zeros(len(prompts) + 1, dtype=np.int64)
    np.cumsum(np.fromiter(map(len, prompts), dtype=np.int64, count=len(prompts)),
              out=row_starts[1:])
    return count_kernel(code_points("".join(prompts)), row_starts, character_classes())


@njit(cache=True, nogil=True)
def count_kernel(text: np.ndarray, row_starts: np.ndarray, classes: np.ndarray) -> np.ndarray:
    """The counts of the rows whose code points are `text[row_starts[r]:row_starts[r + 1]]`.

    A number is a run of digits that goes on over a "." or "," only when a digit follows
    it, which is where the regex's greedy match ends; a regex match never overlaps the
    next one, and neither do these.
    """
    num_rows = len(row_starts) - 1
    counts = np.zeros((num_rows, NUM_COUNTS), dtype=np.int64)
    for row in range(num_rows):
        start, end = row_starts[row], row_starts[row + 1]
        words = numbers = sentence_ends = lines = 0
        after_space = True
        in_number = False
        for i in range(start, end):
            point = text[i]
            kind = classes[point]
            is_space = kind & SPLIT_SPACE != 0
            if after_space and not is_space:
                words += 1
            after_space = is_space
            if kind & REGEX_DIGIT:
                if not in_number:
                    numbers += 1
                    in_number = True
            elif not (in_number and (point == PERIOD or point == COMMA) and i + 1 < end
                      and classes[text[i + 1]] & REGEX_DIGIT):
                in_number = False
            if (point == PERIOD or point == EXCLAMATION or point == QUESTION) and (
                    i + 1 == end or classes[text[i + 1]] & REGEX_SPACE):
                sentence_ends += 1
            if point == NEWLINE:
                lines += 1
        counts[row, 0] = words
        counts[row, 1] = end - start
        counts[row, 2] = numbers
        counts[row, 3] = sentence_ends
        counts[row, 4] = lines
    return counts


@functools.cache
def warm_up() -> None:
    """Compile the kernel (or load it from numba's on-disk cache) and build the class
    table now, so that no request pays for them."""
    count_prompts(["warm up 1.5.", ""])
