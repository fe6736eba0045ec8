"""Branch off into a new chat: a new conversation of a path of another, whose cache
starts from a copy of the other's. Its replies are those of the same path restored from saved
data (no cache), on every layer mix, and its first turn computes only what it does not share."""

from __future__ import annotations

import pytest

from chat.dialogue import saved
from conftest import ARCHS, THINKING_TEMPLATE
from reference import check_exact

GREEDY = dict(max_new_tokens=8, do_sample=False)


def two_turns(engine):
    conversation = engine.conversation("You are terse.")
    list(conversation.send("What is 4 + 4?", **GREEDY))
    list(conversation.send("And 5 + 5?", **GREEDY))
    return conversation


def up_to(conversation, index: int) -> dict:
    data = conversation.snapshot()
    return saved.path_only({**data, "path": data["path"][: index + 1]})


@pytest.mark.parametrize("arch", ARCHS)
def test_a_branch_replies_as_the_same_path_restored_and_reuses_the_cache(make_engine, models, tokenizers, arch):
    engine = make_engine(arch)
    source = two_turns(engine)
    first_reply = 2  # system, user, assistant: the branch keeps the first turn
    branch = engine.branch_off(source, up_to(source, first_reply))
    restored = engine.restore(up_to(source, first_reply))
    assert [m["content"] for m in branch.messages] == [m["content"] for m in source.messages[:3]]
    for conversation in (branch, restored):
        list(conversation.send("Now 6 + 6?", **GREEDY))
    assert branch.messages[-1] == restored.messages[-1]
    # its cache holds what a forward over its ledger gives, its reply is greedy from scratch
    check_exact(branch, models[arch], tokenizers[THINKING_TEMPLATE], max_new_tokens=8)
    assert restored.stats.rebuilt  # (it reuses the shared system prompt's prefix only)
    if arch == "full":  # cropped to what it shares: only the new message and what parts is computed
        assert not branch.stats.rebuilt and branch.stats.reused_tokens > restored.stats.reused_tokens
        assert branch.stats.reused_tokens > branch.stats.prompt_tokens // 2
    assert source.messages[-1]["content"] and len(source.messages) == 5  # the source is untouched
    list(source.send("And 7 + 7?", **GREEDY))
    check_exact(source, models[arch], tokenizers[THINKING_TEMPLATE], max_new_tokens=8)


def test_a_branch_off_a_source_running_a_reply_copies_nothing(make_engine, models, tokenizers):
    engine = make_engine("full")
    source = two_turns(engine)
    stream = source.send("Tell me more", max_new_tokens=200, do_sample=False)
    next(stream)  # running
    branch = engine.branch_off(source, up_to(source, 2))
    stream.close()
    list(branch.send("Now 6 + 6?", **GREEDY))
    assert branch.stats.rebuilt
    check_exact(branch, models["full"], tokenizers[THINKING_TEMPLATE], max_new_tokens=8)
