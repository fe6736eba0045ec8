"""The cold tier: over the budget, an idle conversation's cache goes to disk instead of
being dropped, and its next operation reads it back exact. Checked against from-scratch forwards
and greedy replies (tests/reference.py) on every layer mix: full attention, a sliding window, the
two mixed, and linear attention (whose rollbacks need the checkpoints that travel with it)."""

from pathlib import Path
import pickle
import threading
import time
from contextlib import contextmanager
from typing import Iterator

import pytest
import torch

import cache_sessions.cold

from cache_sessions.cold import ColdStore
from cache_sessions.tensors import filled_bytes
from conftest import THINKING_TEMPLATE
from reference import check_exact
from tiny_models import ARCHS

OPTIONS = dict(max_new_tokens=6, do_sample=False)


def cold_files(folder):
    return sorted(folder.glob("process-*/session-*.cold"))


def written(engine) -> None:
    """Spills write beside the loop: wait until every write handed over has ended."""
    engine.caches.cold_store.flush()


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
    written(engine)
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
    written(engine)
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
    written(engine)
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
    # an earlier run's files go at start; the store writes in a folder of its own
    assert sorted(p.name for p in folder.iterdir() if p != engine.caches.cold_store.own) == ["notes.txt"]
    conv = engine.conversation(None)
    list(conv.send("Hello there?", **OPTIONS))
    engine.caches.budget_bytes = 0
    engine.caches.enforce_budget()
    written(engine)
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
    written(engine)
    (path,) = cold_files(folder)
    path.write_bytes(path.read_bytes()[:100])  # cut short
    engine.caches.budget_bytes = None
    list(conv.send("And then?", **OPTIONS))
    assert conv.stats.rebuilt and not cold_files(folder)
    check_exact(conv, engine.model, tokenizers[THINKING_TEMPLATE], max_new_tokens=6)


def spilled(make_engine, folder, text="Hello there?"):
    """An engine on `folder` with one conversation whose states went to disk; its file."""
    engine = make_engine("full", cache_dir=str(folder))
    conv = engine.conversation(None)
    list(conv.send(text, **OPTIONS))
    engine.caches.budget_bytes = 0
    engine.caches.enforce_budget()
    written(engine)
    (path,) = [p for p in cold_files(folder) if p.parent == engine.caches.cold_store.own]
    engine.caches.budget_bytes = None
    return engine, conv, path


def test_a_flipped_bit_or_a_replaced_file_is_refused_unread(make_engine, tokenizers, tmp_path):
    """One flipped bit in a file's tensor data was accepted (states off by
    2.4e-4), and a replaced file was unpickled (its code ran). Every file carries a digest keyed
    by a secret only its store holds; nothing is parsed before it matches."""
    folder = tmp_path / "cold"
    engine, conv, path = spilled(make_engine, folder)
    data = bytearray(path.read_bytes())
    data[len(data) // 3] ^= 1  # in the tensors
    path.write_bytes(bytes(data))
    list(conv.send("And then?", **OPTIONS))
    assert conv.stats.rebuilt
    check_exact(conv, engine.model, tokenizers[THINKING_TEMPLATE], max_new_tokens=6)

    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    engine.caches.budget_bytes = 0
    engine.caches.enforce_budget()
    written(engine)
    (path,) = cold_files(folder)
    path.write_bytes(pickle.dumps(Payload()))
    engine.caches.budget_bytes = None
    list(conv.send("Once more?", **OPTIONS))
    assert conv.stats.rebuilt and not marker.exists()
    check_exact(conv, engine.model, tokenizers[THINKING_TEMPLATE], max_new_tokens=6)


def test_two_processes_on_one_cache_dir_keep_to_their_own_files(make_engine, tokenizers, tmp_path):
    """A second store's start deleted the first one's files, reused its file
    names, and the first then resumed the other conversation's states as its own. Each store now
    writes in its own locked folder and accepts only files it wrote (a swapped file rebuilds)."""
    folder = tmp_path / "cold"
    first, alice, alice_file = spilled(make_engine, folder, "Alice asks this?")
    second, bob, bob_file = spilled(make_engine, folder, "Bob asks something else entirely?")
    assert alice_file.exists() and alice_file.parent != bob_file.parent
    list(alice.send("And then?", **OPTIONS))  # her own file, still there after the second's start
    assert not alice.stats.rebuilt
    check_exact(alice, first.model, tokenizers[THINKING_TEMPLATE], max_new_tokens=6)
    first.caches.budget_bytes = 0
    first.caches.enforce_budget()
    written(first)
    (alice_file,) = [p for p in cold_files(folder) if p.parent == first.caches.cold_store.own]
    alice_file.write_bytes(bob_file.read_bytes())  # another process's file in her place
    first.caches.budget_bytes = None
    list(alice.send("Once more?", **OPTIONS))
    assert alice.stats.rebuilt
    check_exact(alice, first.model, tokenizers[THINKING_TEMPLATE], max_new_tokens=6)


def test_a_spill_that_fails_in_any_way_evicts_and_drops_no_other_file(make_engine, tmp_path, monkeypatch):
    """A MemoryError while serializing escaped `settle` and switched the budget
    off for good (225 KB held against a budget of 1 byte, the spill retried every round); and
    older files were deleted to make room before a write that then failed. Now a write that
    fails (beside the loop) loses that session's states, as an eviction would, and older files
    go only once the new one is written."""
    folder = tmp_path / "cold"
    engine, kept, kept_file = spilled(make_engine, folder)
    engine.caches.cold_store.max_bytes = int(kept_file.stat().st_size * 1.5)  # a second file would push it out
    conv = engine.conversation(None)
    list(conv.send("Another question?", **OPTIONS))

    def no_memory(*args, **kwargs):
        raise MemoryError

    monkeypatch.setattr(cache_sessions.cold, "_raw", no_memory)
    engine.caches.budget_bytes = 1
    engine.caches.enforce_budget()
    written(engine)
    stats = engine.caches.stats()
    assert stats.cold.failed == 1 and conv.session.nbytes() == 0 and stats.cache_bytes <= 1
    assert kept_file.exists() and stats.cold.sessions == 1 and stats.cold.dropped == 0
    assert [p for p in cold_files(folder) if p != kept_file] == []  # the half-written file went
    monkeypatch.undo()
    engine.caches.budget_bytes = None
    list(conv.send("And then?", **OPTIONS))
    assert conv.stats.rebuilt
    monkeypatch.setattr(cache_sessions.cold.tempfile, "mkstemp", lambda **kwargs: (_ for _ in ()).throw(
        OSError(28, "No space left on device")))
    # it fits the folder alone, not beside the kept file: a written file would push that one out
    engine.caches.cold_store.max_bytes = engine.scheduler.call(conv.session.nbytes) + kept_file.stat().st_size // 2
    engine.caches.budget_bytes = 1
    engine.caches.enforce_budget()
    written(engine)
    stats = engine.caches.stats()
    assert stats.cold.failed == 2 and kept_file.exists() and stats.cold.dropped == 0


def held_thread(executor) -> threading.Event:
    """Occupy one of the store's disk threads until the returned event is set."""
    gate, started = threading.Event(), threading.Event()
    executor.submit(lambda: (started.set(), gate.wait(60)))
    assert started.wait(60)
    return gate


def test_a_spill_is_written_beside_the_loop_and_taken_back_from_memory_before_it_is(make_engine, tmp_path):
    """A spill wrote on the loop (a 51 MiB one stalled every decoding user 223 ms). The
    loop now only hands the states over; needed again before their file is written, they come
    back from memory and no file is left."""
    folder = tmp_path / "cold"
    engine = make_engine("full", cache_dir=str(folder))
    conv = engine.conversation("Be brief.")
    list(conv.send("Hello there?", **OPTIONS))
    before = held(engine, conv)
    gate = held_thread(engine.caches.cold_store._writer)
    try:
        engine.caches.budget_bytes = 0
        engine.caches.enforce_budget()  # returns with the writer held: the loop never waited on it
        stats = engine.caches.stats()
        assert conv.session.nbytes() == 0 and stats.cache_bytes == 0 and stats.cold.writing_bytes > 0
        assert not cold_files(folder)
        engine.caches.budget_bytes = None
        engine.scheduler.call(engine.caches.bring_back, conv.session)
        assert same_states(before, held(engine, conv))
    finally:
        gate.set()
    written(engine)
    cold = engine.caches.stats().cold
    assert not cold_files(folder) and cold.spilled == 0 and cold.resumed == 1 and cold.writing_bytes == 0


@contextmanager
def a_reply_waiting_on_its_read(engine, folder) -> Iterator[tuple]:
    """`cold`'s states spilled to `folder`; `busy` streams a long reply; then `cold`'s next message
    is admitted while its read is held. Yields (cold, waiting thread, deadline); on leaving, the
    read is let go, the waiting reply joined and the busy stream closed."""
    cold, busy = engine.conversation("Be brief."), engine.conversation("Be terse.")
    list(cold.send("Hello there?", **OPTIONS))
    engine.caches.budget_bytes = 0
    engine.caches.enforce_budget()
    written(engine)
    engine.caches.budget_bytes = None
    assert len(cold_files(folder)) == 1 and cold.session.nbytes() == 0
    gate = held_thread(engine.caches.cold_store._reader)
    stream = waiting = None
    try:
        stream = busy.send("Talk for a while.", max_new_tokens=400, do_sample=False)
        next(stream)
        waiting = threading.Thread(target=lambda: list(cold.send("And then?", **OPTIONS)), daemon=True)
        waiting.start()
        deadline = time.monotonic() + 60
        while engine.batch_stats().prefilling == 0:  # its request was admitted, its read is held
            assert time.monotonic() < deadline
            time.sleep(0.001)
        yield cold, waiting, deadline
    finally:
        gate.set()
        if waiting is not None:
            waiting.join(60)
        if stream is not None:
            stream.close()


def decode_steps_go_on(engine, waiting: threading.Thread, deadline: float, steps: int = 20) -> None:
    """The busy reply decodes `steps` more steps while the other waits for its read."""
    start = engine.batch_stats().steps
    while engine.batch_stats().steps < start + steps:
        assert time.monotonic() < deadline and waiting.is_alive()
        time.sleep(0.001)


def test_a_reply_whose_states_are_on_disk_waits_for_them_while_the_others_decode(make_engine, models, tokenizers,
                                                                                 tmp_path, monkeypatch):
    """Its states are read beside the loop: the other users' steps go on meanwhile, and the reply
    then reuses its history as if it had never left memory."""
    monkeypatch.setattr(models["full"].generation_config, "eos_token_id", None)
    folder = tmp_path / "cold"
    engine = make_engine("full", cache_dir=str(folder))
    with a_reply_waiting_on_its_read(engine, folder) as (cold, waiting, deadline):
        decode_steps_go_on(engine, waiting, deadline)
        assert engine.batch_stats().prefilling == 1
    assert not waiting.is_alive() and not cold.stats.rebuilt and cold.stats.reused_tokens > 0
    assert engine.caches.stats().cold.resumed == 1 and not cold_files(folder)
    check_exact(cold, engine.model, tokenizers[THINKING_TEMPLATE], max_new_tokens=6)


def test_a_reply_stopped_while_its_states_are_read_never_holds_up_the_others(make_engine, models, tmp_path,
                                                                             monkeypatch):
    """A Stop of a reply whose states were still being read ended it on the loop at once, which put
    its states back there: it read the file on the loop (the read beside it not begun yet) or
    waited for that read, and every other user's step waited too. Now the stopped reply waits for
    its read like any other (the others decode meanwhile) and then ends."""
    monkeypatch.setattr(models["full"].generation_config, "eos_token_id", None)
    folder = tmp_path / "cold"
    engine = make_engine("full", cache_dir=str(folder))
    with a_reply_waiting_on_its_read(engine, folder) as (cold, waiting, deadline):
        cold.stop()
        decode_steps_go_on(engine, waiting, deadline)
    assert not waiting.is_alive() and cold.stats.stopped
    assert [m["content"] for m in cold.messages if m["role"] == "user"] == ["Hello there?", "And then?"]


def test_a_session_needed_while_its_spill_is_being_written_waits_beside_the_loop(make_engine, tmp_path, monkeypatch):
    """`ready` said yes for a session whose write was running, and `resume` then
    waited for the disk on the loop (0.70 s for every decoding user on a slow disk). Now `ready`
    says no until the write has ended, and the states come back from memory, its file dropped."""
    folder = tmp_path / "cold"
    engine = make_engine("full", cache_dir=str(folder))
    conv = engine.conversation("Be brief.")
    list(conv.send("Hello there?", **OPTIONS))
    before = held(engine, conv)
    store, writing, gate = engine.caches.cold_store, threading.Event(), threading.Event()
    write_file = cache_sessions.cold._StateFiles.write

    def slow_disk(self, states):
        writing.set()
        assert gate.wait(60)
        return write_file(self, states)

    monkeypatch.setattr(cache_sessions.cold._StateFiles, "write", slow_disk)
    engine.caches.budget_bytes = 0
    engine.caches.enforce_budget()
    engine.caches.budget_bytes = None
    assert writing.wait(60)  # the writer is inside the write now: it cannot be called off
    told = threading.Event()
    assert not engine.scheduler.call(store.ready, conv.session, told.set)
    gate.set()
    assert told.wait(60)
    assert engine.scheduler.call(store.ready, conv.session, told.set)
    engine.scheduler.call(engine.caches.bring_back, conv.session)
    assert same_states(before, held(engine, conv))
    written(engine)
    cold = engine.caches.stats().cold
    assert not cold_files(folder) and cold.spilled == 0 and cold.resumed == 1 and cold.writing_bytes == 0


def test_a_file_swapped_between_two_sessions_or_an_older_one_of_the_same_is_refused(make_engine, tokenizers,
                                                                                   tmp_path):
    """Two sessions of one store spilled, their files swapped: session x came back
    with y's states and ledger (both files carry this store's key). Each file is now bound to its
    write; x rebuilds instead, exact, and so does a session handed its own older file."""
    folder = tmp_path / "cold"
    engine = make_engine("full", cache_dir=str(folder))
    x, y = engine.conversation("Be brief."), engine.conversation("Be brief.")
    list(x.send("Hello there?", **OPTIONS))
    list(y.send("Something else entirely, and longer than the other one?", **OPTIONS))
    store = engine.caches.cold_store

    def spill_all() -> dict:
        engine.caches.budget_bytes = 0
        engine.caches.enforce_budget()
        written(engine)
        engine.caches.budget_bytes = None
        return {conv: store._tables.files[conv.session].path for conv in (x, y)}

    paths = spill_all()
    x_bytes, y_bytes = paths[x].read_bytes(), paths[y].read_bytes()
    paths[x].write_bytes(y_bytes)
    paths[y].write_bytes(x_bytes)
    for conv in (x, y):
        list(conv.send("And then?", **OPTIONS))
        assert conv.stats.rebuilt
        check_exact(conv, engine.model, tokenizers[THINKING_TEMPLATE], max_new_tokens=6)
    older = spill_all()[x].read_bytes()  # x's file now; spilled again below, and put back over the newer
    list(x.send("Once more?", **OPTIONS))
    assert not x.stats.rebuilt  # read back as written
    newer = spill_all()[x]
    newer.write_bytes(older)
    list(x.send("And again?", **OPTIONS))
    assert x.stats.rebuilt
    check_exact(x, engine.model, tokenizers[THINKING_TEMPLATE], max_new_tokens=6)


def test_a_forked_worker_has_a_cold_tier_of_its_own_and_leaves_the_parents_alone(make_engine, tmp_path):
    """A forked worker (ZeroGPU) inherited its parent's cold tier (folder, file
    list, key), and its exit removed the parent's folder: the parent's session then came back with
    none of its tokens. The worker now has a folder, key and list of its own."""
    import multiprocessing

    folder = tmp_path / "cold"
    engine, conv, path = spilled(make_engine, folder)
    store = engine.caches.cold_store
    context = multiprocessing.get_context("fork")
    results = context.SimpleQueue()

    def worker() -> None:
        torch.set_num_threads(1)  # OpenMP's pool does not survive a fork
        results.put((str(store.own), len(store._tables.files), store._sealed.key))
        store.close()  # what its exit does (the engine's finalizer)

    process = context.Process(target=worker, daemon=True)
    process.start()
    own, files, key = results.get()
    process.join(60)
    assert process.exitcode == 0
    assert own != str(store.own) and files == 0 and key != store._sealed.key
    assert path.exists() and store.own.exists() and not Path(own).exists()
    held_tokens = engine.caches.stats().cold.sessions
    list(conv.send("And then?", **OPTIONS))
    assert held_tokens == 1 and not conv.stats.rebuilt and conv.stats.reused_tokens > 0
