"""Greedy agreement on the trained demo model: do two ways of running it give the same replies?

The questions are arithmetic questions of the demo's evaluation split (`demo_model/corpus.py`),
thinking on, 160 tokens at most; each reply is compared token for token with the reference
way's (the first one given).
"""

from __future__ import annotations

import random
import statistics
from typing import Callable

from chat import ChatEngine
from demo_model import corpus


def demo_agreement(engines: dict[str, Callable[[], ChatEngine]], replies: int) -> dict[str, dict[str, float]]:
    """For each way (an engine factory; the first is the reference): the share of identical
    replies, and the mean share of each reference reply before the first difference."""
    rng = random.Random(1)
    questions = [corpus.question_text(rng, corpus.first_problem(rng, evaluation=True), evaluation=True)
                 for _ in range(replies)]
    answers: dict[str, list[list[int]]] = {}
    for name, make in engines.items():
        engine = make()
        answers[name] = []
        for question in questions:
            conversation = engine.conversation()
            list(conversation.send(question, max_new_tokens=160, do_sample=False, enable_thinking=True))
            answers[name].append(list(conversation.reply_ids))
    reference = answers[next(iter(engines))]
    return {name: {"identical": sum(a == b for a, b in zip(got, reference)) / replies,
                   "prefix_share": statistics.mean(_common(a, b) / max(len(b), 1) for a, b in zip(got, reference))}
            for name, got in answers.items()}


def _common(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
