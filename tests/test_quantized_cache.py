"""`--kv-cache quantized` (cache_sessions/quantized.py, kv_cache.py): full-attention states in 8 or
4 bits, quantized once per token. Exact for a lossy cache means: after any operation the states
equal what feeding the same tokens to an empty cache of the same kind gives, and the replies are
greedy `generate` on such a cache. Checked against those references (tests/reference.py) on every
layer mix, alone and batched; the quantization itself against a plain per-element computation."""

import pytest
import torch

from cache_sessions import CacheSession
from cache_sessions.kv_cache import KVCacheKind
from cache_sessions.quantized import dequantize, quantize
from cache_sessions.tensors import filled_bytes
from chat.config import EngineConfig
from chat.model_step.feeding import rewind_and_prefill
from conftest import THINKING_TEMPLATE
from reference import check_exact, check_states, decode_together, scratch_greedy_reply
from test_exactness import MAX_NEW, drain, every_operation
from tiny_models import ARCHS
from ui.config import AppConfig

KINDS = [KVCacheKind("quantized", 8), KVCacheKind("quantized", 4)]


@pytest.mark.parametrize("dim, group", [(128, 64), (80, 40), (96, 48)])
@pytest.mark.parametrize("bits", [8, 4])
def test_each_value_is_the_nearest_of_its_groups_levels(bits, dim, group):
    """Against a plain computation, element by element: a group's levels are minimum + k * scale,
    k in 0..2**bits - 1, with scale = (max - min) / (2**bits - 1); each value dequantizes to the
    nearest level. Heads of 80 or 96 channels (Phi-2, Phi-3-mini) group by 40 or 48."""
    generator = torch.Generator().manual_seed(bits)
    states = torch.randn(1, 2, 5, dim, generator=generator) * 3
    states[0, 0, 0, :group] = 1.5  # a constant group
    codes, scales, minimums = quantize(states, bits)
    assert codes.dtype == torch.uint8 and codes.shape[-1] == (dim if bits == 8 else dim // 2)
    assert scales.shape[-1] == dim // group
    back = dequantize(codes, scales, minimums, bits, torch.float32)
    levels = 2**bits - 1
    for head in range(2):
        for position in range(5):
            for start in range(0, dim, group):
                values = states[0, head, position, start : start + group].tolist()
                low, high = min(values), max(values)
                step = (high - low) / levels
                for value, got in zip(values, back[0, head, position, start : start + group].tolist()):
                    nearest = low if step == 0 else low + round((value - low) / step) * step
                    assert abs(got - nearest) <= 1e-5 * max(1.0, abs(value))


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: f"{k.bits}bit")
def test_heads_of_80_channels_reply_as_a_fresh_cache_of_the_kind(tokenizers, kind):
    """A Qwen3 with 80-channel heads (Phi-2's and StableLM's width) on the quantized cache: every
    reply failed at its first forward; now it is the reference's (greedy on a fresh cache of the
    kind, states equal)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from chat import ChatEngine

    tokenizer = tokenizers[THINKING_TEMPLATE]
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                         head_dim=80, initializer_range=0.2, max_position_embeddings=2048)).eval()
    conv = ChatEngine(model, tokenizer, kv_cache=kind.name, kv_bits=kind.bits).conversation("You are terse.")
    for question in ("Hello there?", "And then?"):
        drain(conv.send(question, max_new_tokens=MAX_NEW, do_sample=False))
        check_exact(conv, model, tokenizer, max_new_tokens=MAX_NEW, kv_cache=kind)


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: f"{k.bits}bit")
@pytest.mark.parametrize("arch", ARCHS)
def test_every_operation_matches_a_fresh_cache_of_the_kind(make_engine, models, tokenizers, arch, kind):
    if arch == "sliding":  # no full-attention layer: nothing to quantize, refused with the reason
        with pytest.raises(ValueError, match="applies to full-attention layers, and this model has none"):
            make_engine(arch, kv_cache=kind.name, kv_bits=kind.bits)
        return
    engine = make_engine(arch, kv_cache=kind.name, kv_bits=kind.bits)
    conv = engine.conversation("You are terse.")
    every_operation(conv, lambda **kwargs: check_exact(conv, models[arch], tokenizers[THINKING_TEMPLATE],
                                                       max_new_tokens=MAX_NEW, kv_cache=kind, **kwargs))
    quantized = [layer for layer in conv.session.cache.layers if type(layer).__name__ == "QuantizedLayer"]
    assert quantized and all(layer.bits == kind.bits for layer in quantized)


@pytest.mark.parametrize("arch", ARCHS)
def test_batched_rows_decode_as_each_would_alone(models, arch):
    kind = KVCacheKind("quantized", 4)
    model = models[arch]
    model.generation_config.eos_token_id = None  # a random model may say end-of-turn: keep going
    prompts = [list(range(30, 42)), list(range(50, 75)), list(range(90, 130))]
    try:
        sessions = []
        for prompt in prompts:
            session = CacheSession(model, kv_cache=kind)
            rewind_and_prefill(model, session, prompt)
            sessions.append(session)
        replies = decode_together(model, sessions, [p[-1] for p in prompts], 8)
        for session, prompt, reply in zip(sessions, prompts, replies):
            assert reply == scratch_greedy_reply(model, prompt, len(reply), set(), kv_cache=kind)
            assert session.token_ids == prompt + reply[:-1]
            check_states(model, session.cache, session.token_ids, kind)
    finally:
        model.generation_config.eos_token_id = models["full"].generation_config.pad_token_id


def test_the_states_take_the_bytes_the_format_says(models):
    """Codes (a byte, or half) and a float scale and minimum per 16 channels (tiny heads of 16)."""
    model, prompt = models["full"], list(range(30, 90))
    sizes = {}
    for kind in (KVCacheKind(), *KINDS):
        session = CacheSession(model, kv_cache=kind)
        rewind_and_prefill(model, session, prompt)
        sizes[kind.name + str(kind.bits)] = filled_bytes(session.tensors())
    elements = 2 * 2 * 2 * 16 * (len(prompt) - 1)  # layers x (keys, values) x kv heads x head dim x tokens
    assert sizes["dynamic8"] == elements * 4
    assert sizes["quantized8"] == elements * (1 + 8 / 16)
    assert sizes["quantized4"] == elements * (0.5 + 8 / 16)


def test_refused_kinds_say_why():
    with pytest.raises(ValueError, match="static is not offered: a compiled decode step measured slower"):
        EngineConfig(kv_cache="static")
    with pytest.raises(ValueError, match="offloaded is not offered"):
        EngineConfig(kv_cache="offloaded")
    with pytest.raises(ValueError, match="must be one of dynamic, quantized"):
        EngineConfig(kv_cache="paged")
    with pytest.raises(ValueError, match="--kv-bits must be 8 or 4"):
        EngineConfig(kv_cache="quantized", kv_bits=2)
    config = AppConfig.from_args(["--kv-cache", "quantized", "--kv-bits", "4"], environ={})
    assert (config.kv_cache, config.kv_bits) == ("quantized", 4)
    assert EngineConfig(kv_cache=config.kv_cache, kv_bits=config.kv_bits).kv_cache_kind == KINDS[1]


def test_a_quantized_conversation_goes_to_disk_and_comes_back_exact(make_engine, models, tokenizers, tmp_path):
    kind = KINDS[1]
    engine = make_engine("hybrid", kv_cache=kind.name, kv_bits=kind.bits, cache_dir=str(tmp_path / "cold"))
    model, tokenizer = models["hybrid"], tokenizers[THINKING_TEMPLATE]
    conv = engine.conversation("Be brief.")
    drain(conv.send("Hello there?", max_new_tokens=6, do_sample=False))
    before = engine.scheduler.call(lambda: [t.clone() for t in conv.session.tensors()])
    engine.caches.budget_bytes = 0
    engine.caches.enforce_budget()
    engine.caches.cold_store.flush()  # written beside the loop
    assert conv.session.nbytes() == 0 and engine.caches.stats().cold.sessions == 1
    engine.caches.budget_bytes = None
    engine.scheduler.call(engine.caches.bring_back, conv.session)
    after = engine.scheduler.call(lambda: list(conv.session.tensors()))
    assert len(before) == len(after) and all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(before, after))
    drain(conv.send("And then?", max_new_tokens=6, do_sample=False))
    assert not conv.stats.rebuilt and conv.stats.reused_tokens > 0
    check_exact(conv, model, tokenizer, max_new_tokens=6, kv_cache=kind)
