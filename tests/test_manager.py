"""The session manager: budget, LRU eviction of idle sessions only, limits, expiry, device moves."""

import pytest
import torch

from cache_sessions import CacheSession
from cache_sessions.manager import SessionManager, TooManySessions
from conftest import THINKING_TEMPLATE
from reference import LOGIT_TOLERANCE, cached_vs_scratch_logit_error, check_exact

GREEDY = dict(max_new_tokens=8, do_sample=False)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_keys_are_made_by_the_server_and_unknown_keys_find_nothing(make_engine):
    manager = SessionManager()
    key = manager.open(make_engine("full").conversation())
    assert isinstance(key, str) and len(key) >= 20
    assert manager.get(key) is not None
    for forged in ("0", "", None, key[:-1], 12):
        assert manager.get(forged) is None


@pytest.mark.parametrize("arch", ["full", "hybrid"])
def test_over_budget_the_least_recently_used_idle_session_is_released(make_engine, models, tokenizers, arch):
    engine = make_engine(arch)
    clock = Clock()
    manager = SessionManager(budget_bytes=10**9, clock=clock)
    keys, convs = [], []
    for i in range(3):
        convs.append(engine.conversation())
        keys.append(manager.open(convs[-1]))
        clock.now += 1
        with manager.using(keys[-1]) as conv:
            list(conv.send(f"Question number {i}?", **GREEDY))
    sizes = [conv.session.nbytes() for conv in convs]
    manager.get(keys[0])  # touched: now the most recent; keys[1] is the oldest
    clock.now += 1
    manager.budget_bytes = sum(sizes) - 1
    released = manager.enforce_budget()
    assert released == [keys[1]]
    assert convs[1].session.nbytes() == 0 and len(convs[1].messages) == 2  # its messages are kept
    assert convs[0].session.nbytes() == sizes[0] and convs[2].session.nbytes() == sizes[2]
    assert manager.total_bytes() <= manager.budget_bytes

    # the evicted conversation answers again, rebuilt, exactly
    with manager.using(keys[1]) as conv:
        list(conv.send("After eviction?", **GREEDY))
    assert conv.stats.rebuilt
    check_exact(conv, models[arch], tokenizers[THINKING_TEMPLATE], max_new_tokens=8)


def test_a_session_in_use_is_never_released(make_engine):
    engine = make_engine("full")
    manager = SessionManager()
    busy, idle = manager.open(engine.conversation()), manager.open(engine.conversation())
    with manager.using(idle) as conv:
        list(conv.send("Idle soon.", **GREEDY))
    manager.budget_bytes = 1
    with manager.using(busy) as conv:
        stream = conv.send("Generating...", max_new_tokens=12, do_sample=False)
        next(stream)
        assert manager.enforce_budget() == [idle]
        assert conv.session.nbytes() > 0  # over budget, but running: kept
        list(stream)
        assert conv.session.nbytes() > 0
    assert manager.get(busy).session.nbytes() == 0  # released once idle


def test_max_sessions_closes_the_oldest_idle_one_or_refuses(make_engine):
    engine = make_engine("full")
    clock = Clock()
    manager = SessionManager(max_sessions=2, clock=clock)
    first = manager.open(engine.conversation())
    clock.now += 1
    second = manager.open(engine.conversation())
    clock.now += 1
    third = manager.open(engine.conversation())
    assert first not in manager and second in manager and third in manager
    with manager.using(second), manager.using(third):
        with pytest.raises(TooManySessions):
            manager.open(engine.conversation())


def test_idle_sessions_expire(make_engine):
    clock = Clock()
    manager = SessionManager(idle_timeout_s=60, clock=clock)
    key = manager.open(make_engine("full").conversation())
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


def test_the_batched_copy_counts_in_the_budget(make_engine):
    """Bytes held outside the sessions (the decode batch's copy) push idle sessions out too."""
    engine = make_engine("full")
    held = {"bytes": 0}
    manager = SessionManager(budget_bytes=10**9, extra_bytes=lambda: held["bytes"])
    conv = engine.conversation()
    key = manager.open(conv)
    with manager.using(key):
        list(conv.send("Hello?", **GREEDY))
    manager.budget_bytes = conv.session.nbytes() + 10
    assert manager.enforce_budget() == []
    held["bytes"] = 11
    assert manager.total_bytes() == conv.session.nbytes() + 11
    assert manager.enforce_budget() == [key] and conv.session.nbytes() == 0
