"""Tiny models in code, one per attention-layer mix, made sensitive to their context.

Weights are drawn with a large init range so that the logits are spread out: a stale or missing
cached state then changes greedy tokens instead of hiding below a near-tie.
"""

from __future__ import annotations

import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)

SLIDING_WINDOW = 8
ARCHS = ("full", "sliding", "mixed", "hybrid")
_COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=2048,
)
# Large enough to spread the logits; the linear-attention model gets less, because its chunked
# prefill and its step-by-step recurrence drift apart (fp32) as the weights grow.
INIT_RANGE = {"full": 0.2, "sliding": 0.2, "mixed": 0.2, "hybrid": 0.15}
# Slow decay for the linear-attention state (the default init forgets within a few tokens), so
# that a stale recurrent state changes greedy tokens: measured 10/10 flips after a plain crop.
HYBRID_A_LOG = -2.0


def build_model(arch: str, vocab_size: int, eos_token_id: int, seed: int = 0) -> PreTrainedModel:
    torch.manual_seed(seed)
    common = dict(_COMMON, initializer_range=INIT_RANGE[arch])
    if arch == "full":
        model = Qwen3ForCausalLM(Qwen3Config(vocab_size=vocab_size, num_hidden_layers=2, **common))
    elif arch == "sliding":
        config = MistralConfig(vocab_size=vocab_size, num_hidden_layers=2, sliding_window=SLIDING_WINDOW, **common)
        model = MistralForCausalLM(config)
    elif arch == "mixed":
        config = Gemma2Config(
            vocab_size=vocab_size,
            num_hidden_layers=4,
            sliding_window=SLIDING_WINDOW,
            layer_types=["sliding_attention", "full_attention"] * 2,
            final_logit_softcapping=None,
            tie_word_embeddings=False,
            attn_logit_softcapping=None,
            **common,
        )
        model = Gemma2ForCausalLM(config)
    elif arch == "hybrid":
        config = Qwen3NextConfig(
            vocab_size=vocab_size,
            num_hidden_layers=4,
            layer_types=["linear_attention", "full_attention"] * 2,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=64,
            **common,
        )
        model = Qwen3NextForCausalLM(config)
        with torch.no_grad():
            for module in model.modules():
                if hasattr(module, "A_log"):
                    module.A_log.fill_(HYBRID_A_LOG)
    else:
        raise ValueError(f"unknown arch {arch!r}")
    model.generation_config.eos_token_id = eos_token_id
    model.generation_config.pad_token_id = eos_token_id
    return model.eval()


def with_scripted_think_block(model: PreTrainedModel, tokenizer) -> PreTrainedModel:
    """A copy whose greedy replies open with `<think> reason\n</think>` and then go on at random.

    Done with `sequence_bias` in the model's generation config, so plain `generate` (the
    reference) applies it too: a random model then exercises the reasoning path for real.
    """
    import copy

    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    think, close = tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    (word,), (newline,) = ids(" reason"), ids("\n")
    scripted = copy.deepcopy(model)
    scripted.generation_config.sequence_bias = [
        [ids("assistant\n") + [think], 100.0],
        [[think, word], 100.0],
        [[think, word, newline], 100.0],
        [[word, newline, close], 100.0],
    ]
    return scripted


def scripted_reply_model(tokenizer, reply: str, seed: int = 0) -> PreTrainedModel:
    """A tiny Qwen3 whose every reply is exactly `reply` then end-of-turn, greedy or sampled.

    `sequence_bias` pins each next token given everything before it in the reply, so the model
    says what a test needs it to say (a think block, markup that must not run in a browser).
    """
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model = build_model("full", len(tokenizer), eos, seed=seed)
    start = tokenizer("assistant\n", add_special_tokens=False)["input_ids"]
    script = tokenizer(reply, add_special_tokens=False)["input_ids"] + [eos]
    model.generation_config.sequence_bias = [[start + script[: i + 1], 1000.0] for i in range(len(script))]
    return model
