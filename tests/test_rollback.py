"""Rollback per layer kind, checkpoints, memory accounting: the cache_sessions package alone."""

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicIndexedLayer, DynamicLayer

from cache_sessions import CacheSession, Checkpoint, CheckpointStore, UnsupportedCacheLayer, layer_kinds
from cache_sessions.rollback import FullAttention, RecurrentState, SlidingWindow
from chat.model_step.feeding import feed, prefill, rewind_and_prefill
from reference import LOGIT_TOLERANCE, cached_vs_scratch_logit_error
from tiny_models import ARCHS, SLIDING_WINDOW

PROMPT = list(range(30, 90))


def hold(model, session: CacheSession, token_ids: list[int]) -> None:
    """Make the session hold `token_ids`, as a reply's rollback, prefill and decode would leave it."""
    rewind_and_prefill(model, session, token_ids + [5])
    feed(model, session, token_ids[len(session.token_ids):])


def exact(model, session: CacheSession) -> bool:
    return cached_vs_scratch_logit_error(model, session.cache, session.token_ids, 7) < LOGIT_TOLERANCE


def test_layer_kinds_follow_the_cache_layers(models):
    kinds = {arch: [type(k) for k in layer_kinds(DynamicCache(config=models[arch].config))] for arch in ARCHS}
    assert kinds["full"] == [FullAttention] * 2
    assert kinds["sliding"] == [SlidingWindow] * 2
    assert kinds["mixed"] == [SlidingWindow, FullAttention] * 2
    assert kinds["hybrid"] == [RecurrentState, FullAttention] * 2


def test_unknown_layer_class_is_refused():
    cache = DynamicCache()
    cache.layers = [DynamicLayer(), DynamicIndexedLayer()]
    with pytest.raises(UnsupportedCacheLayer):
        layer_kinds(cache)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("cut", [1, 5, 25, 59])
def test_prepare_rolls_back_to_any_prefix_exactly(models, arch, cut):
    model = models[arch]
    session = CacheSession(models[arch])
    hold(model, session, PROMPT)
    assert exact(model, session)
    prompt = PROMPT[:cut] + [11, 12, 13]
    result = rewind_and_prefill(model, session, prompt)
    held = session.token_ids
    assert held == prompt[:-1]  # prefilled up to the generation start: the first decode step feeds the last
    assert exact(model, session)
    assert result.reused_tokens <= cut and result.prefilled_tokens == len(prompt) - result.reused_tokens
    if arch == "full":  # crop is exact
        assert (result.rollback, result.reused_tokens) == ("crop", cut)


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_in_chunks_equals_one_prefill(models, arch):
    """Chunked prefill (what runs between other conversations' decode steps) stays exact, and a
    shared prefix met on the way is stored once."""
    from cache_sessions.prefixes import PrefixStore

    model = models[arch]

    session, store = CacheSession(models[arch]), PrefixStore(4)
    hold(model, session, PROMPT[:10])
    prompt = PROMPT + [11, 12, 13]
    session.rewind_to(prompt)
    assert session.token_ids == PROMPT[:10]
    steps = 0
    while not prefill(model, session, prompt, budget=16, prefix_store=store, shared_prefix_length=30):
        steps += 1
        assert len(session.token_ids) <= 10 + 16 * steps and exact(model, session)
    assert session.token_ids == prompt[:-1] and exact(model, session)
    assert store.find(prompt[:-1]).token_ids == PROMPT[:30]
    with pytest.raises(ValueError, match="prefix"):
        prefill(model, session, [1, 2, 3])


def test_sliding_crop_only_inside_what_was_recorded(models):
    model = models["sliding"]
    session = CacheSession(models["sliding"])
    rewind_and_prefill(model, session, PROMPT[:40] + [5])  # checkpoint at 40 (the generation start)
    rewind_and_prefill(model, session, PROMPT + [5])  # checkpoint at 60, then the window is trimmed to its last 7 states
    window_kind = session.kinds[0]
    assert window_kind.layer.keys.shape[-2] == SLIDING_WINDOW - 1
    assert not window_kind.can_crop(60, 59)  # would need position 52, which was trimmed
    feed(model, session, [1, 2, 3])  # recorded again from 60 on
    assert window_kind.can_crop(63, 60) and not window_kind.can_crop(63, 59)

    result = rewind_and_prefill(model, session, PROMPT[:59] + [1, 2])
    assert (result.rollback, result.reused_tokens) == ("checkpoint", 40)
    assert exact(model, session)


def test_sliding_memory_stays_bounded_over_many_turns(models):
    model = models["sliding"]
    session = CacheSession(models["sliding"], max_checkpoints=4)
    prompt: list[int] = []
    for turn in range(12):
        prompt = prompt + list(range(40 + turn, 60 + turn))
        rewind_and_prefill(model, session, prompt + [3])
    stored = [kind.layer.keys.shape[-2] for kind in session.kinds]
    assert max(stored) == SLIDING_WINDOW - 1  # not 12 * 20 tokens
    assert len(session.checkpoints) == 4
    assert exact(model, session)


def test_without_checkpoints_recurrent_rollback_rebuilds_and_says_so(models):
    model = models["hybrid"]
    session = CacheSession(models["hybrid"], max_checkpoints=0)
    rewind_and_prefill(model, session, PROMPT + [5])
    result = rewind_and_prefill(model, session, PROMPT[:40] + [5])
    assert result.rollback == "rebuild" and result.rebuilt and result.reused_tokens == 0
    assert exact(model, session)


def test_release_frees_everything_and_next_prepare_reports_a_rebuild(models):
    model = models["mixed"]
    session = CacheSession(models["mixed"])
    rewind_and_prefill(model, session, PROMPT + [5])
    assert session.nbytes() > 0
    session.release()
    assert session.nbytes() == 0 and session.token_ids == []
    result = rewind_and_prefill(model, session, PROMPT + [5])
    assert result.rebuilt and result.reused_tokens == 0
    assert exact(model, session)


def test_cache_bytes_count_checkpoints(models):
    model = models["hybrid"]
    session = CacheSession(models["hybrid"])
    rewind_and_prefill(model, session, PROMPT + [5])
    checkpoint_bytes = sum(t.numel() * t.element_size() for t in session.checkpoints.tensors())
    assert len(session.checkpoints) >= 1 and checkpoint_bytes > 0
    cache_only = sum(t.numel() * t.element_size() for k in session.kinds for t in k.tensors())
    assert session.nbytes() >= cache_only + checkpoint_bytes


def test_checkpoint_store_keeps_recent_ones_dense_and_old_ones_spread():
    store = CheckpointStore(max_checkpoints=6)
    for position in range(10, 400, 10):
        store.add(Checkpoint(position, []))
    positions = store.positions()
    assert len(positions) == 6 and positions[-4:] == [360, 370, 380, 390]  # the newest four
    gaps = [b - a for a, b in zip([0] + positions, positions[:3])]
    assert max(gaps) <= 2 * min(gaps)  # the older ones spread evenly back towards the start


def test_checkpoint_store_forgets_replaced_positions():
    store = CheckpointStore(max_checkpoints=2)
    for position in (10, 20, 30):
        store.add(Checkpoint(position, [torch.zeros(1)]))
    assert store.positions() == [20, 30]
    assert store.latest_at_or_before(25).position == 20
    assert store.latest_at_or_before(15) is None
    store.drop_after(25)
    assert store.positions() == [20]
    store.add(Checkpoint(15, []))  # a new branch at 15 replaces what came after it
    assert store.positions() == [15]


@pytest.mark.parametrize("arch", ARCHS)
def test_the_logits_after_a_prompt_are_kept_while_the_cache_holds_it(models, arch):
    """`keep_next_logits` holds the logits after a prompt the cache holds whole, where every layer
    crops anywhere (else nothing: a window or a recurrent state would need a checkpoint after it);
    `next_logits` gives them only while the ledger starts with that prompt, and only then may a
    `whole` rollback keep the prompt to its end. They count in the session's bytes."""
    model = models[arch]
    session = CacheSession(models[arch])
    prompt, logits = PROMPT[:20], torch.randn(1, models[arch].config.vocab_size)
    rewind_and_prefill(model, session, prompt)  # holds all but the last token
    session.keep_next_logits(prompt, logits)
    assert session.next_logits(prompt) is None  # the cache does not hold the whole prompt
    feed(model, session, prompt[-1:])
    before = session.nbytes()
    session.keep_next_logits(prompt, logits)
    if not session.crops_anywhere():
        assert session.next_logits(prompt) is None and session.rollback_target(prompt, whole=True) == 19
        return
    assert torch.equal(session.next_logits(prompt), logits) and session.next_logits(prompt[:-1]) is None
    assert session.nbytes() == before + logits.numel() * logits.element_size()
    feed(model, session, [7, 8])  # a reply after it: the prompt still held
    assert session.rollback_target(prompt, whole=True) == 20 and session.rollback_target(prompt) == 19
    session.rewind_to(prompt, whole=True)
    assert session.token_ids == prompt and exact(model, session)
    session.rollback_to(10)  # another turn parted inside it: not held, not used
    assert session.next_logits(prompt) is None and session.rollback_target(prompt, whole=True) == 10
    session.release()
    assert session.next_logits(prompt) is None
