"""Loading: the demo through the real `from_pretrained` path, device/dtype choice, clear errors."""

import pytest
import torch

from chat import ChatEngine, ModelLoadError
from chat import loading


def test_the_demo_loads_through_from_pretrained_and_does_arithmetic():
    """The committed demo model (chat/assets/demo): a real Qwen3 folder, the Qwen3 template with
    thinking, and held-out sums it never saw in training, answered greedily from the weights."""
    import random

    from demo_model.corpus import first_problem, question_text

    engine = ChatEngine.load("demo", device="cpu")
    assert engine.model.dtype == torch.float32  # stored in half precision, computed in fp32 on the CPU
    assert engine.template.reads_reasoning_content
    rng, right = random.Random(7), 0
    problems = [first_problem(rng, evaluation=True) for _ in range(12)]
    for problem in problems:
        conv = engine.conversation("You are a helpful assistant.")
        list(conv.send(question_text(rng, problem), max_new_tokens=200, do_sample=False))
        reply = conv.messages[-1]
        assert "</think>" not in reply["content"] and reply["reasoning_content"]  # thought, then answered
        right += str(problem.result) in reply["content"]
    assert right >= 9, f"{right} of {len(problems)} held-out questions right"


def test_missing_folder_is_one_clear_line(tmp_path):
    with pytest.raises(ModelLoadError) as error:
        ChatEngine.load(str(tmp_path / "no-such-model"), device="cpu")
    assert "\n" not in str(error.value) and "no-such-model" in str(error.value) and "no such folder" in str(error.value)


def test_not_a_causal_lm_is_refused(tmp_path, base_tokenizer):
    from transformers import T5Config, T5Model

    T5Model(T5Config(vocab_size=64, d_model=16, d_ff=32, num_layers=1, num_heads=2, d_kv=8)).save_pretrained(tmp_path)
    base_tokenizer.save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="not a causal language model"):
        ChatEngine.load(str(tmp_path), device="cpu")


def test_model_without_chat_template_is_refused(tmp_path, base_tokenizer):
    import copy

    tokenizer = copy.deepcopy(base_tokenizer)
    tokenizer.chat_template = None
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="no chat template"):
        ChatEngine.load(str(tmp_path), device="cpu")


def test_automatic_dtype_per_device(monkeypatch):
    assert loading.pick_dtype("cpu") == torch.float32
    assert loading.pick_dtype("mps") == torch.float16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert loading.pick_dtype("cuda") == torch.bfloat16
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert loading.pick_device() in ("cpu", "mps")


def test_a_hub_id_that_cannot_be_fetched_fails_in_one_line(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError) as error:  # (offline: no network call to wait on)
        ChatEngine.load("nobody-here/no-such-model-xyz", device="cpu")
    assert "\n" not in str(error.value) and "HF_HUB_OFFLINE" in str(error.value)
