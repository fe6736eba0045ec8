"""The demo's held-out phrasings and shapes: the corpus never asks that way, and the
evaluation's conversations are judged against the true results."""

import random
import re

from demo_model import corpus, held_out


def normalized(line: str) -> str:
    """A user line up to its numbers, case and final punctuation: how it is asked."""
    return re.sub(r"\d+", "#", line.lower()).rstrip(" ?.!")


def training_lines(count: int) -> set[str]:
    rng = random.Random(3)
    return {turn.user for _ in range(count) for turn in corpus.sample_dialogue(rng).turns}


def test_no_held_out_phrasing_or_off_topic_word_is_in_the_corpus():
    """Every user line of 20,000 sampled training dialogues, against every judged line of the
    evaluation: no way of asking is shared, in any case or punctuation, and no word of an
    off-topic line is ever in the corpus."""
    users = training_lines(20_000)
    asked = {normalized(line) for line in users}
    assert len(asked) > 2_000
    made = held_out.conversations(random.Random(11), 200)
    judged = [c.turns[-1] for c in made if c.value is not None]
    assert len(judged) > 500
    shared = [line for line in judged if normalized(line) in asked]
    assert not shared, shared[:5]
    words = {word for line in users for word in re.findall(r"[a-z]+", line.lower())}
    assert not words & set(held_out.HELD_OUT_WORDS)
    assert all(set(re.findall(r"[a-z]+", line.lower())) & set(held_out.HELD_OUT_WORDS) for line in held_out.OFF_TOPIC)


def test_the_held_out_phrasings_are_made_of_parts_the_corpus_uses():
    """A held-out question combines a prefix and operation words the corpus has each seen with
    other partners (besides a few prefixes it never uses): a test of composing, not of new words."""
    new = set(corpus.NEW_NOUN_PREFIXES + corpus.NEW_VERB_PREFIXES)
    trained_prefixes, held_prefixes = set(), set()
    for op in "+-*":
        trained, held = corpus.phrasings(op), corpus.phrasings(op, evaluation=True)
        assert not set(trained) & set(held) and len(held) >= len(trained) // 3
        assert {core for _, core in held} <= {core for _, core in trained}
        trained_prefixes |= {prefix for prefix, _ in trained}
        held_prefixes |= {prefix for prefix, _ in held}
    assert held_prefixes - new <= trained_prefixes
    for kind in corpus.FOLLOW_UP_CORES:
        trained, held = corpus.follow_up_phrasings(kind), corpus.follow_up_phrasings(kind, evaluation=True)
        assert not set(trained) & set(held) and held
        assert {core for _, core in held} <= {core for _, core in trained}


def test_the_corpus_mixes_conversation_shapes():
    """A new question after earlier turns, follow-ups, phrases and off-topic lines in the middle."""
    rng = random.Random(4)
    dialogues = [corpus.sample_dialogue(rng) for _ in range(3_000)]
    later = [d for d in dialogues if len(d.turns) > 1]
    kinds = {d.kind for d in later}
    assert kinds == {"arithmetic", "follow-up", "fact", "chat", "off-topic"}
    assert sum(d.kind == "arithmetic" for d in later) > 0.25 * len(later)
    assert max(len(d.turns) for d in dialogues) == corpus.MAX_TURNS  # held_out's long conversations are longer


def test_the_held_out_conversations_are_judged_against_the_true_results():
    made = held_out.conversations(random.Random(5), 12)
    assert {c.category for c in made} == set(held_out.CATEGORIES)
    assert min(len(c.turns) for c in made if c.category == held_out.CATEGORIES[4]) == corpus.MAX_TURNS + 1
    for conversation in made:
        if conversation.value is None:
            assert conversation.turns[-1] in held_out.OFF_TOPIC
            assert held_out.judged(conversation, None, "Sorry, I only know arithmetic and a few phrases.")
            assert not held_out.judged(conversation, 72, "72 * 2 = 144.")
        else:
            assert held_out.judged(conversation, conversation.value, "") and \
                not held_out.judged(conversation, conversation.value + 1, "")
        if conversation.category.startswith("standalone"):
            a, b = (int(n) for n in re.findall(r"\d+", conversation.turns[-1]))
            assert conversation.value in (a + b, a - b, b - a, a * b)  # "take b from a" names b first


def test_a_follow_up_is_judged_on_the_chain_of_true_results():
    """A follow-up's value is computed from the earlier turns' true answers."""
    rng = random.Random(8)
    first = corpus.Problem("+", 40, 5)
    for _ in range(200):
        turn = corpus.follow_up(rng, first, 45, 45, evaluation=True)
        numbers = [int(n) for n in re.findall(r"\d+", turn.user)]
        assert turn.value in {45, 40, 5} or (numbers and turn.value in (45 + numbers[0], 45 - numbers[0],
                                                                          45 * numbers[0])) or turn.value == 90
