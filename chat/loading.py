"""Loading a model and tokenizer: a hub id, a local folder, or the offline `demo`."""

from __future__ import annotations

import os
import socket

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from chat.demo import demo_folder
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
    source = str(demo_folder()) if name_or_path == DEMO else name_or_path
    _check_reachable(source)
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


def _check_reachable(source: str) -> None:
    """Fail in one line, at once, where `from_pretrained` would fail late or obscurely: a folder
    that is not there, or a hub id neither cached nor downloadable (it retries for a minute)."""
    looks_like_path = os.path.isabs(source) or source.startswith((".", "~")) or os.sep + os.sep in source
    if os.path.isdir(os.path.expanduser(source)):
        return
    if looks_like_path or source.count("/") > 1:
        raise ModelLoadError(f"cannot load {source!r}: no such folder (--model takes an existing local folder, "
                             "or a hub id such as Qwen/Qwen3-0.6B)")
    from huggingface_hub import try_to_load_from_cache

    if isinstance(try_to_load_from_cache(source, "config.json"), str):
        return  # cached: loads offline
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        raise ModelLoadError(f"cannot load {source!r}: it is not in the local Hugging Face cache and "
                             "HF_HUB_OFFLINE is set (unset it to download, or pass a local folder with --model)")
    try:
        socket.create_connection(("huggingface.co", 443), timeout=3).close()
    except OSError:
        raise ModelLoadError(f"cannot load {source!r}: huggingface.co cannot be reached and the model is not in "
                             "the local cache (check the network, pass a local folder with --model, or set "
                             "HF_HUB_OFFLINE=1 to use cached models only)") from None


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return text[:300] + ("…" if len(text) > 300 else "") or type(error).__name__
