"""Full-attention states that grow in place: no copy of the whole history per decoded token.

`DynamicLayer.update` does `torch.cat([keys, new])`, so every decode step copies (and allocates)
every layer's whole history: 2.0-2.5 ms of an 11.5 ms forward at 1k tokens on the benchmark
model. `GrowingLayer` keeps its states in a buffer with room for more
positions and writes each new token into it; `keys` / `values` are views of the filled part, so
attention never reads unused capacity and everything that reads a `DynamicLayer` (masks, lengths,
crops, `cut_segment`, the batch) reads this one unchanged.

Exactness: a crop only shortens the views (as `DynamicLayer.crop` does); the positions past it are
overwritten by the next update, which is why nothing may keep a view of them. Every reader of
the states past a crop point copies them first (segments, checkpoints, the batch's gather, the
cold tier), and a tensor assigned to `keys` from outside (a device move, a restored file, the
library's own reorder helpers) is simply adopted: copied into a fresh buffer at the next update.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

MAX_SPARE_TOKENS = 256


def spare_tokens(length: int) -> int:
    """Room a buffer holding `length` positions gets when it grows: an eighth more, 16 to 256.
    Growing copies the history once per `spare` steps (amortised: 1/8 of a token's states a step
    at worst), and an idle conversation holds at most 12.5 % (or 256 positions) unused: on
    Qwen3-0.6B a fixed 256 would be 58 MB a conversation, more than a short one's states."""
    return max(16, min(MAX_SPARE_TOKENS, length // 8))


class GrowingLayer(DynamicLayer):
    """A `DynamicLayer` whose states live in a buffer grown in chunks and written in place."""

    def __init__(self) -> None:
        super().__init__()
        self._key_buffer: torch.Tensor | None = None
        self._value_buffer: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.append(key_states, value_states)
        return self.keys, self.values

    def append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Write the states of the positions that follow the held ones (a forward, a segment put
        back, a batch's rows scattered back), growing the buffer by a chunk when it is full."""
        held = self._held()
        end = held + key_states.shape[-2]
        if not self._owns_views() or end > self._key_buffer.shape[-2]:
            self._grow(key_states, value_states, held, end + spare_tokens(end))
        assert self._key_buffer is not None and self._value_buffer is not None
        self._key_buffer[..., held:end, :].copy_(key_states)
        self._value_buffer[..., held:end, :].copy_(value_states)
        self.filled(end)

    def room_for(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The buffers, grown if they hold fewer than `end` positions, for a writer that fills
        positions up to `end` itself (the compiled step) and then calls `filled(end)`."""
        held = self._held()  # kept short of full: a graph compiled for part of a buffer serves no full one
        if not self._owns_views() or end >= self._key_buffer.shape[-2]:
            self._grow(self.keys, self.values, held, end + spare_tokens(end))
            self.filled(held)
        assert self._key_buffer is not None and self._value_buffer is not None
        return self._key_buffer, self._value_buffer

    def filled(self, end: int) -> None:
        """Hold the first `end` positions of the buffers (written by the caller of `room_for`)."""
        assert self._key_buffer is not None and self._value_buffer is not None
        self.keys, self.values = self._key_buffer[..., :end, :], self._value_buffer[..., :end, :]

    def use_buffers(self, key_buffer: torch.Tensor, value_buffer: torch.Tensor, length: int) -> None:
        """Hold the first `length` positions of these buffers (filled by the caller: the batch's
        gather writes its rows straight into them), the rest being room to grow."""
        if not self.is_initialized:
            self.lazy_initialization(key_buffer, value_buffer)
        self._key_buffer, self._value_buffer = key_buffer, value_buffer
        self.filled(length)

    def hold(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Hold exactly these tensors (moved to another device, say), dropping the old buffers now
        rather than at the next update: an offloaded session must not keep GPU memory."""
        self._key_buffer = self._value_buffer = None
        self.keys, self.values = keys, values

    def reset(self) -> None:
        self._key_buffer = self._value_buffer = None
        super().reset()

    def __getstate__(self) -> dict:
        """Pickled (the cold tier) without the buffers: only the filled part is worth keeping."""
        state = self.__dict__.copy()
        state["_key_buffer"] = state["_value_buffer"] = None
        return state

    # ---- internals -----------------------------------------------------------------------------
    def _held(self) -> int:
        keys = self.keys
        return 0 if keys is None or keys.dim() != 4 else keys.shape[-2]

    def _owns_views(self) -> bool:
        """Whether `keys` / `values` are still the views of this layer's buffers (not replaced from outside)."""
        buffers, views = (self._key_buffer, self._value_buffer), (self.keys, self.values)
        return all(buffer is not None and view is not None and view.dim() == 4
                   and view.data_ptr() == buffer.data_ptr() and view.stride() == buffer.stride()
                   and view.shape[:2] == buffer.shape[:2] for buffer, view in zip(buffers, views))

    def _grow(self, key_states: torch.Tensor, value_states: torch.Tensor, held: int, capacity: int) -> None:
        """New buffers of `capacity` positions holding the current `held` ones."""
        new_buffers = []
        for old, new in ((self.keys, key_states), (self.values, value_states)):
            buffer = new.new_empty(*new.shape[:-2], capacity, new.shape[-1])
            if held:
                buffer[..., :held, :].copy_(old)
            new_buffers.append(buffer)
        self._key_buffer, self._value_buffer = new_buffers

