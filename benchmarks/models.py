"""Benchmark models built in code (shapes: the `bench-*` rows of chat/models.py) and a
tokenizer trained on made-up words, so messages tokenize like text.

`full` is a Qwen3 of 33.6 M parameters (8 layers, hidden 512, 8 heads / 4 KV heads of 64,
MLP 1536, vocabulary 8192, untied embeddings). `sliding` is the same shape as a Mistral with a
512-token window, `hybrid` a Qwen3-Next with linear attention in 3 of every 4 layers.
"""

from __future__ import annotations

import random

from transformers import PreTrainedModel, PreTrainedTokenizerFast

from chat.demo import ASSETS, build_tokenizer
from chat.models import BENCH_SLIDING_WINDOW as SLIDING_WINDOW  # noqa: F401  (read by the benchmark)
from chat.models import MODELS, build_model, parameter_count, script_reply  # noqa: F401

VOCAB = 8192
SHAPE = MODELS["bench-full"].settings
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
    return build_model(f"bench-{arch}", vocab_size, eos_token_id, seed=seed)


def script_think_block(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast) -> None:
    """Make every greedy reply open with a short `<think>` block, so its strip cost shows."""
    script_reply(model, tokenizer, "<think>\nLet me think about the question first.\n</think>\n\n", end_turn=False)
