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
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=operations, max_checkpoints=st.sampled_from([0, 1, 16]))
def test_random_operation_sequences_stay_exact(models, tokenizers, arch, template, ops, max_checkpoints):
    model, tokenizer = models[arch], tokenizers[template]
    conv = ChatEngine(model, tokenizer, max_checkpoints=max_checkpoints).conversation("Be brief.")
    options = dict(max_new_tokens=MAX_NEW, do_sample=False)
    stopped_at: dict[int, bool] = {}  # message index -> that reply was cut short
    for name, argument in ops:
        before = (conv.messages, list(conv.session.token_ids))
        try:
            if name in ("send", "send_stop"):
                run_stream(conv, conv.send(argument, **options), stop=name == "send_stop")
            elif name in ("regenerate", "regenerate_stop"):
                run_stream(conv, conv.regenerate(**options), stop=name == "regenerate_stop")
            elif name == "undo":
                conv.undo()
            else:
                index, text = argument
                run_stream(conv, conv.edit(index, text, **options), stop=False)
        except ConversationError:
            assert (conv.messages, conv.session.token_ids) == before
            continue
        length = len(conv.messages)
        stopped_at = {i: flag for i, flag in stopped_at.items() if i < length}
        if name != "undo":
            stopped_at[length - 1] = conv.stats.stopped
        check_exact(conv, model, tokenizer, max_new_tokens=MAX_NEW, generated=name != "undo",
                    stopped=stopped_at.get(length - 1, False))
