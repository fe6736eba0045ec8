"""The cold tier (issue #23): over the budget, an idle conversation's cache goes to disk instead of
being dropped, and its next operation reads it back exact. Checked against from-scratch forwards
and greedy replies (tests/reference.py) on every layer mix: full attention, a sliding window, the
two mixed, and linear attention (whose rollbacks need the checkpoints that travel with it)."""

import pytest
import torch

from cache_sessions.cold import ColdStore
from cache_sessions.tensors import filled_bytes
from conftest import THINKING_TEMPLATE
from reference import check_exact
from tiny_models import ARCHS

OPTIONS = dict(max_new_tokens=6, do_sample=False)


def cold_files(folder):
    return sorted(folder.glob("session-*.cold"))


def held(engine, conv):
    """The session's cache and checkpoint tensors and its ledger, read on the loop (where nothing
    else changes them)."""
    def read():
        session = conv.session
        tensors = [t.clone() for kind in session.kinds for t in kind.tensors()]
        tensors += [t.clone() for t in session.checkpoints.tensors()]
        return tensors, list(session.token_ids), list(session.labels)

    return engine.scheduler.call(read)


def same_states(before, after) -> bool:
    tensors, ids, labels = before
    tensors_after, ids_after, labels_after = after
    return (ids, labels) == (ids_after, labels_after) and len(tensors) == len(tensors_after) and all(
        a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b) for a, b in zip(tensors, tensors_after))


@pytest.mark.parametrize("arch", ARCHS)
def test_an_idle_conversation_over_the_budget_goes_to_disk_and_comes_back_exact(make_engine, tokenizers, arch,
                                                                                  tmp_path):
    """Alice's turns against a twin conversation on an engine that never evicts: the same reuse,
    the same replies, and states equal to a from-scratch forward."""
    folder = tmp_path / "cold"
    engine, twin_engine = make_engine(arch, cache_dir=str(folder)), make_engine(arch)
    tokenizer = tokenizers[THINKING_TEMPLATE]
    alice, bob, twin = engine.conversation("Be brief."), engine.conversation("Be terse."), \
        twin_engine.conversation("Be brief.")
    for conv in (alice, twin):
        list(conv.send("Hello there?", **OPTIONS))
        list(conv.regenerate(max_new_tokens=6, do_sample=True, seed=3))  # a kept branch and checkpoints
        list(conv.send("And then?", **OPTIONS))
    before = held(engine, alice)
    engine.caches.budget_bytes = int(alice.session.nbytes() * 1.2)  # room for one conversation
    list(bob.send("Something else entirely?", **OPTIONS))
    stats = engine.caches.stats()
    # the kept branch went first (the budget's order), then the whole session, to disk
    assert stats.segments_freed == 1 and alice.session.segment_count() == 0
    assert stats.cold.sessions == 1 and stats.cold.spilled >= 1 and stats.evictions == 0
    assert alice.session.nbytes() == 0 and len(cold_files(folder)) == 1
    assert stats.cache_bytes <= engine.caches.budget_bytes
    # its next operation reads it back: every tensor as it was, and the turn reuses the history
    engine.caches.budget_bytes = None
    engine.scheduler.call(engine.caches.bring_back, alice.session)
    assert same_states(before, held(engine, alice)) and not cold_files(folder)
    # room for Bob and the shared prefixes, not for Alice too (Bob's states include the room
    # his buffers keep to grow: cache_sessions/growing.py)
    engine.caches.budget_bytes = (engine.caches.stats().shared_prefix_bytes + bob.session.nbytes()
                                  + alice.session.nbytes() // 2)
    engine.caches.enforce_budget()  # out again
    assert alice.session.nbytes() == 0 and len(cold_files(folder)) == 1
    for conv in (alice, twin):
        list(conv.send("One more?", **OPTIONS))
    assert not alice.stats.rebuilt and alice.stats.reused_tokens == twin.stats.reused_tokens > 0
    assert alice.reply_ids == twin.reply_ids
    check_exact(alice, engine.model, tokenizer, max_new_tokens=6)
    # a rollback after the round trip: the checkpoints it needs came back too
    engine.caches.budget_bytes = engine.caches.stats().cache_bytes - alice.session.nbytes()  # no room for Alice
    engine.caches.enforce_budget()
    assert alice.session.nbytes() == 0
    for conv in (alice, twin):
        list(conv.regenerate(**OPTIONS))
    assert not alice.stats.rebuilt and alice.stats.reused_tokens == twin.stats.reused_tokens
    assert alice.stats.rollback == twin.stats.rollback
    check_exact(alice, engine.model, tokenizer, max_new_tokens=6)
    engine.caches.budget_bytes = None
    index = next(i for i in range(len(alice.messages)) if alice.branches(i)[1] == 2)
    alice.switch_branch(index, 0)  # the first turn's other version (its kept states were freed: recomputed)
    check_exact(alice, engine.model, tokenizer, max_new_tokens=None, generated=False)
    assert engine.caches.stats().evictions == 0


def test_the_folder_is_bounded_the_oldest_file_goes_and_that_conversation_rebuilds_exact(make_engine, tokenizers,
                                                                                          tmp_path):
    folder = tmp_path / "cold"
    engine = make_engine("full", cache_dir=str(folder))
    tokenizer = tokenizers[THINKING_TEMPLATE]
    convs = [engine.conversation(f"Prompt number {n}.") for n in range(3)]
    for conv in convs:
        list(conv.send("Hello there?", **OPTIONS))
    # what a file holds: the filled states (a buffer's room to grow stays behind)
    one = max(filled_bytes(conv.session.tensors()) for conv in convs)
    engine.caches.budget_bytes = 0  # every idle conversation out
    engine.caches.cold_store.max_bytes = int(one * 1.6)  # room for one file (a file is a little more)
    engine.caches.enforce_budget()
    cold = engine.caches.stats().cold
    assert cold.sessions == 1 and cold.dropped == 2 and cold.bytes <= cold.max_bytes
    assert sum(path.stat().st_size for path in cold_files(folder)) == cold.bytes
    engine.caches.budget_bytes = None
    for index, conv in enumerate(convs):  # the newest came back; the two pushed out rebuild, and say so
        list(conv.send("And then?", **OPTIONS))
        assert conv.stats.rebuilt == (index < 2)
        check_exact(conv, engine.model, tokenizer, max_new_tokens=6)


def test_a_closed_conversation_leaves_no_file_and_the_store_keeps_other_files(make_engine, tmp_path):
    folder = tmp_path / "cold"
    folder.mkdir()
    (folder / "notes.txt").write_text("not the store's")
    (folder / "session-old.cold").write_bytes(b"left by an earlier run")
    engine = make_engine("full", cache_dir=str(folder))
    assert sorted(p.name for p in folder.iterdir()) == ["notes.txt"]  # an earlier run's files go at start
    conv = engine.conversation(None)
    list(conv.send("Hello there?", **OPTIONS))
    engine.caches.budget_bytes = 0
    engine.caches.enforce_budget()
    assert len(cold_files(folder)) == 1
    conv.close()
    engine.caches.enforce_budget()  # the loop has settled the close
    assert not cold_files(folder) and engine.caches.stats().cold.sessions == 0
    engine.caches.cold_store.close()
    assert sorted(p.name for p in folder.iterdir()) == ["notes.txt"]
    with pytest.raises(ValueError, match="not a folder"):
        ColdStore(folder / "notes.txt", 1 << 20)


def test_without_a_cache_dir_the_budget_still_evicts(make_engine):
    engine = make_engine("full")
    conv = engine.conversation(None)
    list(conv.send("Hello there?", **OPTIONS))
    engine.caches.budget_bytes = 0
    engine.caches.enforce_budget()
    stats = engine.caches.stats()
    assert stats.cold is None and stats.evictions == 1 and conv.session.nbytes() == 0
    list(conv.send("And then?", **OPTIONS))
    assert conv.stats.rebuilt


def test_a_damaged_file_means_a_rebuild_that_says_so_not_a_failed_turn(make_engine, tokenizers, tmp_path):
    folder = tmp_path / "cold"
    engine = make_engine("full", cache_dir=str(folder))
    conv = engine.conversation(None)
    list(conv.send("Hello there?", **OPTIONS))
    engine.caches.budget_bytes = 0
    engine.caches.enforce_budget()
    (path,) = cold_files(folder)
    path.write_bytes(path.read_bytes()[:100])  # cut short
    engine.caches.budget_bytes = None
    list(conv.send("And then?", **OPTIONS))
    assert conv.stats.rebuilt and not cold_files(folder)
    check_exact(conv, engine.model, tokenizers[THINKING_TEMPLATE], max_new_tokens=6)
