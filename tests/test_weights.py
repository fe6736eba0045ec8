"""`--weights int8` (chat/weights.py): linear weights in int8 with a scale per output channel.
The layer is checked against a float64 product with the weight rounded by hand; exact rollback
against plain `generate` on the same quantized model (tests/reference.py), every operation, every
layer mix, alone and batched."""

import pytest
import torch
from conftest import THINKING_TEMPLATE
from reference import INT8_LOGIT_TOLERANCE, check_exact, check_states, scratch_greedy_reply
from test_batch import decode
from test_exactness import MAX_NEW, every_operation
from tiny_models import ARCHS, build_model
from torch import nn

from cache_sessions import CacheSession
from chat import ChatEngine
from chat.config import EngineConfig
from chat.weights import Int8Linear, apply_weight_format


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_layer_is_the_product_of_each_side_rounded_to_its_step(dtype):
    """Row r of the weight becomes the nearest multiples of max|w_r| / 127, each token's input
    the nearest multiples of max|x_t| / 127; the product of those (plus the bias), computed here
    in float64, is the layer's output."""
    generator = torch.Generator().manual_seed(0)
    linear = nn.Linear(96, 40).to(dtype)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(40, 96, generator=generator) * 0.3)
        linear.weight[3] = 0.0  # a row of zeros: no division by zero
    weight = linear.weight.detach().double()
    weight_step = weight.abs().amax(dim=1, keepdim=True) / 127
    layer = Int8Linear(linear)
    levels = layer.weight_int8.t().double()
    assert layer.weight_int8.dtype == torch.int8 and levels.shape == (40, 96) and levels.abs().max() == 127
    # each the nearest level (bf16 weights can sit on a tie: either neighbour then)
    assert ((weight / weight_step.clamp(min=1e-30) - levels).abs() <= 0.5 + 1e-4).all() and (levels[3] == 0).all()
    hidden = torch.randn(2, 3, 96, generator=generator).to(dtype)
    hidden[1, 2] = 0.0  # a token of zeros
    inputs = hidden.double().reshape(6, 96)
    input_step = inputs.abs().amax(dim=1, keepdim=True) / 127
    input_levels = torch.round(inputs / input_step.clamp(min=1e-30))
    expected = (input_levels @ levels.T) * input_step * weight_step.T + linear.bias.double()
    got = layer(hidden)
    assert got.shape == (2, 3, 40) and got.dtype == dtype
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=2e-2)  # bf16's output
    torch.testing.assert_close(got.double().reshape(6, 40), expected, **tolerance)


def quantized_model(arch, tokenizer):
    """A model of its own (the shared fixtures stay full), quantized as the engine does it."""
    model = build_model(arch, len(tokenizer), tokenizer.convert_tokens_to_ids("<|im_end|>"))
    apply_weight_format(model, "int8")
    assert not any(type(module) is nn.Linear for module in model.modules())
    assert isinstance(model.get_output_embeddings(), Int8Linear)
    return model


@pytest.mark.parametrize("arch", ARCHS)
def test_every_operation_is_exact_for_the_model_as_quantized(tokenizers, arch):
    tokenizer = tokenizers[THINKING_TEMPLATE]
    model = build_model(arch, len(tokenizer), tokenizer.convert_tokens_to_ids("<|im_end|>"))
    engine = ChatEngine(model, tokenizer, weights="int8")  # quantizes `model` in place
    assert isinstance(model.get_output_embeddings(), Int8Linear)
    conv = engine.conversation("You are terse.")
    every_operation(conv, lambda **kwargs: check_exact(conv, model, tokenizer, max_new_tokens=MAX_NEW,
                                                       logit_tolerance=INT8_LOGIT_TOLERANCE, **kwargs))


@pytest.mark.parametrize("arch", ARCHS)
def test_batched_rows_decode_as_each_would_alone(tokenizers, arch):
    model = quantized_model(arch, tokenizers[THINKING_TEMPLATE])
    model.generation_config.eos_token_id = None  # a random model may say end-of-turn: keep going
    prompts = [list(range(30, 42)), list(range(50, 75)), list(range(90, 130))]
    sessions = []
    for prompt in prompts:
        sessions.append(CacheSession(model))
        sessions[-1].prepare(prompt)
    replies = decode(model, sessions, [p[-1] for p in prompts], 8)
    for session, prompt, reply in zip(sessions, prompts, replies):
        assert reply == scratch_greedy_reply(model, prompt, len(reply), set())
        assert session.token_ids == prompt + reply[:-1]
        check_states(model, session.cache, session.token_ids, logit_tolerance=INT8_LOGIT_TOLERANCE)


def test_a_second_application_changes_nothing(tokenizers):
    model = quantized_model("full", tokenizers[THINKING_TEMPLATE])
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    apply_weight_format(model, "int8")
    assert all(torch.equal(before[name], tensor) for name, tensor in model.state_dict().items())


def test_unknown_formats_and_models_it_cannot_take_are_refused(tokenizers):
    with pytest.raises(ValueError, match="weights is one of full, int8, not 'int4'"):
        EngineConfig(weights="int4")
    model = build_model("full", len(tokenizers[THINKING_TEMPLATE]), None).to(torch.float16)
    with pytest.raises(ValueError, match="int8 weights take a float32 or bfloat16 model, not torch.float16"):
        apply_weight_format(model, "int8")
    assert not any(isinstance(module, Int8Linear) for module in model.modules())  # left as it was
