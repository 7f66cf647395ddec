"""Synthetic prompts whose output length depends on the text, for tests and smoke runs.

Each prompt asks for a kind of answer ("one word", "a paragraph", "a detailed essay")
that sets the median length; filler words add noise, and a few task tags shift it.
A constant (history) predictor cannot do well here; a text model can.
"""

from __future__ import annotations

import numpy as np

from predictor.data import LengthRecord

__all__ = ["make_synthetic_records"]

# requested answer kind -> median output tokens
ANSWER_KINDS = {
    "answer with one word": 4,
    "give a short answer": 20,
    "write a paragraph": 90,
    "write a detailed essay": 400,
    "write a long report with sections": 1200,
}
TASK_SCALE = {"chat": 1.0, "code": 1.6}
FILLER = "alpha beta gamma delta river mountain city music history science garden".split()


def make_synthetic_records(
    num_prompts: int, answers_per_prompt: int = 2, seed: int = 0, noise: float = 0.25
) -> list[LengthRecord]:
    """`num_prompts` distinct prompts, each answered `answers_per_prompt` times."""
    rng = np.random.default_rng(seed)
    kinds = list(ANSWER_KINDS)
    tasks = list(TASK_SCALE)
    records = []
    for i in range(num_prompts):
        kind = kinds[rng.integers(len(kinds))]
        task = tasks[rng.integers(len(tasks))]
        filler = " ".join(rng.choice(FILLER, size=rng.integers(3, 12)))
        prompt = f"Please {kind} about topic {i}: {filler}."
        median = ANSWER_KINDS[kind] * TASK_SCALE[task]
        for _ in range(answers_per_prompt):
            length = max(1, round(median * float(np.exp(rng.normal(0.0, noise)))))
            records.append(LengthRecord(prompt, length, task, f"synthetic:{i}", len(records) + 1))
    return records
