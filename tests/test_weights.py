"""`--weights int8` (chat/model_step/weights.py): linear weights in int8 with a scale per output channel.
The layer is checked against a float64 product with the weight rounded by hand; exact rollback
against plain `generate` on the same quantized model (tests/reference.py), every operation, every
layer mix, alone and batched. `--weights packed` (the fp32 weights in oneDNN's layout): the layer
against a float64 product, and every operation held to the fp32 references."""

import threading

import pytest
import torch
from conftest import THINKING_TEMPLATE
from reference import (INT8_LOGIT_TOLERANCE, check_exact, check_near_greedy, check_states, decode_together,
                       int8_logit_tolerance, scratch_greedy_reply)
from test_exactness import MAX_NEW, drain, every_operation
from tiny_models import ARCHS, build_model
from torch import nn

from cache_sessions import CacheSession
from chat import ChatEngine
from chat.config import EngineConfig
import chat.model_step.weights
from chat.model_step.weights import AUTO_PROBE_ROWS, PROMPT_KERNELS, Int8Linear, PackedLinear, apply_weight_format, choose_weight_format
from chat.model_step.feeding import rewind_and_prefill


@pytest.mark.parametrize("in_features", [96, 36])  # 36: not a width the kernel takes (the prompt path only)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, Int8Linear.KERNEL_ROWS, Int8Linear.KERNEL_ROWS + 5])
@pytest.mark.parametrize("prompt_kernel", PROMPT_KERNELS)
def test_the_layer_is_the_product_of_int8_weights_and_bf16_inputs(dtype, in_features, rows, prompt_kernel,
                                                                   monkeypatch):
    """Row r of the weight becomes the nearest multiples of a bf16 scale near max|w_r| / 127, the
    input is rounded to bf16; their product (plus the bias), computed here in float64 and rounded
    to bf16 as the layer's products are, is the layer's output, through the kernel (few rows) and
    the prompt path (more) alike: within one bf16 step of its value (fp32 sums), or with the
    "bf16" prompt product, of the sum of its terms' magnitudes (partial sums rounded to bf16)."""
    generator = torch.Generator().manual_seed(0)
    linear = nn.Linear(in_features, 40).to(dtype)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(40, in_features, generator=generator) * 0.3)
        linear.weight[3] = 0.0  # a row of zeros: no division by zero
    weight = linear.weight.detach().double()
    layer = Int8Linear(linear)
    layer.prompt_kernel = prompt_kernel
    levels, scales = layer.weight_int8.double(), layer.scales.double()[:, None]
    assert layer.weight_int8.dtype == torch.int8 and levels.shape == (40, in_features) and levels.abs().max() == 127
    assert layer.scales.dtype == torch.bfloat16
    assert torch.allclose(scales.squeeze(1), weight.abs().amax(dim=1) / 127, rtol=2**-8)  # a bf16 step
    # each the nearest level of its scale (bf16 weights can sit on a tie: either neighbour then)
    assert ((weight / scales.clamp(min=1e-30) - levels).abs() <= 0.5 + 1e-3).all() and (levels[3] == 0).all()
    hidden = torch.randn(rows, in_features, generator=generator).to(dtype)
    hidden[-1] = 0.0  # a token of zeros
    expected = (hidden.bfloat16().double() @ (levels * scales).T).to(torch.bfloat16).double() + linear.bias.double()
    got = layer(hidden)
    assert got.shape == (rows, 40) and got.dtype == dtype
    atol = 1e-2 if dtype == torch.bfloat16 else 1e-6  # the bias's own rounding in bf16
    if prompt_kernel == "bf16" and (rows > Int8Linear.KERNEL_ROWS or not layer.kernel_fits):
        magnitudes = hidden.bfloat16().double().abs() @ (levels * scales).abs().T
        assert ((got.double() - expected).abs() <= 2**-7 * magnitudes + atol).all()
    else:  # one bf16 step of the products (their sums' order differs)
        torch.testing.assert_close(got.double(), expected, rtol=2**-7, atol=atol)
    assert (got[-1] == linear.bias).all()
    # the few-row path gives the same as the many-row one, row by row
    alone = torch.cat([layer(hidden[row:row + 1]) for row in range(rows)])
    if prompt_kernel == "fp32" or rows <= Int8Linear.KERNEL_ROWS and layer.kernel_fits:
        torch.testing.assert_close(alone.double(), got.double(), rtol=2**-7, atol=1e-6)


@pytest.mark.parametrize("in_features", [96, 36])
def test_a_compiled_one_row_product_is_the_same_product_of_int8_weights(in_features, monkeypatch):
    """Traced for one row (the compiled one-row decode step), the layer multiplies through
    `one_row_product`, the sum inductor fuses: the input as it is (not rounded to bf16) times the
    int8 weight, within fp32's sum noise of that product in float64, at widths the eager kernel
    does not take too; and within one bf16 step of the eager layer (whose input is rounded)."""
    import chat.model_step.weights
    traced = []
    product = chat.model_step.weights.one_row_product
    monkeypatch.setattr(chat.model_step.weights, "one_row_product", lambda *args: traced.append(1) or product(*args))
    generator = torch.Generator().manual_seed(1)
    linear = nn.Linear(in_features, 40)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(40, in_features, generator=generator) * 0.3)
    layer = Int8Linear(linear)
    hidden = torch.randn(1, in_features, generator=generator)
    got = torch.compile(layer, fullgraph=True, dynamic=False)(hidden)
    assert traced, "the compiled one-row product did not take one_row_product"
    levels, scales = layer.weight_int8.double(), layer.scales.double()[:, None]
    expected = hidden.double() @ (levels * scales).T + linear.bias.double()
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
    eager = layer(hidden)  # the kernel (or, at 36, the prompt path): the input rounded to bf16
    magnitudes = hidden.double().abs() @ (levels * scales).abs().T
    assert ((eager.double() - got.double()).abs() <= 2**-7 * magnitudes + 1e-5).all()


def quantized_model(arch, tokenizer):
    """A model of its own (the shared fixtures stay full), quantized as the engine does it."""
    model = build_model(arch, len(tokenizer), tokenizer.convert_tokens_to_ids("<|im_end|>"))
    apply_weight_format(model, "int8")
    assert not any(type(module) is nn.Linear for module in model.modules())
    assert isinstance(model.get_output_embeddings(), Int8Linear)
    return model


@pytest.mark.parametrize("in_features,out_features", [(1024, 3072), (3072, 1024), (256, 96)])
def test_an_int8_layer_gives_a_row_the_same_bits_whatever_rows_are_beside_it(in_features, out_features):
    """What lets guesses be verified with the bits of decode steps (chat/model_step/plain_step.py,
    `alone`): up to `KERNEL_ROWS` rows, each row of a product is the product of that row alone, to
    the bit; and the model-level check says so for int8 layers only."""
    linear = nn.Linear(in_features, out_features, bias=False)
    layer = Int8Linear(linear)
    rows = torch.randn(Int8Linear.KERNEL_ROWS, in_features, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        alone = torch.cat([layer(rows[index:index + 1]) for index in range(len(rows))])
        for count in range(2, Int8Linear.KERNEL_ROWS + 1):
            assert torch.equal(layer(rows[:count]), alone[:count]), count
    assert chat.model_step.weights.products_keep_rows_apart(nn.Sequential(layer))
    assert not chat.model_step.weights.products_keep_rows_apart(nn.Sequential(layer, linear))
    assert not chat.model_step.weights.products_keep_rows_apart(nn.Sequential(PackedLinear(linear)))


def test_the_runner_keeps_rows_apart_for_eager_int8_steps_only(tokenizers):
    """Guesses attending alone, and a last prompt piece held to the kernel's rows, buy exactness
    only where every step is the plain one, eager, with int8 weights: a compiled one-row step sums
    in its own order, and the model's own forward attends a row in one call."""
    from chat.model_step.compiled import CompiledDecode
    from cache_sessions.kv_cache import KVCacheKind
    from chat.model_step.runner import ModelRunner

    tokenizer = tokenizers[THINKING_TEMPLATE]
    model = build_model("full", len(tokenizer), None)
    assert ModelRunner(model).rows_apart is None
    apply_weight_format(model, "int8")
    assert ModelRunner(model).rows_apart == Int8Linear.KERNEL_ROWS
    assert ModelRunner(model, CompiledDecode(model, "off")).rows_apart == Int8Linear.KERNEL_ROWS
    assert ModelRunner(model, CompiledDecode(model, "on")).rows_apart is None
    assert ModelRunner(model, kv_cache=KVCacheKind("quantized", 8)).rows_apart is None  # the model's own forward


@pytest.mark.parametrize("arch,prompt_kernel", [(arch, "fp32") for arch in ARCHS]
                         + [(arch, "bf16") for arch in ARCHS if arch != "hybrid"])  # (recurrent: fp32 only)
def test_every_operation_is_exact_for_the_model_as_quantized(tokenizers, arch, prompt_kernel):
    """Either prompt product (the host's choice, `choose_prompt_kernel`), held to its own bound."""
    tokenizer = tokenizers[THINKING_TEMPLATE]
    model = build_model(arch, len(tokenizer), tokenizer.convert_tokens_to_ids("<|im_end|>"))
    engine = ChatEngine(model, tokenizer, weights="int8")  # quantizes `model` in place
    assert isinstance(model.get_output_embeddings(), Int8Linear)
    for module in model.modules():
        if isinstance(module, Int8Linear):
            module.prompt_kernel = prompt_kernel
    tolerance = int8_logit_tolerance(model)
    conv = engine.conversation("You are terse.")
    every_operation(conv, lambda **kwargs: check_exact(conv, model, tokenizer, max_new_tokens=MAX_NEW,
                                                       logit_tolerance=tolerance, near_greedy=True, **kwargs))


@pytest.mark.parametrize("arch", ARCHS)
def test_batched_rows_decode_as_each_would_alone(tokenizers, arch):
    model = quantized_model(arch, tokenizers[THINKING_TEMPLATE])
    model.generation_config.eos_token_id = None  # a random model may say end-of-turn: keep going
    prompts = [list(range(30, 42)), list(range(50, 75)), list(range(90, 130))]
    sessions = []
    for prompt in prompts:
        sessions.append(CacheSession(model))
        rewind_and_prefill(model, sessions[-1], prompt)
    replies = decode_together(model, sessions, [p[-1] for p in prompts], 8)
    for session, prompt, reply in zip(sessions, prompts, replies):
        check_near_greedy(model, prompt, reply, int8_logit_tolerance(model))
        assert session.token_ids == prompt + reply[:-1]
        check_states(model, session.cache, session.token_ids, logit_tolerance=int8_logit_tolerance(model))


def test_the_prompt_product_is_chosen_by_timing_each_on_this_host(tokenizers):
    engine = ChatEngine(quantized_model("full", tokenizers[THINKING_TEMPLATE]), tokenizers[THINKING_TEMPLATE],
                        weights="int8")
    weights = engine.status()["weights"]
    timed = weights["int8_prompt_kernels_timed"]
    assert set(timed["ms"]) == set(PROMPT_KERNELS) and all(ms > 0 for ms in timed["ms"].values())
    assert timed["chosen"] == min(timed["ms"], key=timed["ms"].get) == weights["int8_prompt_kernel"]
    hybrid = ChatEngine(quantized_model("hybrid", tokenizers[THINKING_TEMPLATE]), tokenizers[THINKING_TEMPLATE],
                        weights="int8")
    assert hybrid.status()["weights"]["int8_prompt_kernel"] == "fp32"  # recurrent layers keep fp32 sums


def test_a_second_application_changes_nothing(tokenizers):
    model = quantized_model("full", tokenizers[THINKING_TEMPLATE])
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    apply_weight_format(model, "int8")
    assert all(torch.equal(before[name], tensor) for name, tensor in model.state_dict().items())


def test_unknown_formats_and_models_it_cannot_take_are_refused(tokenizers):
    with pytest.raises(ValueError, match="weights is one of auto, full, packed, int8, not 'int4'"):
        EngineConfig(weights="int4")
    model = build_model("full", len(tokenizers[THINKING_TEMPLATE]), None).to(torch.float16)
    with pytest.raises(ValueError, match="int8 weights take a float32 or bfloat16 model, not torch.float16"):
        apply_weight_format(model, "int8")
    assert not any(isinstance(module, Int8Linear) for module in model.modules())  # left as it was


def test_the_near_greedy_reference_refuses_a_reply_to_another_prompt(tokenizers):
    """The int8 tests' reply check has teeth: a reply greedy for one prompt is not near-greedy
    for another (what a stale state would make)."""
    model = quantized_model("full", tokenizers[THINKING_TEMPLATE])
    model.generation_config.eos_token_id = None
    prompt, other = list(range(30, 60)), list(range(31, 61))
    reply = scratch_greedy_reply(model, prompt, 12, set())
    check_near_greedy(model, prompt, reply, INT8_LOGIT_TOLERANCE)
    with pytest.raises(AssertionError, match="below the top"):
        check_near_greedy(model, other, reply, INT8_LOGIT_TOLERANCE)


@pytest.mark.parametrize("in_features", [96, 37])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", [1, 3, 40])
def test_a_packed_layer_is_the_fp32_product_of_the_same_weights(in_features, bias, rows):
    """The packed layer's output is the float64 product of the layer's own weights within fp32
    noise, for any row count, a batch of sequences and a strided (transposed) input alike."""
    generator = torch.Generator().manual_seed(1)
    linear = nn.Linear(in_features, 24, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(24, in_features, generator=generator))
    layer = PackedLinear(linear)
    assert "weight_packed" not in layer.state_dict()  # it has no storage to save
    hidden = torch.randn(rows, in_features, generator=generator)
    expected = hidden.double() @ linear.weight.detach().double().T
    if bias:
        expected = expected + linear.bias.detach().double()
    got = layer(hidden)
    assert got.shape == (rows, 24) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(layer(hidden.view(1, rows, in_features))[0], got, rtol=1e-5, atol=1e-4)
    strided = hidden.T.contiguous().T
    assert not strided.is_contiguous() or rows == 1
    torch.testing.assert_close(layer(strided), got, rtol=1e-5, atol=1e-4)
    # another input gives another output: the product is of this input, not a cached one
    assert not torch.allclose(layer(hidden + 1), got)


@pytest.mark.parametrize("arch", ["full", "hybrid"])
def test_every_operation_with_packed_weights_is_exact(tokenizers, arch):
    """Packed weights are the fp32 weights: held to the fp32 references (states within 1e-4 of a
    from-scratch forward, replies equal to greedy `generate`'s), on the model as packed."""
    tokenizer = tokenizers[THINKING_TEMPLATE]
    model = build_model(arch, len(tokenizer), tokenizer.convert_tokens_to_ids("<|im_end|>"))
    engine = ChatEngine(model, tokenizer, weights="packed")  # packs `model` in place
    assert isinstance(model.get_output_embeddings(), PackedLinear)
    assert not any(type(module) is nn.Linear for module in model.modules())
    conv = engine.conversation("You are terse.")
    every_operation(conv, lambda **kwargs: check_exact(conv, model, tokenizer, max_new_tokens=MAX_NEW, **kwargs))


def test_packed_weights_refuse_a_model_they_do_not_take(tokenizers):
    model = build_model("full", len(tokenizers[THINKING_TEMPLATE]), None).to(torch.bfloat16)
    with pytest.raises(ValueError, match="packed weights take a float32 model, not torch.bfloat16"):
        apply_weight_format(model, "packed")
    assert not any(isinstance(module, PackedLinear) for module in model.modules())  # left as it was


def slowed(monkeypatch, layer_class: type, seconds: float) -> None:
    """Every product of `layer_class` takes `seconds` longer: a stand-in for a host whose kernel
    for that format is the slower one."""
    import time

    own = layer_class.forward

    def slow(self, hidden):
        time.sleep(seconds)
        return own(self, hidden)
    monkeypatch.setattr(layer_class, "forward", slow)


@pytest.mark.parametrize("slower,chosen", [(nn.Linear, "packed"), (PackedLinear, "full")])
def test_auto_weights_take_the_format_this_host_multiplies_faster(tokenizers, monkeypatch, slower, chosen):
    """"auto" times both formats on the model's widest layer at each probe's rows and takes the
    faster: with one format's products made slower by hand, the other is chosen, applied, and
    shown in /status with what was timed. The replies stay exact on the model as chosen."""
    monkeypatch.setattr(chat.model_step.weights, "_WEIGHT_CHOICES", {})  # this process's earlier timing aside
    slowed(monkeypatch, slower, 0.003)
    tokenizer = tokenizers[THINKING_TEMPLATE]
    model = build_model("full", len(tokenizer), tokenizer.convert_tokens_to_ids("<|im_end|>"))
    engine = ChatEngine(model, tokenizer, weights="auto")
    monkeypatch.undo()  # the replies below at full speed
    weights = engine.status()["weights"]
    assert weights["format"] == chosen and weights["asked"] == "auto"
    timed = weights["auto_timed"]
    assert timed["chosen"] == chosen and set(timed["ms"]) == {"full", "packed"}
    assert all(set(ms) == {str(rows) for rows in AUTO_PROBE_ROWS} for ms in timed["ms"].values())
    assert any(isinstance(module, PackedLinear) for module in model.modules()) == (chosen == "packed")
    conv = engine.conversation("You are terse.")
    for message in ("What is 2 + 2?", "And 3 + 3?"):
        drain(conv.send(message, max_new_tokens=MAX_NEW, do_sample=False))
        check_exact(conv, model, tokenizer, max_new_tokens=MAX_NEW)


def test_auto_weights_stay_as_loaded_where_packing_does_not_apply(tokenizers):
    """A model not in float32 (or not on the CPU) is not timed: its weights stay as loaded, and
    /status says why. The app asks for "auto" by default; the library keeps a caller's model as
    it is unless asked."""
    from ui.config import AppConfig

    model = build_model("full", len(tokenizers[THINKING_TEMPLATE]), None).to(torch.bfloat16)
    choice = choose_weight_format(model)
    assert choice == {"chosen": "full", "because": "packed weights take a float32 model, not torch.bfloat16"}
    assert AppConfig.from_args([], environ={}).weights == "auto" and EngineConfig().weights == "full"


def test_auto_leaves_a_head_tied_to_the_embedding_shared(tokenizers, monkeypatch):
    """Packed by "auto", a model whose head shares the embedding's weight keeps that head as
    loaded (its own packed copy would hold the weight twice); asked by name, "packed" packs it.
    The replies stay exact either way."""
    from chat.models import build_model as build_named

    monkeypatch.setattr(chat.model_step.weights, "_WEIGHT_CHOICES", {})
    slowed(monkeypatch, nn.Linear, 0.003)  # so "auto" packs
    tokenizer = tokenizers[THINKING_TEMPLATE]
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    tied = build_named("demo", len(tokenizer), end)  # Qwen3 with tie_word_embeddings, as the real 0.6B
    assert tied.get_output_embeddings().weight is tied.get_input_embeddings().weight
    engine = ChatEngine(tied, tokenizer, weights="auto")
    monkeypatch.undo()
    assert engine.status()["weights"]["format"] == "packed"
    head = tied.get_output_embeddings()
    assert type(head) is nn.Linear and head.weight is tied.get_input_embeddings().weight
    assert [type(module) for module in tied.modules() if isinstance(module, (nn.Linear, PackedLinear))].count(
        nn.Linear) == 1  # every other layer packed
    conv = engine.conversation("You are terse.")
    drain(conv.send("What is 2 + 2?", max_new_tokens=MAX_NEW, do_sample=False))
    check_exact(conv, tied, tokenizer, max_new_tokens=MAX_NEW)
    by_name = apply_weight_format(build_named("demo", len(tokenizer), end), "packed")
    assert isinstance(by_name.get_output_embeddings(), PackedLinear)


@pytest.mark.parametrize("weights", ["auto", "int8"])
def test_the_engine_times_and_converts_its_weights_on_its_compute_thread(tokenizers, monkeypatch, weights):
    """Every torch operation of an engine runs on its compute thread (chat/scheduling/worker.py), the weights'
    timing and conversion too: run on the caller's thread, their parallel products left that thread
    an OpenMP pool for the life of the process, and with more pooled threads than cores libgomp
    stops spinning between parallel regions, which made the model thread's steps 1.5-2x slower."""
    import chat.engine

    threads: list[str] = []
    for name in ("choose_weight_format", "apply_weight_format"):
        original = getattr(chat.engine, name)
        monkeypatch.setattr(chat.engine, name, lambda *args, original=original, **kwargs: (
            threads.append(threading.current_thread().name), original(*args, **kwargs))[1])
    tokenizer = tokenizers[THINKING_TEMPLATE]
    engine = ChatEngine(build_model("full", len(tokenizer), None), tokenizer, weights=weights)
    assert len(threads) == (2 if weights == "auto" else 1)
    caller = threading.current_thread().name
    assert engine.runtime.scheduler.worker is not None
    assert all(name.startswith("model-") and name != caller for name in threads), threads  # ModelWorker's threads
