"""Conversations as a newcomer has them, in phrasings and shapes the corpus never uses (issue #22).

`evaluate.py` holds out number pairs; this holds out *how people ask*: other words for each
operation ("the sum of", "take … from", "multiplied by", "×"), other case and punctuation, a
new standalone question after earlier turns, and off-topic lines in the middle of a sum
conversation. None of these templates may enter the corpus (`tests/test_benchmark_smoke.py`
checks it), so the figures say how the model does on what it never saw. Each conversation runs
greedy and at the model's own sampling settings, with a Regenerate of the sampled last reply.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from demo_model.corpus import Problem, first_problem, question_text

# other words for each operation: never in corpus.QUESTION_FORMS
HELD_OUT_FORMS = {
    "+": ("what's {a} plus {b}", "Compute {a} + {b}.", "the sum of {a} and {b}?", "ADD {a} TO {b}",
          "can you add {a} to {b}?", "{a} and {b} added together?"),
    "-": ("take {b} from {a}", "Subtract {b} from {a}.", "what is {a} less {b}", "{a} take away {b}?",
          "WHAT IS {a} MINUS {b}"),
    "*": ("{a} × {b}?", "{a} multiplied by {b}", "what's {a} times {b}", "the product of {a} and {b}?",
          "Compute {a} * {b}."),
}
# lines off the model's topic, asked in the middle of a conversation: never in the corpus
OFF_TOPIC = ("tell me a joke", "What's the weather like today?", "who won the football match?",
             "Write me a poem about the sea.", "what is the capital of France?", "Do you like music?",
             "recommend a good book", "How do I cook rice?")
# what the model says when it cannot help (its corpus's own lines, in their words)
DOES_NOT_KNOW = ("only know arithmetic", "only do sums")


@dataclass(frozen=True)
class Conversation:
    """User turns to ask one after another; the last reply is judged: `value` (a number) or, when
    None, the model's "I only know arithmetic" line."""

    category: str
    turns: tuple[str, ...]
    value: int | None


def held_out_question(rng: random.Random, problem: Problem) -> str:
    return rng.choice(HELD_OUT_FORMS[problem.op]).format(a=problem.a, b=problem.b)


def conversations(rng: random.Random, count: int) -> list[Conversation]:
    """`count` of each shape: a held-out phrasing first; a held-out phrasing after one to three
    earlier sums (asked the corpus's way); an off-topic line after one or two sums."""
    made = []
    for index in range(count):
        problem = first_problem(rng, evaluation=True)
        made.append(Conversation("standalone, first turn", (held_out_question(rng, problem),), problem.result))
        earlier = tuple(question_text(rng, first_problem(rng, evaluation=True)) for _ in range(1 + index % 3))
        problem = first_problem(rng, evaluation=True)
        made.append(Conversation("standalone, after earlier turns", (*earlier, held_out_question(rng, problem)),
                                 problem.result))
        earlier = tuple(question_text(rng, first_problem(rng, evaluation=True)) for _ in range(1 + index % 2))
        made.append(Conversation("off-topic, after earlier turns", (*earlier, rng.choice(OFF_TOPIC)), None))
    return made


def judged(conversation: Conversation, number: int | None, answer: str) -> bool:
    if conversation.value is None:
        return any(words in answer for words in DOES_NOT_KNOW)
    return number == conversation.value
