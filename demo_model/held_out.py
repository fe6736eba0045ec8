"""Conversations as a newcomer has them, in phrasings and shapes the corpus never uses.

`evaluate.py` holds out number pairs; this holds out *how people ask* as well:
- questions and follow-ups in (prefix, operation words) pairs the corpus never combines, and with
  prefixes it never uses at all (`corpus.phrasings(op, evaluation=True)`), in any case;
- off-topic lines about things whose words never occur in the corpus (a joke, the weather, ...);
- the judged turn at the first turn, after one to four earlier turns of any kind (sums,
  follow-ups, phrases, off-topic lines: a newcomer's order, not a script), and in conversations of
  nine or ten turns, longer than any the model was trained on (corpus.MAX_TURNS: eight).
tests/test_demo_held_out.py checks that none of it occurs in the corpus. Every number pair is held
out too. Each conversation runs live (the model answers every earlier turn), greedy and at the
model's own sampling settings with a Regenerate of the sampled last reply; the last reply is judged
against the true chain of results.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from demo_model import corpus

# lines off the model's topic: none of their words (`HELD_OUT_WORDS`) is in the corpus
OFF_TOPIC = ("tell me a joke", "What's the weather like today?", "who won the football match?",
             "Write me a poem about the sea.", "what is the capital of France?", "Do you like music?",
             "recommend a good book", "How do I cook rice?")
HELD_OUT_WORDS = ("joke", "weather", "football", "match", "won", "poem", "sea", "capital", "france", "music",
                  "recommend", "book", "cook", "rice")
# what the model says when it cannot help (its corpus's own lines, in their words)
DOES_NOT_KNOW = ("only know arithmetic", "only do sums")
CATEGORIES = ("standalone, first turn", "standalone, after earlier turns", "follow-up, after earlier turns",
              "off-topic, after earlier turns", "any, in a conversation longer than any trained")
# the judged turn of a long conversation
LONG_LAST = {"arithmetic": 40, "follow-up": 40, "off-topic": 20}


@dataclass(frozen=True)
class Conversation:
    """User turns to ask one after another; the last reply is judged: `value` (a number) or, when
    None, the model's "I only know arithmetic" line."""

    category: str
    turns: tuple[str, ...]
    value: int | None


def _earlier(rng: random.Random, count: int) -> corpus.Dialogue:
    """`count` turns of any kind, in held-out words and numbers; off-topic ones from OFF_TOPIC."""
    dialogue = corpus.Dialogue(None)
    while len(dialogue.turns) < count:
        kind, turn = corpus.next_turn(rng, dialogue, evaluation=True)
        dialogue.turns.append(_held_out_line(rng) if kind == "off-topic" else turn)
    return dialogue


def _held_out_line(rng: random.Random) -> corpus.Turn:
    return corpus.Turn(rng.choice(OFF_TOPIC), "", "", None)


def _judged(category: str, dialogue: corpus.Dialogue, kind: str, rng: random.Random) -> Conversation:
    if kind == "off-topic":
        turn = _held_out_line(rng)
    else:
        weights = {kind: 1, "arithmetic": 0} if kind == "follow-up" else {"arithmetic": 1}
        _, turn = corpus.next_turn(rng, dialogue, evaluation=True, weights=weights)
    turns = tuple(t.user for t in dialogue.turns) + (turn.user,)
    return Conversation(category, turns, turn.value)


def conversations(rng: random.Random, count: int) -> list[Conversation]:
    """`count` conversations of each category (CATEGORIES)."""
    made = []
    for index in range(count):
        made.append(_judged(CATEGORIES[0], corpus.Dialogue(None), "arithmetic", rng))
        made.append(_judged(CATEGORIES[1], _earlier(rng, 1 + index % 4), "arithmetic", rng))
        earlier = _earlier(rng, 1 + index % 4)
        while not earlier.values():  # a follow-up needs an answer to follow
            earlier = _earlier(rng, 1 + index % 4)
        made.append(_judged(CATEGORIES[2], earlier, "follow-up", rng))
        made.append(_judged(CATEGORIES[3], _earlier(rng, 1 + index % 4), "off-topic", rng))
        longer = _earlier(rng, corpus.MAX_TURNS + index % 2)
        kind = rng.choices(list(LONG_LAST), weights=list(LONG_LAST.values()))[0]
        while kind == "follow-up" and not longer.values():
            longer = _earlier(rng, corpus.MAX_TURNS + index % 2)
        made.append(_judged(CATEGORIES[4], longer, kind, rng))
    return made


def judged(conversation: Conversation, number: int | None, answer: str) -> bool:
    if conversation.value is None:
        return any(words in answer for words in DOES_NOT_KNOW)
    return number == conversation.value
