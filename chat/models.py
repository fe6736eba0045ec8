"""One table of the model shapes this project builds in code: the offline demo (trained), the tiny
adversarial test models (one per attention-layer mix) and the benchmark models.

`build_model(name, vocab_size, eos_token_id)` makes one with seeded random weights;
`script_reply` pins what a model says, for tests and benchmarks that need a known reply.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)

TINY_SLIDING_WINDOW = 8
BENCH_SLIDING_WINDOW = 512


@dataclass(frozen=True)
class ModelSpec:
    config_class: type[PretrainedConfig]
    model_class: type[PreTrainedModel]
    settings: dict[str, Any] = field(default_factory=dict)
    # Linear-attention decay (A_log) set after init: the default forgets within a few tokens, so
    # a stale recurrent state would hide; -2.0 made 10/10 greedy tokens flip after a plain crop.
    linear_attention_a_log: float | None = None


_TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             max_position_embeddings=2048)
_BENCH = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
              num_key_value_heads=4, head_dim=64, max_position_embeddings=8192, tie_word_embeddings=False,
              initializer_range=0.1)
# Qwen3-0.6B's shape (its config.json), for figures at a real model's size; random weights, and the
# vocabulary of whatever tokenizer builds it (the real one has 151,936 entries).
_QWEN3_0_6B = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                   num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, tie_word_embeddings=True,
                   rope_theta=1000000.0, initializer_range=0.02)
# Linear attention (Qwen3-Next) with small experts, at either size.
_TINY_LINEAR = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                    linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                    shared_expert_intermediate_size=64)
_BENCH_LINEAR = dict(linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64,
                     linear_value_head_dim=64, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256,
                     shared_expert_intermediate_size=512)

MODELS: dict[str, ModelSpec] = {
    # The offline demo: trained by demo_model/train.py (weights in chat/assets/demo).
    "demo": ModelSpec(Qwen3Config, Qwen3ForCausalLM, dict(
        hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
        head_dim=32, max_position_embeddings=2048, tie_word_embeddings=True, rope_theta=10000.0,
        initializer_range=0.02)),
    # Tiny test models: a large init range spreads the logits, so a stale or missing cached state
    # changes greedy tokens instead of hiding below a near-tie. Linear attention gets less: its
    # chunked prefill and step-by-step recurrence drift apart (fp32) as the weights grow.
    "tiny-full": ModelSpec(Qwen3Config, Qwen3ForCausalLM, dict(_TINY, num_hidden_layers=2, initializer_range=0.2)),
    "tiny-sliding": ModelSpec(MistralConfig, MistralForCausalLM, dict(
        _TINY, num_hidden_layers=2, sliding_window=TINY_SLIDING_WINDOW, initializer_range=0.2)),
    "tiny-mixed": ModelSpec(Gemma2Config, Gemma2ForCausalLM, dict(
        _TINY, num_hidden_layers=4, sliding_window=TINY_SLIDING_WINDOW, initializer_range=0.2,
        layer_types=["sliding_attention", "full_attention"] * 2, final_logit_softcapping=None,
        attn_logit_softcapping=None, tie_word_embeddings=False)),
    "tiny-hybrid": ModelSpec(Qwen3NextConfig, Qwen3NextForCausalLM, dict(
        **_TINY, **_TINY_LINEAR, num_hidden_layers=4, initializer_range=0.15,
        layer_types=["linear_attention", "full_attention"] * 2), linear_attention_a_log=-2.0),
    # Benchmark models: Qwen3 of 33.6 M parameters; the same shape as a Mistral with a 512-token
    # window, and as a Qwen3-Next with linear attention in 3 of every 4 layers.
    "bench-full": ModelSpec(Qwen3Config, Qwen3ForCausalLM, _BENCH),
    "bench-sliding": ModelSpec(MistralConfig, MistralForCausalLM, dict(_BENCH, sliding_window=BENCH_SLIDING_WINDOW)),
    "bench-hybrid": ModelSpec(Qwen3NextConfig, Qwen3NextForCausalLM, dict(
        **_BENCH, **_BENCH_LINEAR, layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2)),
    "real-qwen3-0.6b": ModelSpec(Qwen3Config, Qwen3ForCausalLM, _QWEN3_0_6B),
}


def build_model(name: str, vocab_size: int, eos_token_id: int | None, seed: int = 0) -> PreTrainedModel:
    """The model `name` of the table with seeded random weights, in eval mode."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known: {sorted(MODELS)}")
    spec = MODELS[name]
    torch.manual_seed(seed)
    model = spec.model_class(spec.config_class(vocab_size=vocab_size, **spec.settings))
    if spec.linear_attention_a_log is not None:
        with torch.no_grad():
            for module in model.modules():
                if hasattr(module, "A_log"):
                    module.A_log.fill_(spec.linear_attention_a_log)
    model.generation_config.eos_token_id = eos_token_id
    model.generation_config.pad_token_id = eos_token_id
    return model.eval()


def script_reply(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, text: str, *,
                 end_turn: bool = True) -> PreTrainedModel:
    """Make every reply of `model` start with exactly `text` (then end the turn, or go on freely).

    Done with `sequence_bias` in the model's generation config, pinning each next token given
    what precedes it in the reply, so plain `generate` (the tests' reference) does it too,
    greedy or sampled."""
    start = tokenizer("assistant\n", add_special_tokens=False)["input_ids"]
    script = tokenizer(text, add_special_tokens=False)["input_ids"]
    if end_turn:
        script = script + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    model.generation_config.sequence_bias = [[start + script[: i + 1], 1000.0] for i in range(len(script))]
    return model


def parameter_count(model: PreTrainedModel) -> int:
    return sum(p.numel() for p in model.parameters())
