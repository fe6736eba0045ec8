"""Full-attention states grown in place (cache_sessions/growing.py): checked against an independent
reference, a plain list of per-position states, under any mix of updates, crops, segments put
back, device moves and pickling; and checked to really write in place (no copy per token)."""

import pickle

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cache_sessions.growing import GrowingLayer, spare_tokens
from cache_sessions.kv_cache import KVCacheKind
from cache_sessions.rollback import FullAttention
from chat.models import build_model

HEADS, DIM = 2, 4


def states(count: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(1, HEADS, count, DIM, generator=generator),
            torch.randn(1, HEADS, count, DIM, generator=generator))


def stacked(reference: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    if not reference:
        return torch.empty(1, HEADS, 0, DIM), torch.empty(1, HEADS, 0, DIM)
    return torch.cat([k for k, _ in reference], dim=-2), torch.cat([v for _, v in reference], dim=-2)


operations = st.lists(st.one_of(
    st.tuples(st.just("update"), st.integers(1, 40)),
    st.tuples(st.just("crop"), st.integers(0, 60)),
    st.tuples(st.just("append"), st.integers(1, 20)),  # a segment or a batch's rows put back
    st.tuples(st.just("move"), st.just(0)),  # a device move: the layer adopts what it is given
    st.tuples(st.just("pickle"), st.just(0)),  # the cold tier's round trip
    st.tuples(st.just("assign"), st.integers(0, 30)),  # keys set from outside (the library's own helpers do)
), min_size=1, max_size=25)


@settings(max_examples=150, deadline=None)
@given(operations)
def test_a_growing_layer_holds_exactly_what_was_fed_whatever_the_operations(ops):
    layer, reference = GrowingLayer(), []
    kind = FullAttention(layer)
    for step, (op, n) in enumerate(ops):
        held = len(reference)
        if op == "update":
            keys, values = states(n, step)
            returned = layer.update(keys, values)
            reference += [(keys[..., i : i + 1, :], values[..., i : i + 1, :]) for i in range(n)]
            # what attention reads: exactly the held positions, never the spare room
            assert all(torch.equal(a, b) for a, b in zip(returned, stacked(reference)))
        elif op == "crop" and layer.is_initialized:
            target = min(n, held)
            kind.crop(held, target)
            del reference[target:]
        elif op == "append":
            keys, values = states(n, 1000 + step)
            kind.append_states(keys, values)
            reference += [(keys[..., i : i + 1, :], values[..., i : i + 1, :]) for i in range(n)]
        elif op == "move" and layer.is_initialized:
            kind.to("cpu")  # held as given (here: the same views), buffers dropped, adopted at the next update
            assert layer._key_buffer is None
        elif op == "assign" and layer.is_initialized:
            keys, values = states(n, 2000 + step)
            layer.keys, layer.values = keys, values
            reference = [(keys[..., i : i + 1, :], values[..., i : i + 1, :]) for i in range(n)]
        elif op == "pickle":
            layer = pickle.loads(pickle.dumps(layer))
            kind = FullAttention(layer)
        if layer.is_initialized:
            assert layer.get_seq_length() == len(reference)
            keys, values = stacked(reference)
            assert torch.equal(layer.keys, keys) and torch.equal(layer.values, values)


def test_decode_steps_write_in_place_and_grow_in_chunks():
    layer = GrowingLayer()
    layer.update(*states(1000, 0))
    buffers = {layer.keys.data_ptr()}
    for step in range(1000):
        layer.update(*states(1, step + 1))
        buffers.add(layer.keys.data_ptr())
    # 1000 tokens past 1000: a new buffer only every spare_tokens(length) tokens (125 to 250)
    assert 1 < len(buffers) <= 1 + 1000 // spare_tokens(1000)
    assert layer.get_seq_length() == 2000
    assert layer._key_buffer.shape[-2] - 2000 <= spare_tokens(2000) + 1


def test_a_crop_then_new_tokens_overwrite_the_old_ones_in_the_same_buffer():
    layer = GrowingLayer()
    keys, values = states(30, 0)
    layer.update(keys, values)
    buffer = layer._key_buffer
    FullAttention(layer).crop(30, 10)
    new_keys, new_values = states(5, 1)
    layer.update(new_keys, new_values)
    assert layer._key_buffer is buffer  # no reallocation: written in place over the dropped states
    assert torch.equal(layer.keys, torch.cat([keys[..., :10, :], new_keys], dim=-2))
    assert torch.equal(layer.values, torch.cat([values[..., :10, :], new_values], dim=-2))


def test_a_segment_cut_before_a_crop_survives_the_overwrite():
    """Segments (kept branches) are copies: the in-place writes after a rollback cannot touch them."""
    layer = GrowingLayer()
    kind = FullAttention(layer)
    keys, values = states(20, 0)
    layer.update(keys, values)
    segment = kind.cut_segment(8, 20)
    kind.crop(20, 8)
    layer.update(*states(12, 1))  # the other branch, written over positions 8..20 of the buffer
    assert torch.equal(segment[0], keys[..., 8:20, :]) and torch.equal(segment[1], values[..., 8:20, :])


def test_moving_to_another_device_drops_the_old_buffers_at_once():
    layer = GrowingLayer()
    layer.update(*states(10, 0))
    FullAttention(layer).to("meta")
    assert layer._key_buffer is None and layer.keys.device.type == "meta"


def test_the_cache_of_a_model_grows_its_full_attention_layers_only():
    for name, growing in (("tiny-full", [True, True]), ("tiny-mixed", [False, True, False, True]),
                          ("tiny-hybrid", [False, True, False, True])):
        model = build_model(name, 64, 0)
        cache = KVCacheKind().new_cache(model)
        assert [isinstance(layer, GrowingLayer) for layer in cache.layers] == growing, name
