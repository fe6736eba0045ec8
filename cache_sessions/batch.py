"""Several sessions decoding together: their caches as one batched `DynamicCache`.

Only decode steps run batched (one new token per row), so padding never enters a recurrent
state; attention layers see each row left-padded to the longest and mask the pads. Sessions keep
their own caches: `BatchedCache(model, sessions)` copies them in, and `scatter()` appends what
the batch added to each session, leaving it as if it had decoded alone (a sliding window's
recorded past included, so its rollback stays exact). A batch is built for one composition of
rows; when a row joins or leaves, scatter and build the next one.
"""

from __future__ import annotations

from typing import Sequence

import torch
from transformers import PreTrainedModel

from cache_sessions.growing import GrowingLayer, spare_tokens
from cache_sessions.rollback import (
    FullAttention,
    LayerKind,
    QuantizedAttention,
    RecurrentState,
    SlidingWindow,
    layer_kinds,
)
from cache_sessions.session import CacheSession
from cache_sessions.tensors import storage_bytes


def decode_batch(model: PreTrainedModel, sessions: Sequence[CacheSession]) -> "BatchedCache | SingleRow":
    """The batch for these rows: one row decodes on its own cache, with nothing copied."""
    return SingleRow(model, sessions[0]) if len(sessions) == 1 else BatchedCache(model, sessions)


class SingleRow:
    """A batch of one, as `generate` would run it: on the session's own cache."""

    def __init__(self, model: PreTrainedModel, session: CacheSession):
        self.sessions = [session]
        self.device = model.device

    def inputs(self, token_ids: Sequence[int]) -> dict[str, object]:
        return dict(input_ids=torch.tensor([list(token_ids)], device=self.device),
                    past_key_values=self.sessions[0].cache, use_cache=True)

    def fed(self, token_ids: Sequence[int]) -> None:
        self.sessions[0].note_extended(token_ids)

    def scatter(self) -> None:
        """Nothing to do: the session's cache was fed directly."""

    def nbytes(self) -> int:
        return 0


class BatchedCache:
    def __init__(self, model: PreTrainedModel, sessions: Sequence[CacheSession]):
        if not sessions or any(not session.token_ids for session in sessions):
            raise ValueError("every row of a batch must hold its prompt but the last token")
        self.sessions = list(sessions)
        self.lengths = [len(session.token_ids) for session in sessions]
        self.padded = max(self.lengths)
        self.steps = 0  # tokens fed to every row since the batch was built
        self._fed: list[list[int]] = [[] for _ in self.sessions]
        self.device = model.device
        self.cache = sessions[0].kv_cache.new_cache(model)  # the rows' kind: a row decodes as it would alone
        self.kinds = layer_kinds(self.cache)
        for index, kind in enumerate(self.kinds):
            kind.prepare()  # sliding windows record: nothing a row fed is dropped before scatter
            rows = [session.kinds[index] for session in sessions]
            _GATHER[type(kind)](kind, rows, self.lengths, self.padded)

    def inputs(self, token_ids: Sequence[int]) -> dict[str, torch.Tensor]:
        """Model inputs to feed one token per row (the last sampled one)."""
        total = self.padded + self.steps + 1
        mask = torch.zeros(len(self.lengths), total, dtype=torch.long, device=self.device)
        for row, length in enumerate(self.lengths):
            mask[row, self.padded - length:] = 1
        positions = torch.tensor([[length + self.steps] for length in self.lengths], device=self.device)
        return dict(input_ids=torch.tensor([[token] for token in token_ids], device=self.device),
                    attention_mask=mask, position_ids=positions, past_key_values=self.cache, use_cache=True)

    def fed(self, token_ids: Sequence[int]) -> None:
        """Record that `token_ids` (one per row) went through the model."""
        if len(token_ids) != len(self.sessions):
            raise ValueError("one token per row")
        self.steps += 1
        for row, token in enumerate(token_ids):
            self._fed[row].append(token)

    def scatter(self) -> None:
        """Append each row's new states (and tokens) to its own session."""
        if self.steps == 0:
            return
        for row, session in enumerate(self.sessions):
            for kind, own in zip(self.kinds, session.kinds, strict=True):
                _SCATTER[type(kind)](kind, own, row, self.steps)
            session.note_extended(self._fed[row])
        self.steps = 0
        self._fed = [[] for _ in self.sessions]

    def nbytes(self) -> int:
        """What the batched copy holds on top of the sessions' own caches."""
        return storage_bytes(tensor for kind in self.kinds for tensor in kind.tensors())


# ---- per layer kind: into the batch (gather) and back out (scatter) ---------------------------
def _left_padded(tensors: list[torch.Tensor | None], width: int, like: torch.Tensor, capacity: int) -> torch.Tensor:
    """(1, heads, n, dim) tensors, stacked right-aligned into the first `width` positions of a
    (rows, heads, capacity, dim) buffer, zeros on the left."""
    buffer = like.new_zeros(len(tensors), *like.shape[1:-2], capacity, like.shape[-1])
    for row, tensor in enumerate(tensors):
        if tensor is not None:
            buffer[row : row + 1, :, width - tensor.shape[-2] : width, :].copy_(tensor)
    return buffer


def _gather_attention(kind: LayerKind, rows: list[LayerKind], width: int, keep: list[int]) -> None:
    """Each row's last `keep[row]` states, left-padded to `width`. A full-attention batch layer
    gets them in buffers with room to grow: its decode steps then write in place."""
    def last(row: LayerKind, count: int, name: str) -> torch.Tensor | None:
        return getattr(row.layer, name)[..., row.layer.keys.shape[-2] - count:, :] if row.layer.is_initialized else None

    like_row = next(row for row in rows if row.layer.is_initialized)
    growing = isinstance(kind.layer, GrowingLayer)
    capacity = width + spare_tokens(width) if growing else width
    keys = _left_padded([last(r, n, "keys") for r, n in zip(rows, keep)], width, like_row.layer.keys, capacity)
    values = _left_padded([last(r, n, "values") for r, n in zip(rows, keep)], width, like_row.layer.values, capacity)
    if growing:
        kind.layer.use_buffers(keys, values, width)
    else:
        kind.layer.lazy_initialization(keys, values)
        kind.layer.keys, kind.layer.values = keys, values


def _gather_full(kind: FullAttention, rows: list[LayerKind], lengths: list[int], padded: int) -> None:
    _gather_attention(kind, rows, padded, lengths)


def _gather_window(kind: SlidingWindow, rows: list[LayerKind], lengths: list[int], padded: int) -> None:
    keep = [min(length, kind.layer.sliding_window - 1) for length in lengths]
    _gather_attention(kind, rows, max(keep), keep)
    kind.layer.cumulative_length = padded


def _gather_recurrent(kind: RecurrentState, rows: list[LayerKind], lengths: list[int], padded: int) -> None:
    layer, first = kind.layer, rows[0].layer
    for name in ("conv_states", "recurrent_states"):
        setattr(layer, name, {key: torch.cat([getattr(row.layer, name)[key] for row in rows], dim=0)
                              for key in getattr(first, name)})
    for name in ("is_conv_states_initialized", "is_recurrent_states_initialized", "has_previous_state",
                 "conv_kernel_size"):
        setattr(layer, name, dict(getattr(first, name)))
    layer.dtype, layer.device = first.dtype, first.device


def _gather_quantized(kind: QuantizedAttention, rows: list[LayerKind], lengths: list[int], padded: int) -> None:
    """Each row's codes, scales and minimums, left-padded with zeros (masked) to the longest."""
    arrays = [row.layer.arrays() for row in rows]
    like = next(row for row in arrays if row)
    kind.layer.append({name: _left_padded([row.get(name) for row in arrays], padded, like[name], padded)
                       for name in like})


def _scatter_quantized(kind: LayerKind, own: LayerKind, row: int, steps: int) -> None:
    assert isinstance(own, QuantizedAttention)
    own.append_segment({name: array[row : row + 1, :, -steps:, :] for name, array in kind.layer.arrays().items()},
                       0, steps)


def _scatter_attention(kind: LayerKind, own: LayerKind, row: int, steps: int) -> None:
    assert isinstance(own, (FullAttention, SlidingWindow))
    own.append_states(kind.layer.keys[row : row + 1, :, -steps:, :], kind.layer.values[row : row + 1, :, -steps:, :])


def _scatter_recurrent(kind: LayerKind, own: LayerKind, row: int, steps: int) -> None:
    for name in ("conv_states", "recurrent_states"):
        batched = getattr(kind.layer, name)
        setattr(own.layer, name, {key: tensor[row : row + 1].clone() for key, tensor in batched.items()})


_GATHER = {FullAttention: _gather_full, SlidingWindow: _gather_window, RecurrentState: _gather_recurrent,
           QuantizedAttention: _gather_quantized}
_SCATTER = {FullAttention: _scatter_attention, SlidingWindow: _scatter_attention, RecurrentState: _scatter_recurrent,
            QuantizedAttention: _scatter_quantized}
