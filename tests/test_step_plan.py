"""A step's plan is plain data: made from the table of requests and the caches, it changes
neither, and made twice from the same table it is the same plan. The table is caught between
two steps with every kind of work in it (a reply decoding, a newcomer whose cache rolls back to
the turn it shares, a Retry whose first token comes from the logits its cache kept, a fresh
conversation, a text prepared ahead), and the replies served from it afterwards are still the
ones greedy `generate` gives from scratch (`check_exact`)."""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import THINKING_TEMPLATE
from reference import check_exact

from test_scheduler import Consumer, HeldScheduler, wait_until

MAX_NEW = 10
GREEDY = dict(max_new_tokens=MAX_NEW, do_sample=False)


def snapshot(engine, sessions) -> tuple:
    """Everything a plan could change: the table's lists, what each client is owed, and every
    session's ledger, checkpoints, kept logits and states."""
    scheduler = engine.scheduler
    table = scheduler.planner.requests
    with table.lock:
        lists = tuple(tuple(queue) for queue in (table.waiting, table.prefilling, table.decoding, table.paused,
                                                  table.ahead))
    states = []
    for session in sessions:
        tensors = [tensor.clone() for kind in session.kinds for tensor in kind.tensors()]
        kept = session._next_logits
        states.append((session, tuple(session.token_ids), tuple(session.checkpoints.positions()),
                         session.cache.get_seq_length(), None if kept is None else kept[0], tensors))
    return lists, dict(scheduler.planner.shares.owed), states


def same(before: tuple, after: tuple) -> bool:
    if before[:2] != after[:2] or len(before[2]) != len(after[2]):
        return False
    for old, new in zip(before[2], after[2]):
        if old[:5] != new[:5] or len(old[5]) != len(new[5]):
            return False
        if not all(torch.equal(a, b) for a, b in zip(old[5], new[5])):
            return False
    return True


def planned_twice(engine, conversations) -> tuple:
    """On the loop, between two steps: the plan made twice, and the snapshots around each."""
    scheduler, sessions = engine.scheduler, [conversation.session for conversation in conversations]

    def check():
        plan = lambda: scheduler.planner.plan(lambda: 0.0, scheduler.runner.graph_ready)  # noqa: E731
        before = snapshot(engine, sessions)
        first = plan()
        between = snapshot(engine, sessions)
        second = plan()
        return first, second, same(before, between), same(before, snapshot(engine, sessions))

    return scheduler.loop.post(check)


@pytest.mark.parametrize("arch", ["full", "sliding"])
def test_a_plan_changes_nothing_and_is_the_same_made_twice(make_engine, models, tokenizers, monkeypatch, arch):
    model, tokenizer = models[arch], tokenizers[THINKING_TEMPLATE]
    engine = make_engine(arch, max_batch_size=3, draft="ngram")
    talker, asker, retried, fresh = (engine.conversation("You are terse.") for _ in range(4))
    list(asker.send("What is a cache?", **GREEDY))
    list(retried.send("Name a colour.", **GREEDY))
    monkeypatch.setattr(model.generation_config, "eos_token_id", None)
    long = Consumer(talker, talker.send("Talk for a while.", max_new_tokens=60, do_sample=False))
    wait_until(lambda: engine.batch_stats().decoding == 1)
    with HeldScheduler(engine):
        queued = [Consumer(asker, asker.send("And a rollback?", **GREEDY)),
                  Consumer(retried, retried.regenerate(**GREEDY)),
                  Consumer(fresh, fresh.send("Hello there, how are you today?", **GREEDY))]
        wait_until(lambda: engine.batch_stats().waiting == 3)
        checked = planned_twice(engine, (talker, asker, retried, fresh))
    first, second, unchanged_once, unchanged_twice = checked.result(60)
    assert first == second
    assert unchanged_once and unchanged_twice
    # the plan had every kind of work in it: a decode row, admissions, rollbacks to a shared turn
    admitted = [request for move, request in first.admission.moves if move == "admit"]
    assert len(first.decoding) >= 1 and len(admitted) == 2  # three rows: the talker and two newcomers
    assert any(piece.begins and piece.at.position > 0 for piece in first.prefill)
    for consumer in (long, *queued):
        consumer.join(120)
        assert consumer.error is None
    monkeypatch.undo()
    for conversation in (asker, retried, fresh):
        check_exact(conversation, model, tokenizer, max_new_tokens=MAX_NEW)

    # a text prepared ahead, in a step no reply wants
    with HeldScheduler(engine):
        assert fresh.prepare("One more question about caches, please.", **GREEDY)
        wait_until(lambda: engine.batch_stats().preparing == 1)
        checked = planned_twice(engine, (talker, asker, retried, fresh))
    first, second, unchanged_once, unchanged_twice = checked.result(60)
    assert first == second and unchanged_once and unchanged_twice
    assert first.ahead is not None and first.ahead.begins and first.ahead.fed()
    wait_until(lambda: engine.batch_stats().preparing == 0)
    list(fresh.send("One more question about caches, please.", **GREEDY))
    check_exact(fresh, model, tokenizer, max_new_tokens=MAX_NEW)


def test_a_retry_whose_first_token_was_kept_joins_the_plan_without_a_step_of_its_own(make_engine, models,
                                                                                    tokenizers):
    """With full attention the logits after a prompt are kept: a Retry's plan has it decode from
    this step, held whole, its cache rolled back to the prompt's end; its first token is then
    chosen from those logits and fed in the same step."""
    engine = make_engine("full", draft="off")
    conversation = engine.conversation()
    list(conversation.send("Name a colour.", **GREEDY))
    with HeldScheduler(engine):
        stream = Consumer(conversation, conversation.regenerate(**GREEDY))
        wait_until(lambda: engine.batch_stats().waiting == 1)
        checked = planned_twice(engine, (conversation,))
    first, _, unchanged, _ = checked.result(60)
    assert unchanged
    (piece,) = first.prefill
    assert piece.ends_prompt and piece.held_whole and piece.begins and first.decoding == (piece.request,)
    assert first.first_from_kept() == [piece.request]
    stream.join(60)
    assert stream.error is None
    check_exact(conversation, models["full"], tokenizers[THINKING_TEMPLATE], max_new_tokens=MAX_NEW)
