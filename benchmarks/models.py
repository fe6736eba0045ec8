"""Benchmark models built in code: random weights, a realistic shape for a CPU run.

`full` is a Qwen3 of 33.6 M parameters (8 layers, hidden 512, 8 heads / 4 KV heads of 64,
MLP 1536, vocabulary 8192, untied embeddings). `sliding` is the same shape as a Mistral with a
512-token window, `hybrid` a Qwen3-Next with linear attention in 3 of every 4 layers.
"""

from __future__ import annotations

import random

import torch
from transformers import (
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)

from chat.demo import ASSETS, build_tokenizer

VOCAB = 8192
SHAPE = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=4, head_dim=64, max_position_embeddings=8192, tie_word_embeddings=False,
             initializer_range=0.1)
SLIDING_WINDOW = 512
SYLLABLES = ("ka to ri ne so la mi po du ve shi qua ber lon tin gar fel mor zan pix ul ex an or in ed ing ly "
             "er st").split()


class Words:
    """Deterministic made-up words, so messages tokenize like text (1-3 tokens a word)."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)

    def word(self) -> str:
        return "".join(self.rng.choice(SYLLABLES) for _ in range(self.rng.randint(1, 4)))

    def sentence(self, words: int) -> str:
        return " ".join(self.word() for _ in range(words)).capitalize() + self.rng.choice(".?!")


def build_bench_tokenizer() -> PreTrainedTokenizerFast:
    words = Words(seed=0)
    corpus = [words.sentence(words.rng.randint(5, 20)) + "\n" for _ in range(20000)]
    tokenizer = build_tokenizer(vocab_size=VOCAB - 2, corpus=corpus)  # + <think>, </think>
    tokenizer.chat_template = (ASSETS / "qwen3.jinja").read_text()
    return tokenizer


def build_bench_model(arch: str, vocab_size: int, eos_token_id: int, seed: int = 0) -> PreTrainedModel:
    torch.manual_seed(seed)
    if arch == "full":
        model = Qwen3ForCausalLM(Qwen3Config(vocab_size=vocab_size, **SHAPE))
    elif arch == "sliding":
        model = MistralForCausalLM(MistralConfig(vocab_size=vocab_size, sliding_window=SLIDING_WINDOW, **SHAPE))
    elif arch == "hybrid":
        config = Qwen3NextConfig(
            vocab_size=vocab_size, layer_types=["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3
            + ["full_attention"], linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64,
            linear_value_head_dim=64, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256,
            shared_expert_intermediate_size=512, **SHAPE)
        model = Qwen3NextForCausalLM(config)
    else:
        raise ValueError(f"unknown arch {arch!r}")
    model.generation_config.eos_token_id = eos_token_id
    model.generation_config.pad_token_id = eos_token_id
    return model.eval()


def script_think_block(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast) -> None:
    """Make every greedy reply open with a short `<think>` block, so its strip cost shows."""
    ids = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    think, close = tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    reasoning = ids("\nLet me think about the question first.\n")
    script = [think] + reasoning + [close] + ids("\n\n")
    start = ids("assistant\n")
    model.generation_config.sequence_bias = [[start + script[: i + 1], 1000.0] for i in range(len(script))]


def parameter_count(model: PreTrainedModel) -> int:
    return sum(p.numel() for p in model.parameters())
