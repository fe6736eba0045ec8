"""Issue check 2: random operation sequences keep the session exact (hypothesis)."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chat import ChatEngine, ConversationError
from conftest import PLAIN_TEMPLATE, THINKING_TEMPLATE
from reference import check_exact
from tiny_models import ARCHS

MAX_NEW = 6
WORDS = ["hello", "cache", "two", "plus", "roll", "back", "why", "é", "漢字", "<b>", "\n", "  "]

texts = st.lists(st.sampled_from(WORDS), min_size=0, max_size=6).map(" ".join)
operations = st.lists(
    st.one_of(
        st.tuples(st.just("send"), texts),
        st.tuples(st.just("send_stop"), texts),
        st.tuples(st.just("regenerate"), st.none()),
        st.tuples(st.just("regenerate_stop"), st.none()),
        st.tuples(st.just("undo"), st.none()),
        st.tuples(st.just("edit"), st.tuples(st.integers(0, 8), texts)),
        st.tuples(st.just("continue"), st.none()),
        st.tuples(st.just("continue_stop"), st.none()),
        st.tuples(st.just("select_version"), st.integers(0, 3)),
    ),
    min_size=1,
    max_size=6,
)


def run_stream(conv, stream, stop: bool) -> None:
    for _ in stream:
        if stop:
            conv.stop()


@pytest.mark.parametrize("template", [THINKING_TEMPLATE, PLAIN_TEMPLATE])
@pytest.mark.parametrize("arch", ARCHS)
@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=operations, max_checkpoints=st.sampled_from([0, 1, 16]))
def test_random_operation_sequences_stay_exact(models, tokenizers, arch, template, ops, max_checkpoints):
    model, tokenizer = models[arch], tokenizers[template]
    conv = ChatEngine(model, tokenizer, max_checkpoints=max_checkpoints).conversation("Be brief.")
    options = dict(max_new_tokens=MAX_NEW, do_sample=False)
    # Every greedy reply is a prefix of the greedy sequence from its prompt: a full fresh reply is
    # all of MAX_NEW tokens, a stopped, continued or switched-to one is a prefix of some length.
    exact_length: dict[int, bool] = {}  # message index -> reply must equal greedy of MAX_NEW tokens
    ended_by_eos: dict[int, bool] = {}
    for name, argument in ops:
        before = (conv.messages, list(conv.session.token_ids))
        last = len(conv.messages) - 1
        reply_before = len(conv.reply_ids)
        try:
            if name in ("send", "send_stop"):
                run_stream(conv, conv.send(argument, **options), stop=name == "send_stop")
            elif name in ("regenerate", "regenerate_stop"):
                run_stream(conv, conv.regenerate(**options), stop=name == "regenerate_stop")
            elif name in ("continue", "continue_stop"):
                if ended_by_eos.get(last):
                    continue  # after an end-of-turn token, greedy from scratch would not go on
                run_stream(conv, conv.continue_reply(**options), stop=name == "continue_stop")
            elif name == "select_version":
                conv.select_version(argument)
            elif name == "undo":
                conv.undo()
            else:
                index, text = argument
                run_stream(conv, conv.edit(index, text, **options), stop=False)
        except ConversationError:
            assert (conv.messages, conv.session.token_ids) == before
            continue
        length = len(conv.messages)
        exact_length = {i: flag for i, flag in exact_length.items() if i < length}
        ended_by_eos = {i: flag for i, flag in ended_by_eos.items() if i < length}
        generated = name not in ("undo", "select_version")
        if generated:
            fresh = name in ("send", "regenerate", "edit") and not conv.stats.stopped
            exact_length[length - 1] = fresh
            grown = len(conv.reply_ids) - (reply_before if name.startswith("continue") else 0)
            ended_by_eos[length - 1] = conv.stats.generated_tokens > grown  # the end token is not kept
        elif name == "select_version":
            exact_length[length - 1] = False
        check_exact(conv, model, tokenizer, max_new_tokens=MAX_NEW if exact_length.get(length - 1) else None,
                    generated=generated, stopped=not exact_length.get(length - 1, False),
                    continued_from=reply_before if name.startswith("continue") else 0)
