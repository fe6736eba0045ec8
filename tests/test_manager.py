"""The cache owner's budget (LRU eviction of idle sessions only, the batch counted), the session
manager's keys, limits and expiry, and device moves."""

import time

import pytest
import torch

from cache_sessions import CacheSession
from chat.storage.sessions import SessionManager, TooManySessions
from conftest import THINKING_TEMPLATE
from reference import LOGIT_TOLERANCE, cached_vs_scratch_logit_error, check_exact

GREEDY = dict(max_new_tokens=8, do_sample=False)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class Chat:
    """What the session manager holds: something that says whether it is busy and closes itself."""

    def __init__(self, conversation):
        self.conversation = conversation

    @property
    def busy(self):
        return self.conversation.is_busy

    def close(self):
        self.conversation.close()


def streaming(conv, **options):
    """A reply begun (its first delta read) and left open: the conversation is busy until drained."""
    stream = conv.send("Generating for a while...", **options)
    next(stream)
    return stream


def test_keys_are_made_by_the_server_and_unknown_keys_find_nothing(make_engine):
    manager = SessionManager()
    key = manager.open(Chat(make_engine("full").conversation()))
    assert isinstance(key, str) and len(key) >= 20
    assert manager.get(key) is not None
    for forged in ("0", "", None, key[:-1], 12):
        assert manager.get(forged) is None


@pytest.mark.parametrize("arch", ["full", "hybrid"])
def test_over_budget_the_least_recently_used_idle_session_is_released(make_engine, models, tokenizers, arch):
    engine = make_engine(arch)
    convs = [engine.conversation() for _ in range(3)]
    for i, conv in enumerate(convs):
        list(conv.send(f"Question number {i}?", **GREEDY))
    sizes = [conv.session.nbytes() for conv in convs]
    assert engine.caches.stats().cache_bytes == sum(sizes)
    convs[0].switch_branch(1, 0)  # an operation: now the most recently used; convs[1] is the oldest
    engine.caches.budget_bytes = sum(sizes) - 1
    engine.caches.enforce_budget()
    assert convs[1].session.nbytes() == 0 and len(convs[1].messages) == 2  # its messages are kept
    assert convs[0].session.nbytes() == sizes[0] and convs[2].session.nbytes() == sizes[2]
    stats = engine.caches.stats()
    assert stats.cache_bytes <= stats.budget_bytes and stats.evictions == 1

    # the evicted conversation answers again, rebuilt, exactly
    engine.caches.budget_bytes = None
    list(convs[1].send("After eviction?", **GREEDY))
    assert convs[1].stats.rebuilt
    check_exact(convs[1], models[arch], tokenizers[THINKING_TEMPLATE], max_new_tokens=8)


def test_a_busy_session_is_never_released_and_a_close_waits_for_its_reply(make_engine):
    engine = make_engine("full", cache_budget_bytes=10**9)
    busy, idle = engine.conversation(), engine.conversation()
    list(idle.send("Idle soon.", **GREEDY))
    stream = streaming(busy, max_new_tokens=12, do_sample=False)
    engine.caches.budget_bytes = 1
    engine.caches.enforce_budget()
    assert idle.session.nbytes() == 0  # over budget: the idle one goes
    assert busy.session.token_ids and busy.is_busy  # running: kept
    busy.close()  # closed while its reply runs (a tab that went away): freed when the reply ends
    list(stream)
    engine.caches.enforce_budget()
    assert busy.session.nbytes() == 0 and not busy.is_busy
    assert engine.caches.stats().sessions == 1  # the closed one is forgotten; the idle one stays known


def test_max_sessions_closes_the_oldest_idle_one_or_refuses(make_engine):
    engine = make_engine("full")
    clock = Clock()
    manager = SessionManager(max_sessions=2, clock=clock)
    first = manager.open(Chat(engine.conversation()))
    clock.now += 1
    second, third = Chat(engine.conversation()), Chat(engine.conversation())
    second_key = manager.open(second)
    clock.now += 1
    third_key = manager.open(third)
    assert first not in manager and second_key in manager and third_key in manager
    streams = [streaming(chat.conversation, max_new_tokens=20, do_sample=False) for chat in (second, third)]
    with pytest.raises(TooManySessions):
        manager.open(Chat(engine.conversation()))
    for stream in streams:
        stream.close()
    assert manager.open(Chat(engine.conversation())) in manager and manager.stats().closed_for_room == 2


def test_idle_sessions_expire(make_engine):
    clock = Clock()
    manager = SessionManager(idle_timeout_s=60, clock=clock)
    key = manager.open(Chat(make_engine("full").conversation()))
    clock.now += 59
    assert manager.get(key) is not None
    clock.now += 61
    assert manager.get(key) is None and manager.expired == 1


@pytest.mark.parametrize("arch", ["full", "sliding", "mixed", "hybrid"])
def test_session_moves_every_tensor_between_devices(make_engine, models, tokenizers, arch):
    """What ZeroGPU needs: caches parked on the CPU between calls, moved to the model's device for one."""
    conv = make_engine(arch).conversation("System.")
    list(conv.send("Hello there?", **GREEDY))
    list(conv.regenerate(max_new_tokens=8, do_sample=True))  # a stashed version segment too
    session: CacheSession = conv.session
    first_version = conv.history.last_reply().parent.children[0]
    assert session.segment_start(first_version.uid) is not None and (len(session.checkpoints) > 0 or arch == "full")
    session.to("meta")
    assert {t.device.type for t in session.tensors()} == {"meta"}
    assert all(layer.keys.device.type == "meta" for layer in session.cache.layers if getattr(layer, "keys", None) is not None)
    session.release()
    list(conv.send("Again, after a move.", **GREEDY))
    session.to("cpu")
    assert {t.device.type for t in session.tensors()} == {"cpu"}
    error = cached_vs_scratch_logit_error(models[arch], session.cache, session.token_ids, 7)
    assert error < LOGIT_TOLERANCE


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_offloaded_engine_round_trips_through_cuda(models, tokenizers):
    from chat import ChatEngine

    model = models["hybrid"].to("cuda")
    try:
        engine = ChatEngine(model, tokenizers[THINKING_TEMPLATE], offload_sessions=True)
        conv = engine.conversation("System.")
        for text in ("One?", "Two?"):
            list(conv.send(text, **GREEDY))
            assert {t.device.type for t in conv.session.tensors()} == {"cpu"}
        list(conv.regenerate(**GREEDY))
        assert conv.stats.prefilled_tokens == 1
    finally:
        model.to("cpu")


@pytest.mark.parametrize("arch", ["full", "hybrid"])
def test_rows_decoding_together_hold_their_states_once(make_engine, models, monkeypatch, arch):
    """Packed steps read each session's cache in place (recurrent states too): while two decode,
    the caches hold the three sessions' own bytes and nothing else (read on the loop, between
    two steps)."""
    monkeypatch.setattr(models[arch].generation_config, "eos_token_id", None)
    engine = make_engine(arch)
    assert engine.scheduler.runner.packs
    idle = engine.conversation()
    list(idle.send("Hello?", **GREEDY))
    one, two = engine.conversation(), engine.conversation()
    streams = [streaming(conv, max_new_tokens=200, do_sample=False) for conv in (one, two)]
    for stream in streams:
        next(stream)
    stats, own, decoding = engine.caches.loop.call(lambda: (
        engine.caches.stats(), sum(conv.session.nbytes() for conv in (idle, one, two)),
        engine.batch_stats().decoding))
    assert decoding == 2 and stats.cache_bytes == own > 0
    for stream in streams:
        stream.close()


def test_idle_sessions_expire_on_a_timer_without_any_call(make_engine):
    """Nobody looks a key up: the timer expires it (before, only the next call did)."""
    clock = Clock()
    manager = SessionManager(idle_timeout_s=60, clock=clock, expire_every_s=0.01)
    engine = make_engine("full")
    chat = Chat(engine.conversation())
    key = manager.open(chat)
    list(chat.conversation.send("Hello?", **GREEDY))
    clock.now += 61
    deadline = time.monotonic() + 30
    while key in manager:  # a condition, not a sleep of a guessed length
        assert time.monotonic() < deadline, "the timer never expired it"
        time.sleep(0.01)
    engine.caches.enforce_budget()  # a round of the loop: the close it was told of has been applied
    assert manager.expired == 1 and chat.conversation.session.nbytes() == 0
    manager.stop_timer()


def test_a_session_taken_over_keeps_its_cache_under_a_new_key_and_the_old_key_finds_nothing(make_engine):
    """Another device of a signed-in person takes a conversation over (ui/directory.py): the
    conversation and its cache move, nothing is closed, the old key is told gone."""
    from ui.directory import ChatDirectory

    engine = make_engine("full")
    directory = ChatDirectory(engine, max_per_client=4)
    key, chat, _ = directory.chat(None, "", page="laptop", client="10.0.0.1")
    stream = streaming(chat.conversation, max_new_tokens=4, do_sample=False)
    assert directory.take_over(key, page="phone") is None  # not while its reply runs
    list(stream)
    held = list(chat.conversation.session.token_ids)
    new_key = directory.take_over(key, page="phone", client="10.0.0.2")
    assert new_key not in (None, key) and directory.find(key) is None and directory.find(new_key) is chat
    assert len(held) > 4 and chat.conversation.session.token_ids == held  # its cache, as it was
    directory.page_closed("laptop")  # the laptop's tab closes: the phone's conversation stays
    assert directory.find(new_key) is chat
    assert directory.take_over(key, page="tablet") is None  # the old key holds nothing to take
    directory.page_closed("phone")
    assert directory.find(new_key) is None
