"""Which cache a conversation's states live in (`--kv-cache`): the one place that builds caches.

- `dynamic` (default): exact states; full-attention layers grown in place (growing.py).
- `quantized`: full-attention states in 8 or 4 bits (`bits`), quantized once per token
  (quantized.py), so rollback stays exact in the only sense a lossy cache allows: the states equal
  what feeding the same tokens to a fresh cache of this kind gives.

Refused, with the reason, rather than offered half-working:
- `static` (transformers' `StaticCache`, preallocated for `torch.compile`): a compiled decode step
  measured slower on these CPUs (17-20 ms against 12.7, after 43 s of compiling), and
  in-place growth already removes the copy a preallocated cache saves.
- `offloaded` (transformers' offloading of layers to the CPU during a forward): it only makes
  sense on a GPU; between calls the engine already moves idle caches off the GPU
  (`offload_sessions`) and out to disk (`--cache-dir`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from transformers import DynamicCache, PretrainedConfig, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from cache_sessions.growing import GrowingLayer
from cache_sessions.quantized import BITS, QuantizedLayer

KV_CACHES = ("dynamic", "quantized")
REFUSED = {
    "static": "a compiled decode step measured slower than this engine's on the CPU, and growing states in "
              "place already avoids the copy a static cache saves",
    "offloaded": "it moves layers to the CPU during a forward on a GPU; between turns the engine already moves "
                 "idle caches off the GPU (offload_sessions) and to disk (--cache-dir)",
}


@dataclass(frozen=True)
class CacheShape:
    """What a new cache is made for: a model's config and dtype (a session keeps only this)."""

    config: PretrainedConfig
    dtype: torch.dtype


@dataclass(frozen=True)
class KVCacheKind:
    name: str = "dynamic"
    bits: int = 8  # quantized only

    def __post_init__(self) -> None:
        if self.name in REFUSED:
            raise ValueError(f"--kv-cache {self.name} is not offered: {REFUSED[self.name]}")
        if self.name not in KV_CACHES:
            raise ValueError(f"--kv-cache must be one of {', '.join(KV_CACHES)}, not {self.name!r}")
        if self.name == "quantized" and self.bits not in BITS:
            raise ValueError(f"--kv-bits must be {' or '.join(map(str, BITS))} for a quantized cache, not {self.bits}")

    def check_applies(self, model: PreTrainedModel) -> None:
        """Refuse a quantized cache for a model with no plain full-attention layer (sliding windows
        or linear attention only): it would change nothing and say it did."""
        if self.name == "quantized" and not any(isinstance(layer, QuantizedLayer) for layer in
                                                self.new_cache(model).layers):
            raise ValueError("--kv-cache quantized applies to full-attention layers, and this model has none "
                             "(sliding windows and linear attention keep bounded states in full precision)")

    def new_cache(self, model: PreTrainedModel | CacheShape) -> DynamicCache:
        """`DynamicCache(config=...)` with every plain full-attention layer of this kind (sliding
        windows, linear attention and mixed layers keep the library's classes)."""
        cache = DynamicCache(config=model.config)
        cache.layers = [self._full_attention_layer(model) if type(layer) is DynamicLayer else layer
                        for layer in cache.layers]
        return cache

    def _full_attention_layer(self, model: PreTrainedModel | CacheShape) -> DynamicLayer:
        if self.name == "quantized":
            return QuantizedLayer(self.bits, dtype=model.dtype)
        return GrowingLayer()
