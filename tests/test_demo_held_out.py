"""The demo's held-out phrasings and shapes (issue #22): the corpus never uses them, and the
evaluation of them runs on the committed model."""

import random
import re

from demo_model import corpus, held_out


def template_pattern(template: str) -> re.Pattern:
    """A held-out template as a pattern over any numbers."""
    return re.compile("^" + re.escape(template).replace(r"\{a\}", r"\d+").replace(r"\{b\}", r"\d+") + "$")


def test_no_held_out_phrasing_or_off_topic_line_is_in_the_corpus():
    """Every user line of 20,000 sampled training dialogues is matched against every held-out
    template and off-topic line: the figures are on words the model never saw."""
    patterns = [template_pattern(t) for forms in held_out.HELD_OUT_FORMS.values() for t in forms]
    assert all(not pattern.match(t.format(a=1, b=2)) for pattern in patterns
               for forms in corpus.QUESTION_FORMS.values() for t in forms)
    rng = random.Random(3)
    users = {turn.user for _ in range(20_000) for turn in corpus.sample_dialogue(rng).turns}
    assert len(users) > 1000
    assert not [user for user in users if any(pattern.match(user) for pattern in patterns)]
    assert not users & set(held_out.OFF_TOPIC)


def test_the_held_out_conversations_are_judged_against_the_true_results():
    made = held_out.conversations(random.Random(5), 9)
    assert {c.category for c in made} == {"standalone, first turn", "standalone, after earlier turns",
                                           "off-topic, after earlier turns"}
    for conversation in made:
        if conversation.value is None:
            assert conversation.turns[-1] in held_out.OFF_TOPIC and len(conversation.turns) >= 2
            assert held_out.judged(conversation, None, "Sorry, I only know arithmetic and a few phrases.")
            assert not held_out.judged(conversation, 72, "72 * 2 = 144.")
        else:
            numbers = [int(n) for n in re.findall(r"\d+", conversation.turns[-1])]
            a, b = numbers
            assert conversation.value in (a + b, a - b, b - a, a * b)  # "take b from a" names b first
            assert held_out.judged(conversation, conversation.value, "") and \
                not held_out.judged(conversation, conversation.value + 1, "")
