"""Issue check 5: every refused operation leaves messages, ledger and cache exactly as they were."""

import gc

import pytest
import torch

from conftest import on_model_input
from chat import (
    ChatError,
    ContextOverflowError,
    ConversationBusyError,
    EmptyMessageError,
    InvalidOptionError,
    StalePlanError,
    UnknownOptionError,
    NothingToRegenerateError,
    NothingToUndoError,
    NotAUserMessageError,
)
from chat.errors import ConversationError

OPTIONS = dict(max_new_tokens=6, do_sample=False)


def snapshot(conv):
    session = conv.session
    return (
        conv.messages,
        conv.reply_ids,
        list(session.token_ids),
        [tensor.clone() for tensor in session.tensors()],
        session.checkpoints.positions(),
    )


def assert_unchanged(conv, before):
    after = snapshot(conv)
    assert after[0] == before[0]
    assert after[1] == before[1]
    assert after[2] == before[2]
    assert len(after[3]) == len(before[3]) and all(torch.equal(a, b) for a, b in zip(after[3], before[3]))
    assert after[4] == before[4]


@pytest.fixture(params=["full", "hybrid"])
def conv(request, make_engine):
    conv = make_engine(request.param).conversation("System prompt.")
    list(conv.send("A first question?", **OPTIONS))
    list(conv.send("A second question?", **OPTIONS))
    return conv


CASES = {
    "empty": (EmptyMessageError, lambda c: c.send("", **OPTIONS)),
    "whitespace": (EmptyMessageError, lambda c: c.send("  \n\t ", **OPTIONS)),
    "not text": (ConversationError, lambda c: c.send(None, **OPTIONS)),
    "edit the system prompt": (NotAUserMessageError, lambda c: c.edit(0, "new", **OPTIONS)),
    "edit a reply": (NotAUserMessageError, lambda c: c.edit(2, "new", **OPTIONS)),
    "edit out of range": (NotAUserMessageError, lambda c: c.edit(99, "new", **OPTIONS)),
    "edit negative": (NotAUserMessageError, lambda c: c.edit(-1, "new", **OPTIONS)),
    "edit to empty": (EmptyMessageError, lambda c: c.edit(1, " ", **OPTIONS)),
    "too long for the context": (ContextOverflowError, lambda c: c.send("cache " * 3000, **OPTIONS)),
    "max_new_tokens past the context": (ContextOverflowError, lambda c: c.send("hi", max_new_tokens=10_000)),
    "bad temperature": (InvalidOptionError, lambda c: c.send("hi", max_new_tokens=4, temperature=0)),
    "zero max_new_tokens": (InvalidOptionError, lambda c: c.send("hi", max_new_tokens=0)),
    "unknown option": (UnknownOptionError, lambda c: c.send("hi", max_tokens=4)),
}


@pytest.mark.parametrize("case", CASES)
def test_refused_operation_changes_nothing(conv, case):
    error, operation = CASES[case]
    before = snapshot(conv)
    with pytest.raises(error) as raised:
        operation(conv)  # raised eagerly, before any stream is iterated
    assert isinstance(raised.value, ChatError)  # the one family a UI catches
    assert_unchanged(conv, before)
    list(conv.send("Still works?", **OPTIONS))  # and the conversation goes on
    assert conv.messages[-2]["content"] == "Still works?"


def test_a_refused_edit_names_what_the_message_is_in_words(conv):
    """It said "message 2 is a assistant message"."""
    list(conv.send("Hello?", **OPTIONS))
    with pytest.raises(NotAUserMessageError, match="message 2 is a reply, not a user message"):
        conv.edit(2, "new", **OPTIONS)
    with pytest.raises(NotAUserMessageError, match="message 0 is the system prompt, not a user message"):
        conv.edit(0, "new", **OPTIONS)


def test_nothing_to_act_on(make_engine):
    conv = make_engine("full").conversation("System prompt.")
    before = snapshot(conv)
    with pytest.raises(NothingToRegenerateError):
        conv.regenerate(**OPTIONS)
    with pytest.raises(NothingToUndoError):
        conv.undo()
    assert_unchanged(conv, before)


@pytest.mark.parametrize("read_first", [True, False])
def test_second_operation_while_streaming_is_refused(conv, read_first):
    """Refused from the moment the reply is started, not only once its stream is read: a second
    Send in that moment replaced the running reply."""
    stream = conv.send("A long answer please.", max_new_tokens=20, do_sample=False)
    if read_first:
        next(stream)
    for operation in (lambda: conv.send("again", **OPTIONS), lambda: conv.regenerate(**OPTIONS), conv.undo,
                      lambda: conv.edit(1, "x", **OPTIONS), lambda: conv.switch_branch(1, 0)):
        with pytest.raises(ConversationBusyError):
            operation()
    list(stream)
    assert conv.messages[-2]["content"] == "A long answer please."
    assert conv.messages[-1]["role"] == "assistant" and not conv.stats.stopped


def test_stale_plan_is_refused(conv):
    """A plan overtaken by another operation before it runs must not run on the new history."""
    from chat.dialogue.operations import Send
    from chat.dialogue.options import GenerationOptions

    plan = conv.plan(Send("planned first"), GenerationOptions.from_kwargs(**OPTIONS))
    conv.undo()
    before = snapshot(conv)
    with pytest.raises(StalePlanError):
        next(conv.run(plan))
    assert_unchanged(conv, before)


def test_a_reply_started_and_dropped_unread_leaves_the_conversation_free(conv):
    stream = conv.send("never read", **OPTIONS)
    assert conv.is_busy
    del stream  # (a client gone before the first token)
    gc.collect()
    assert not conv.is_busy
    list(conv.send("read", **OPTIONS))
    assert conv.messages[-2]["content"] == "read"


def test_model_failure_leaves_history_and_rebuilds(conv, monkeypatch):
    before_messages = conv.messages

    def broken_forward(*args, **kwargs):
        raise RuntimeError("device lost")

    on_model_input(conv.source.runtime.model, monkeypatch, broken_forward)  # every step, however it runs
    with pytest.raises(RuntimeError, match="device lost"):
        list(conv.send("This one fails.", **OPTIONS))
    assert conv.messages == before_messages
    assert conv.session.token_ids == [] and conv.session.cache.get_seq_length() == 0
    monkeypatch.undo()
    list(conv.send("This one works.", **OPTIONS))
    assert conv.stats.rebuilt
