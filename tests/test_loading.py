"""Loading: the demo through the real `from_pretrained` path, device/dtype choice, clear errors."""

import pytest
import torch

from chat import ChatEngine, ModelLoadError
from chat import loading
from chat.demo import build_demo


@pytest.fixture
def demo_home(tmp_path, monkeypatch):
    monkeypatch.setenv("REWIND_CHAT_CACHE", str(tmp_path))
    return tmp_path


def test_demo_is_built_once_saved_and_loaded_with_from_pretrained(demo_home):
    engine = ChatEngine.load("demo", device="cpu")
    folder = demo_home / "demo-v1"
    assert (folder / "config.json").exists() and (folder / "tokenizer.json").exists()
    assert engine.model.dtype == torch.float32
    conv = engine.conversation("You are a demo.")
    deltas = list(conv.send("Hello!", max_new_tokens=8, do_sample=False))
    assert deltas and 1 <= conv.stats.generated_tokens <= 8
    assert engine.template.reads_reasoning_content  # the Qwen3 template with thinking

    reference, _ = build_demo()  # deterministic: a fresh build has the very same weights
    loaded = engine.model.state_dict()
    for name, tensor in reference.state_dict().items():
        assert torch.equal(tensor, loaded[name]), name


def test_missing_folder_is_one_clear_line(tmp_path):
    with pytest.raises(ModelLoadError) as error:
        ChatEngine.load(str(tmp_path / "no-such-model"), device="cpu")
    assert "\n" not in str(error.value) and "no-such-model" in str(error.value)


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
