"""Loading a model and tokenizer: a hub id, a local folder, or the offline `demo`."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from chat.demo import ensure_demo_saved
from chat.errors import ModelLoadError

DEMO = "demo"


def pick_device() -> str:
    if torch.cuda.is_available():
        return "cuda"
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def pick_dtype(device: str) -> torch.dtype:
    if device.startswith("cuda"):
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if device.startswith("mps"):
        return torch.float16
    return torch.float32


def _dtype_from_name(dtype: str | torch.dtype | None, device: str) -> torch.dtype:
    if dtype is None or dtype == "auto":
        return pick_dtype(device)
    if isinstance(dtype, torch.dtype):
        return dtype
    value = getattr(torch, str(dtype), None)
    if not isinstance(value, torch.dtype):
        raise ModelLoadError(f"unknown dtype {dtype!r}")
    return value


def load_model_and_tokenizer(name_or_path: str, *, device: str | None = None,
                             dtype: str | torch.dtype | None = None) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """`from_pretrained` on both, with device and dtype chosen for this machine unless given."""
    device = device or pick_device()
    torch_dtype = _dtype_from_name(dtype, device)
    source = str(ensure_demo_saved()) if name_or_path == DEMO else name_or_path
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
    except Exception as error:  # the causes are many (offline, not found, gated); one line says which
        raise ModelLoadError(f"cannot load the tokenizer of {name_or_path!r}: {_one_line(error)}") from error
    if not tokenizer.chat_template:
        raise ModelLoadError(f"{name_or_path!r} has no chat template: use a chat (instruct) model")
    try:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype, device_map=device)
    except ValueError as error:
        raise ModelLoadError(f"{name_or_path!r} is not a causal language model: {_one_line(error)}") from error
    except Exception as error:
        raise ModelLoadError(f"cannot load the model {name_or_path!r}: {_one_line(error)}") from error
    model.eval()
    return model, tokenizer


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return text[:300] + ("…" if len(text) > 300 else "") or type(error).__name__
