"""The tiny adversarial test models, one per attention-layer mix (shapes: chat/models.py)."""

from __future__ import annotations

import copy

import torch
from transformers import MistralConfig, MistralForCausalLM, PreTrainedModel, Qwen3Config, Qwen3ForCausalLM

from chat import models
from chat.models import TINY_SLIDING_WINDOW as SLIDING_WINDOW  # noqa: F401  (tests read it)

ARCHS = ("full", "sliding", "mixed", "hybrid")


def build_model(arch: str, vocab_size: int, eos_token_id: int, seed: int = 0) -> PreTrainedModel:
    return models.build_model(f"tiny-{arch}", vocab_size, eos_token_id, seed=seed)


def wide_heads_model(arch: str, vocab_size: int, eos_token_id: int | None, layers: int = 1) -> PreTrainedModel:
    """A Qwen3 ("full") or Mistral ("sliding", the tiny window) of `layers` layers with heads 128
    wide, as real models have: there SDPA's CPU kernel rounds a call of several queries otherwise
    than a call of one, which the tiny heads (16 wide) do not show."""
    wide = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                num_hidden_layers=layers, vocab_size=vocab_size, initializer_range=0.2, max_position_embeddings=2048,
                eos_token_id=eos_token_id, bos_token_id=None, pad_token_id=None)
    torch.manual_seed(5)
    if arch == "full":
        return Qwen3ForCausalLM(Qwen3Config(**wide)).eval()
    return MistralForCausalLM(MistralConfig(**wide, sliding_window=SLIDING_WINDOW)).eval()


def with_scripted_think_block(model: PreTrainedModel, tokenizer) -> PreTrainedModel:
    """A copy whose replies open with `<think> reason\\n</think>` and then go on at random, so a
    random model exercises the reasoning path for real (plain `generate` does the same)."""
    return models.script_reply(copy.deepcopy(model), tokenizer, "<think> reason\n</think>", end_turn=False)


def scripted_reply_model(tokenizer, reply: str, seed: int = 0) -> PreTrainedModel:
    """A tiny Qwen3 whose every reply is exactly `reply` then end-of-turn, greedy or sampled."""
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    return models.script_reply(build_model("full", len(tokenizer), eos, seed=seed), tokenizer, reply)


def save_endless_model(folder, tokenizer) -> None:
    """A tiny random model with its end token off, saved with `tokenizer` to `folder`: a reply
    served from it runs until it is stopped (or hits its token limit)."""
    model = build_model("full", len(tokenizer), tokenizer.convert_tokens_to_ids("<|im_end|>"))
    model.generation_config.eos_token_id = None
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
