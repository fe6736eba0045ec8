"""Full-attention states in 8 or 4 bits, quantized once per token so that rollback stays exact.

transformers' `QuantizedCache` (KIVI-style) keeps a full-precision residual and, every
`residual_length` tokens, quantizes the dequantized past together with it again. Its states
therefore depend on how the tokens were split into calls (a prefill, decode steps, a re-fed
tail after a rollback), and each re-quantization adds error on top of the last. No exact
rollback can be defined for it: which states would the cache hold "at position p"?

`QuantizedLayer` quantizes each token's key and value once, as it is written, per token in groups
of `GROUP` channels (asymmetric: a scale and a minimum a group), and gives attention every
position dequantized, the current call's own tokens too. Each position's stored codes then depend
only on the tokens up to it, never on the calls that fed them, so:

- a crop is exact (drop positions), a segment is a slice, a batch row is a slice;
- "exact" for this lossy cache means: the states equal what feeding the same tokens to a fresh
  cache of this kind gives (up to the float noise of differently shaped matmuls, which can flip
  a code by one step), and a rollback never leaves a stale state behind.

Bytes a token, against 4 bytes an element in fp32: 8 bits 1 + 8/GROUP, 4 bits 0.5 + 8/GROUP
(3.6x and 6.4x fewer at GROUP = 64). The price: every decode step dequantizes the whole history.
Sliding-window and linear-attention layers keep full precision (their states are bounded).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

GROUP = 64  # channels sharing one scale and minimum, at most (see `group_size`)
BITS = (8, 4)
ARRAYS = ("keys", "values", "key_scales", "key_minimums", "value_scales", "value_minimums")


def group_size(dim: int) -> int:
    """Channels a group holds for heads of `dim`: the largest divisor of `dim` up to `GROUP`, so
    heads of 80 (Phi-2, StableLM) or 96 (Phi-3-mini) channels quantize in groups of 40 or 48."""
    return next(size for size in range(min(GROUP, dim), 0, -1) if dim % size == 0)


def quantize(states: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(batch, heads, n, dim) floats -> codes (uint8; two 4-bit codes a byte), scales, minimums
    (batch, heads, n, dim // group). Each code is round((x - minimum) / scale), in 0..2**bits - 1."""
    *lead, dim = states.shape
    group = group_size(dim)
    grouped = states.float().reshape(*lead, dim // group, group)
    minimum = grouped.amin(dim=-1, keepdim=True)
    scale = (grouped.amax(dim=-1, keepdim=True) - minimum) / (2**bits - 1)
    inverse = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))  # a constant group: all codes 0
    codes = ((grouped - minimum) * inverse).round_().clamp_(0, 2**bits - 1).to(torch.uint8).reshape(*lead, dim)
    if bits == 4:
        codes = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return codes, scale.squeeze(-1), minimum.squeeze(-1)


def dequantize(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, bits: int,
               dtype: torch.dtype) -> torch.Tensor:
    if bits == 4:
        codes = torch.stack((codes & 15, codes >> 4), dim=-1).flatten(-2)
    *lead, dim = codes.shape
    groups = scale.shape[-1]
    values = codes.reshape(*lead, groups, dim // groups).to(scale.dtype) * scale[..., None] + minimum[..., None]
    return values.reshape(*lead, dim).to(dtype)


class QuantizedLayer(DynamicLayer):
    """A full-attention layer holding codes, scales and minimums per position (see the module).
    `keys` / `values` are the codes, so lengths, masks and crops read it like a `DynamicLayer`."""

    def __init__(self, bits: int = 8, dtype: torch.dtype = torch.float32):
        """`dtype`: what attention gets (the model's), also for states put back before any forward."""
        if bits not in BITS:
            raise ValueError(f"a quantized cache holds {' or '.join(map(str, BITS))} bits, not {bits}")
        super().__init__()
        self.bits, self.dtype = bits, dtype
        self.key_scales = self.key_minimums = self.value_scales = self.value_minimums = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        keys, key_scales, key_minimums = quantize(key_states, self.bits)
        values, value_scales, value_minimums = quantize(value_states, self.bits)
        self.append(dict(keys=keys, values=values, key_scales=key_scales, key_minimums=key_minimums,
                         value_scales=value_scales, value_minimums=value_minimums))
        return (dequantize(self.keys, self.key_scales, self.key_minimums, self.bits, self.dtype),
                dequantize(self.values, self.value_scales, self.value_minimums, self.bits, self.dtype))

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device, self.is_initialized = key_states.dtype, key_states.device, True
        self.keys = self.values = None  # no positions yet: the arrays start with the first append

    # ---- the arrays, position by position (crops, segments, batches, the cold tier) --------------
    def arrays(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in ARRAYS} if self.held() else {}

    def held(self) -> int:
        return 0 if self.keys is None or self.keys.dim() != 4 else self.keys.shape[-2]

    def get_seq_length(self) -> int:
        return self.held()

    def append(self, arrays: dict[str, torch.Tensor]) -> None:
        """Positions that follow the held ones, already quantized (from `update`, a segment, a batch)."""
        if not self.is_initialized:
            self.device, self.is_initialized = arrays["keys"].device, True
        if not self.held():  # copies: never a view of another cache's arrays (a batch's, a segment's)
            for name in ARRAYS:
                setattr(self, name, arrays[name].to(self.device).clone())
            return
        for name in ARRAYS:
            setattr(self, name, torch.cat([getattr(self, name), arrays[name].to(self.device)], dim=-2))

    def slice(self, start: int, end: int) -> dict[str, torch.Tensor]:
        """Copies of positions [start, end): what a segment keeps (later crops cannot touch them)."""
        return {name: array[..., start:end, :].clone() for name, array in self.arrays().items()}

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes the (negative) number of tokens to remove")
        keep = self.held() + tokens_to_remove
        if tokens_to_remove == 0 or not self.held():
            return
        for name in ARRAYS:
            setattr(self, name, getattr(self, name)[..., :keep, :])

    def reset(self) -> None:
        super().reset()
        self.key_scales = self.key_minimums = self.value_scales = self.value_minimums = None

    def to(self, device: torch.device | str) -> None:
        for name, array in self.arrays().items():
            setattr(self, name, array.to(device))
        self.device = torch.device(device)
