"""The branch tree: edits, regenerations, hand-edited replies and system prompts add
siblings; switching puts a branch's cache states back without a forward pass; the cache stays
exact against a from-scratch forward after any sequence; saved data round-trips and bad data
is refused."""

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chat import ConversationError, SavedConversationError
from chat.dialogue.history import MAX_NODES, MAX_SIBLINGS
from chat.dialogue.saved import MAX_DEPTH, MAX_MESSAGE_CHARS
from conftest import PLAIN_TEMPLATE, THINKING_TEMPLATE, count_forwards
from reference import (LOGIT_TOLERANCE, cached_vs_scratch_logit_error, check_exact, render_ids,
                       scratch_greedy_reply)
from tiny_models import ARCHS

MAX_NEW = 6
GREEDY = dict(max_new_tokens=MAX_NEW, do_sample=False)


def cache_is_exact(conv, model) -> None:
    if conv.session.token_ids:
        assert cached_vs_scratch_logit_error(model, conv.session.cache, conv.session.token_ids, 7) < LOGIT_TOLERANCE


@pytest.mark.parametrize("arch", ARCHS)
def test_edit_and_regenerate_an_earlier_message_keep_the_old_branch_and_switch_back_for_free(
        make_engine, models, tokenizers, arch, monkeypatch):
    model, tokenizer = models[arch], tokenizers[THINKING_TEMPLATE]
    conv = make_engine(arch).conversation("Be brief.")
    list(conv.send("First question?", **GREEDY))
    list(conv.send("Second question?", **GREEDY))
    original = conv.messages
    assert [conv.branches(i) for i in range(len(original))] == [(0, 1)] * 5

    list(conv.edit(1, "A different first question?", **GREEDY))  # a new branch at message 1
    check_exact(conv, model, tokenizer, max_new_tokens=MAX_NEW)
    edited = conv.messages
    assert len(edited) == 3 and edited[1]["content"] == "A different first question?"
    assert conv.branches(1) == (1, 2) and conv.branches(2) == (0, 1)

    forwards = count_forwards(model, monkeypatch)
    assert conv.switch_branch(1, 0) is True  # the old branch, with everything below it
    assert conv.messages == original and forwards == []
    assert conv.switch_branch(1, 1) is True and conv.messages == edited and forwards == []
    assert conv.switch_branch(1, 0) is True and forwards == []
    monkeypatch.undo()
    check_exact(conv, model, tokenizer, max_new_tokens=MAX_NEW, generated=False)  # the shown reply is greedy

    list(conv.regenerate(2, max_new_tokens=MAX_NEW, do_sample=True, seed=3))  # the first reply, mid-conversation
    assert len(conv.messages) == 3 and conv.branches(2) == (1, 2) and conv.branches(1) == (0, 2)
    cache_is_exact(conv, model)
    assert conv.switch_branch(2, 0) is True and conv.messages == original
    list(conv.send("Third question?", **GREEDY))  # goes on from the restored branch, exactly
    check_exact(conv, model, tokenizer, max_new_tokens=MAX_NEW)
    assert conv.stats.reused_tokens > len(render_ids(tokenizer, original[:3]))  # the restored states were used


@pytest.mark.parametrize("arch", ["full", "hybrid"])
def test_a_switch_to_a_branch_whose_states_were_freed_prefills_only_from_the_fork(make_engine, models, tokenizers,
                                                                                  arch):
    model, tokenizer = models[arch], tokenizers[THINKING_TEMPLATE]
    conv = make_engine(arch).conversation("Be brief.")
    list(conv.send("First question?", **GREEDY))
    list(conv.send("Second question?", **GREEDY))
    list(conv.edit(3, "Another second question?", **GREEDY))
    edited = conv.messages
    while conv.session.drop_oldest_segment():  # what the budget does under pressure
        pass
    assert conv.switch_branch(3, 0) is False  # shown, but its states are gone
    list(conv.send("Third?", **GREEDY))
    check_exact(conv, model, tokenizer, max_new_tokens=MAX_NEW)
    # the cache held the edited branch: the prompt is computed from where the two branches' tokens part
    held, prompt = render_ids(tokenizer, edited[:4]), render_ids(tokenizer, conv.messages[:-1])
    fork = next(i for i, (a, b) in enumerate(zip(held, prompt)) if a != b)
    assert conv.stats.reused_tokens >= fork and conv.stats.prefilled_tokens <= len(prompt) - fork
    assert not conv.stats.rebuilt


@pytest.mark.parametrize("template", [THINKING_TEMPLATE, PLAIN_TEMPLATE])
def test_an_edited_reply_is_a_sibling_and_the_conversation_goes_on_from_its_text(make_engine, models, tokenizers,
                                                                                 template):
    model, tokenizer = models["full"], tokenizers[template]
    conv = make_engine("full", template).conversation()
    list(conv.send("Say something.", **GREEDY))
    generated = conv.messages[-1]
    conv.edit_reply(1, "The answer is 42")
    assert conv.messages[-1]["content"] == "The answer is 42" and conv.branches(1) == (1, 2)
    # Continue goes on from the edited text as the template renders it, left open
    list(conv.continue_reply(**GREEDY))
    text = tokenizer.apply_chat_template(
        [conv.messages[0], {"role": "assistant", "content": "The answer is 42"}], tokenize=False,
        continue_final_message=True)
    prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert conv.messages[-1]["content"].startswith("The answer is 42")
    greedy = scratch_greedy_reply(model, prompt, MAX_NEW, {tokenizer.convert_tokens_to_ids("<|im_end|>")})
    assert tokenizer.decode(greedy) in conv.messages[-1]["content"]
    cache_is_exact(conv, model)
    list(conv.send("And then?", **GREEDY))
    check_exact(conv, model, tokenizer, max_new_tokens=MAX_NEW)
    assert conv.switch_branch(1, 0) is True and conv.messages[-1] == generated
    with pytest.raises(ConversationError):
        conv.edit_reply(0, "not a reply")
    with pytest.raises(ConversationError):
        conv.edit_reply(1, "   ")


def test_a_new_system_prompt_is_a_branch_at_the_root(make_engine, models, tokenizers, monkeypatch):
    model, tokenizer = models["sliding"], tokenizers[THINKING_TEMPLATE]
    conv = make_engine("sliding").conversation("Be brief.")
    list(conv.send("Hello?", **GREEDY))
    first = conv.messages
    assert conv.set_system_prompt("Be brief.") is False  # unchanged: nothing happens
    assert conv.set_system_prompt("Be verbose.") is True
    assert conv.messages == [{"role": "system", "content": "Be verbose."}] and conv.system_prompt == "Be verbose."
    list(conv.send("Hello?", **GREEDY))
    check_exact(conv, model, tokenizer, max_new_tokens=MAX_NEW)
    assert conv.branches(0) == (1, 2)
    forwards = count_forwards(model, monkeypatch)
    assert conv.switch_branch(0, 0) is True and conv.messages == first and forwards == []
    monkeypatch.undo()
    assert conv.set_system_prompt(None) is True and conv.messages == []
    list(conv.send("No system prompt now.", **GREEDY))
    check_exact(conv, model, tokenizer, max_new_tokens=MAX_NEW)
    assert conv.branches(0) == (2, 3) and conv.system_prompt is None


@pytest.mark.parametrize("arch", ARCHS)
def test_undo_keeps_the_undone_turn_as_a_branch(make_engine, models, tokenizers, arch, monkeypatch):
    model, tokenizer = models[arch], tokenizers[PLAIN_TEMPLATE]
    conv = make_engine(arch, PLAIN_TEMPLATE).conversation()
    list(conv.send("One?", **GREEDY))
    list(conv.send("Two?", **GREEDY))
    both = conv.messages
    conv.undo()
    assert conv.messages == both[:2]
    list(conv.send("Two, differently?", **GREEDY))
    check_exact(conv, model, tokenizer, max_new_tokens=MAX_NEW)
    assert conv.branches(2) == (1, 2)
    forwards = count_forwards(model, monkeypatch)
    assert conv.switch_branch(2, 0) is True and conv.messages == both and forwards == []


def test_limits_refuse_with_nothing_changed(make_engine):
    conv = make_engine("full").conversation()
    list(conv.send("Hi", max_new_tokens=1, do_sample=False))
    for _ in range(MAX_SIBLINGS - 1):
        conv.edit_reply(1, "x")
    before = conv.to_dict()
    with pytest.raises(ConversationError, match="versions"):
        conv.regenerate(max_new_tokens=1)
    with pytest.raises(ConversationError, match="versions"):
        conv.edit_reply(1, "y")
    assert conv.to_dict() == before
    for bad in (-1, 2, "0", True, None):
        with pytest.raises(ConversationError):
            conv.switch_branch(bad, 0)
        with pytest.raises(ConversationError):
            conv.switch_branch(1, bad if bad != 2 else MAX_SIBLINGS)
    assert conv.to_dict() == before


# ---- kept branch states and the memory budget ------------------------------------------------------


def test_kept_branches_are_freed_first_under_the_budget_oldest_first(make_engine):
    engine = make_engine("full")
    convs = [engine.conversation("Be brief.") for _ in range(2)]
    for conv in convs:
        list(conv.send("A question?", **GREEDY))
        for _ in range(2):
            list(conv.regenerate(max_new_tokens=MAX_NEW, do_sample=True))
    assert [c.session.segment_count() for c in convs] == [2, 2]
    caches = engine.caches
    oldest = convs[0].session.oldest_segment_age()
    total, one_segment = caches.stats().cache_bytes, convs[0].session.nbytes()
    caches.budget_bytes = total - 1  # one segment over
    caches.enforce_budget()
    assert caches.stats().evictions == 0  # no conversation released: a kept branch went instead
    assert sorted(c.session.segment_count() for c in convs) == [1, 2] and caches.stats().segments_freed == 1
    assert convs[0].session.oldest_segment_age() != oldest  # the oldest of all went first
    caches.budget_bytes = total - one_segment  # more than all the segments
    caches.enforce_budget()
    assert [c.session.segment_count() for c in convs] == [0, 0] and caches.stats().segments_freed == 4
    assert sum(1 for c in convs if c.session.token_ids) >= 1


# ---- saved conversations ---------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["full", "mixed"])
def test_to_dict_json_restore_round_trips_and_goes_on_exactly(make_engine, models, tokenizers, arch):
    model, tokenizer = models[arch], tokenizers[THINKING_TEMPLATE]
    engine = make_engine(arch)
    conv = engine.conversation("Be brief.")
    list(conv.send("One?", **GREEDY))
    list(conv.send("Two?", **GREEDY))
    list(conv.edit(1, "One, again?", **GREEDY))
    conv.edit_reply(2, "Edited.")
    conv.switch_branch(1, 0)
    data = json.loads(json.dumps(conv.to_dict()))
    restored = engine.restore(data)
    assert restored.to_dict() == conv.to_dict() and restored.messages == conv.messages
    assert [restored.branches(i) for i in range(5)] == [conv.branches(i) for i in range(5)]
    assert restored.switch_branch(1, 1) is False  # no states yet: the next turn computes them
    assert restored.messages[-1]["content"] == "Edited." and restored.branches(2) == (1, 2)
    list(restored.send("Three?", **GREEDY))
    check_exact(restored, model, tokenizer, max_new_tokens=MAX_NEW)
    assert restored.stats.reused_tokens == restored.stats.shared_prefix_tokens  # only the shared system prompt


def saved_chain(length: int) -> dict:
    messages = [{"parent": i - 1 if i else None, "role": "user" if i % 2 == 0 else "assistant", "content": "x",
                 "shown": 0 if i < length - 1 else None} for i in range(length)]
    return {"format": "rewind-chat.conversation", "version": 1, "messages": messages, "shown": 0}


def test_malformed_and_oversized_saved_data_is_refused_naming_the_problem(make_engine):
    engine = make_engine("full")
    assert engine.restore(saved_chain(4)).messages[-1]["role"] == "assistant"
    cases = {
        "expected an object": [],
        "format": {**saved_chain(2), "format": "other"},
        "version": {**saved_chain(2), "version": 2},
        "unknown field": {**saved_chain(2), "extra": 1},
        "messages must be a list": {**saved_chain(2), "messages": {}},
        "more than the": saved_chain(MAX_NODES + 1),
        "deep": saved_chain(MAX_DEPTH + 1),
        "role must be": {**saved_chain(2), "messages": [{"parent": None, "role": "tool", "content": "x"}]},
        "under a user": {**saved_chain(2), "messages": [{"parent": None, "role": "user", "content": "x"},
                                                        {"parent": 0, "role": "user", "content": "x"}]},
        "earlier message": {**saved_chain(2), "messages": [{"parent": 0, "role": "user", "content": "x"}]},
        "must be text": {**saved_chain(1), "messages": [{"parent": None, "role": "user", "content": 5}]},
        "longer than": {**saved_chain(1), "messages": [{"parent": None, "role": "user",
                                                        "content": "x" * (MAX_MESSAGE_CHARS + 1)}]},
        "lone surrogate": {**saved_chain(1), "messages": [{"parent": None, "role": "user", "content": "\ud800"}]},
        "is empty": {**saved_chain(1), "messages": [{"parent": None, "role": "user", "content": " "}]},
        "branches at one message": {**saved_chain(1), "messages": [{"parent": None, "role": "user", "content": "x"}]
                                    * (MAX_SIBLINGS + 1)},
        "shown must be": {**saved_chain(2), "shown": 3},
        "path does not": {**saved_chain(2), "path": [1]},
        "system_prompt differs": {**saved_chain(2), "system_prompt": "s"},
        "true or false": {**saved_chain(2), "messages": [{"parent": None, "role": "user", "content": "x"},
                                                         {"parent": 0, "role": "assistant", "content": "y",
                                                          "stopped": "no"}]},
    }
    for expected, data in cases.items():
        with pytest.raises(SavedConversationError, match=expected):
            engine.restore(data)


json_values = st.recursive(st.none() | st.booleans() | st.integers(-3, 5) | st.text(max_size=4),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                       max_size=3), max_leaves=6)


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(message=st.integers(0, 5), field=st.sampled_from(["parent", "role", "content", "shown", "reasoning_content",
                                                         "stopped", "edited", "other"]),
       value=json_values, top=st.sampled_from([None, "shown", "path", "system_prompt", "format", "version"]))
def test_fuzzed_saved_data_is_either_a_valid_conversation_or_a_named_refusal(make_engine, message, field, value, top):
    engine = make_engine("full")
    data = saved_chain(6)
    data["messages"][message][field] = value
    if top is not None:
        data[top] = value
    try:
        conv = engine.restore(json.loads(json.dumps(data)))
    except SavedConversationError as error:
        assert str(error).startswith("saved conversation: ")
        return
    assert json.loads(json.dumps(conv.to_dict()))["messages"]  # what was accepted is a whole conversation again
    assert engine.restore(conv.to_dict()).to_dict() == conv.to_dict()


# ---- any sequence stays exact ---------------------------------------------------------------------

WORDS = ["hello", "cache", "two", "why", "é", "漢字", "\n"]
texts = st.lists(st.sampled_from(WORDS), min_size=1, max_size=4).map(" ".join)
tree_operations = st.lists(
    st.one_of(
        st.tuples(st.just("send"), texts),
        st.tuples(st.just("send_stop"), texts),
        st.tuples(st.just("regenerate"), st.integers(0, 8)),
        st.tuples(st.just("edit"), st.tuples(st.integers(0, 8), texts)),
        st.tuples(st.just("edit_reply"), st.tuples(st.integers(0, 8), texts)),
        st.tuples(st.just("switch"), st.integers(0, 20)),
        st.tuples(st.just("switch"), st.integers(0, 20)),
        st.tuples(st.just("undo"), st.none()),
    ),
    min_size=2,
    max_size=7,
)


@pytest.mark.parametrize("arch", ARCHS)
@settings(max_examples=20, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=tree_operations)
def test_random_tree_operations_keep_the_cache_exact(make_engine, models, tokenizers, arch, ops):
    model, tokenizer = models[arch], tokenizers[THINKING_TEMPLATE]
    engine = make_engine(arch)
    conv = engine.conversation("Be brief.")
    fresh: dict[int, bool] = {}  # node id -> a whole greedy reply (not stopped, not hand-written)
    for name, argument in ops:
        before = conv.to_dict()
        roles = [m["role"] for m in conv.messages]
        if name in ("regenerate", "edit", "edit_reply"):  # mostly a message of the right role, sometimes not
            role = "user" if name == "edit" else "assistant"
            index = argument if name == "regenerate" else argument[0]
            fitting = [i for i, r in enumerate(roles) if r == role]
            index = fitting[index % len(fitting)] if fitting and index < 6 else index
            argument = index if name == "regenerate" else (index, argument[1])
        if name == "switch":  # one of the other branches shown somewhere
            other = [(i, b) for i in range(len(roles)) for b in range(conv.branches(i)[1]) if b != conv.branches(i)[0]]
            argument = other[argument % len(other)] if other else (argument, 0)
        try:
            if name in ("send", "send_stop"):
                for _ in conv.send(argument, **GREEDY):
                    if name == "send_stop":
                        conv.stop()
            elif name == "regenerate":
                list(conv.regenerate(argument, **GREEDY))
            elif name == "edit":
                list(conv.edit(argument[0], argument[1], **GREEDY))
            elif name == "edit_reply":
                conv.edit_reply(*argument)
            elif name == "switch":
                conv.switch_branch(*argument)
            else:
                conv.undo()
        except ConversationError:
            assert conv.to_dict() == before  # refused: nothing changed
            continue
        last = conv.history.entries[-1] if conv.history.entries else None
        if name in ("send", "send_stop", "regenerate", "edit"):
            fresh[last.uid] = not conv.stats.stopped
        cache_is_exact(conv, model)
        if last is not None and last.role == "assistant" and last.uid in fresh:
            check_exact(conv, model, tokenizer, max_new_tokens=MAX_NEW if fresh[last.uid] else None,
                        stopped=not fresh[last.uid], generated=False)
        assert engine.restore(json.loads(json.dumps(conv.to_dict()))).messages == conv.messages
    list(conv.send("And finally?", **GREEDY))  # whatever happened, the next turn is exact
    check_exact(conv, model, tokenizer, max_new_tokens=MAX_NEW)


@pytest.mark.parametrize("arch", ["sliding", "hybrid"])
def test_a_kept_branch_stays_switchable_however_many_turns_follow(make_engine, models, tokenizers, arch,
                                                                  monkeypatch):
    """Thinning checkpoints did not know where kept branches start. Once the one at
    a branch's start was gone, switching back rolled the cache to an earlier checkpoint or to
    nothing (the ledger at 0 tokens), then failed. Now that checkpoint stays, and a switch that
    cannot reach its start leaves the cache as it was."""
    model, tokenizer = models[arch], tokenizers[THINKING_TEMPLATE]
    conv = make_engine(arch, max_checkpoints=4).conversation("Be brief.")
    list(conv.send("First question?", **GREEDY))
    list(conv.regenerate(max_new_tokens=MAX_NEW, do_sample=True, seed=3))
    for turn in range(8):
        list(conv.send(f"Question number {turn}?", **GREEDY))
    assert len(conv.session.checkpoints) <= 4 + 1  # the limit, and the kept branch's start
    forwards = count_forwards(model, monkeypatch)
    assert conv.switch_branch(2, 0) is True and forwards == []
    monkeypatch.undo()
    assert len(conv.messages) == 3 and conv.session.token_ids
    check_exact(conv, model, tokenizer, max_new_tokens=MAX_NEW, generated=False)
    list(conv.send("And after the switch?", **GREEDY))
    assert not conv.stats.rebuilt
    check_exact(conv, model, tokenizer, max_new_tokens=MAX_NEW)


def test_a_segment_whose_start_cannot_be_reached_leaves_the_cache_as_it_was(make_engine):
    from cache_sessions.segments import Segment

    engine = make_engine("hybrid", max_checkpoints=4)
    conv = engine.conversation("Be brief.")
    list(conv.send("First question?", **GREEDY))
    session = conv.session
    before = list(session.token_ids)
    unreachable = min(set(range(1, len(before))) - set(session.checkpoints.positions()))
    assert session.reachable(unreachable) != unreachable
    assert engine.scheduler.call(session.append_segment, Segment(unreachable, [], [])) is False
    assert session.token_ids == before
