"""How the model's weights are held: "full" (as loaded, in its dtype) or "int8".

int8: every linear layer of the decoder and the output head keeps its weight as int8 with one
scale per output channel, and each call quantizes its input to int8 with one scale per token
(symmetric, round to nearest), multiplies int8 by int8 into int32 with torch's own kernel
(`torch._int_mm`, the one torchao's int8 path uses) and scales back. That is llama.cpp's `Q8_0`
idea (it quantizes activations to 8 bits for its dot products too) with coarser scales. Norms,
embeddings, attention and the KV cache stay in the model's dtype. On a CPU a decode step is bound
by reading the weights, and int8 reads a quarter of fp32's bytes (`python -m benchmarks.weights`).

Rollback for the model as quantized: each token's input is quantized on its own and the int32
products are exact, but attention, norms and the scale-back run in floats, whose sums depend on
the batch or the chunk a token came in; a value a hair from a rounding boundary can then round
the other way, which moved a logit by 0.05 with 7-token chunks on the mixed model, and by 0.24 on
the demo model with outlier channels put in (`benchmarks/exactness.py`). So what the tests hold
is: greedy replies equal plain `generate` on the same quantized model, and the cached states give
a from-scratch forward's logits within 0.1 on their random models (not bit for bit). Greedy replies differ from
the full model's where the rounding moves a near-tie: the benchmark reports how often, on the
trained demo model.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PreTrainedModel

WEIGHT_FORMATS = ("full", "int8")


class Int8Linear(nn.Module):
    """`nn.Linear` in int8: weight per output channel, input per token, int32 products."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        weight = linear.weight.detach().float()
        scales = weight.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127.0
        levels = torch.round(weight / scales[:, None]).clamp(-127, 127).to(torch.int8)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # Stored (in, out) in column-major order: what the int8 kernel reads fastest (2x measured).
        self.register_buffer("weight_int8", levels.t())
        self.register_buffer("scales", scales)
        self.bias = linear.bias

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        flat = hidden.reshape(-1, self.in_features).float()
        token_scales = flat.abs().amax(dim=1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny) / 127.0
        products = torch._int_mm(torch.round(flat / token_scales).to(torch.int8), self.weight_int8)
        out = (products.float() * token_scales * self.scales).to(hidden.dtype)
        out = out.reshape(*hidden.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 weights and inputs"


def check_weight_format(weights: str) -> None:
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"weights is one of {', '.join(WEIGHT_FORMATS)}, not {weights!r}")


@torch.no_grad()
def apply_weight_format(model: PreTrainedModel, weights: str) -> PreTrainedModel:
    """Hold `model`'s weights as `weights` says (in place; again on a quantized model: no change)."""
    check_weight_format(weights)
    if weights == "full":
        return model
    if model.device.type != "cpu":
        raise ValueError("int8 weights are measured on the CPU only; on a GPU load bf16 (--dtype bfloat16)")
    if model.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"int8 weights take a float32 or bfloat16 model, not {model.dtype}")
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, Int8Linear(child))
    return model
