"""Moving a cache back in time: the one place that knows how each kind of cache layer rolls back.

Every layer of a `DynamicCache` is wrapped in a `LayerKind`, chosen by inspecting the layer's
class (never the model's name):

- `FullAttention`  keeps every key/value; `crop` is always exact.
- `SlidingWindow`  keeps a window; `crop` is exact only while the target lies inside what it has
                   recorded since its last trim. Otherwise a checkpoint is needed.
- `RecurrentState` (linear attention, SSM) folds the past into fixed-size states; it can never
                   be cropped, only restored from a checkpoint.

`roll_back` picks the cheapest exact path: crop every layer, else restore the newest checkpoint at
or before the target, else report that the caller must rebuild from scratch.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Iterator, Literal

import torch
from transformers import DynamicCache
from transformers.cache_utils import (
    DummyLayer,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionAndFullAttentionLayer,
    LinearAttentionAndSlidingWindowAttentionLayer,
    LinearAttentionLayer,
)

from cache_sessions.checkpoints import Checkpoint, CheckpointStore
from cache_sessions.growing import GrowingLayer
from cache_sessions.quantized import QuantizedLayer


class UnsupportedCacheLayer(TypeError):
    """A cache layer whose rollback semantics this project does not know."""


class LayerKind(ABC):
    """How one cache layer moves back in time. `current` and `target` are token positions."""

    crops_anywhere = False  # every crop is exact: such a layer never needs a checkpoint

    def __init__(self, layer: Any):
        self.layer = layer

    def set_up(self) -> None:
        """Called once on a fresh cache, before the first forward."""

    @abstractmethod
    def can_crop(self, current: int, target: int) -> bool: ...

    @abstractmethod
    def crop(self, current: int, target: int) -> None: ...

    def snapshot(self) -> Any:
        """The bounded state a checkpoint must keep for this layer (None: nothing to keep)."""
        return None

    @abstractmethod
    def restore(self, state: Any, current: int, position: int) -> None: ...

    def trim(self) -> None:
        """Drop states that no exact crop can use any more (called right after a checkpoint)."""

    def cut_segment(self, start: int, end: int) -> Any:
        """What `append_segment` needs to go from `start` to `end` (the cache is at `end`)."""
        return self.snapshot()

    def append_segment(self, state: Any, start: int, end: int) -> None:
        """Put back a segment cut earlier; the cache is at `start`."""
        self.restore(state, start, end)

    @abstractmethod
    def tensors(self) -> Iterator[torch.Tensor]: ...

    @abstractmethod
    def to(self, device: torch.device | str) -> None: ...


class _Attention(LayerKind):
    """Key/value layers (full or sliding). A sliding layer replaces its tensors, never writes in
    place; a full-attention `GrowingLayer` writes in place past its end, so what is kept of it
    apart from the layer (segments) is always a copy."""

    def tensors(self) -> Iterator[torch.Tensor]:
        if self.layer.is_initialized:
            yield from (self.layer.keys, self.layer.values)

    def to(self, device: torch.device | str) -> None:
        if self.layer.is_initialized:
            keys, values = self.layer.keys.to(device), self.layer.values.to(device)
            if isinstance(self.layer, GrowingLayer):
                self.layer.hold(keys, values)  # its buffers on the old device go now
            else:
                self.layer.keys, self.layer.values = keys, values
            self.layer.device = torch.device(device)

    def append_states(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Add the states of the positions that follow the cached ones (a segment put back, or
        what a batched decode computed for this layer's session): copies of `keys` / `values`."""
        if not self.layer.is_initialized:
            self.layer.lazy_initialization(keys, values)
        keys, values = keys.to(self.layer.device), values.to(self.layer.device)
        if isinstance(self.layer, GrowingLayer):
            self.layer.append(keys, values)
            return
        self.layer.keys = torch.cat([self.layer.keys, keys], dim=-2)
        self.layer.values = torch.cat([self.layer.values, values], dim=-2)


class FullAttention(_Attention):
    crops_anywhere = True

    def can_crop(self, current: int, target: int) -> bool:
        return True

    def crop(self, current: int, target: int) -> None:
        if target < current:
            DynamicLayer.crop(self.layer, target - current)

    def restore(self, state: Any, current: int, position: int) -> None:
        self.crop(current, position)

    def cut_segment(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        if not self.layer.is_initialized:
            return None
        return self.layer.keys[..., start:end, :].clone(), self.layer.values[..., start:end, :].clone()

    def append_segment(self, state: tuple[torch.Tensor, torch.Tensor] | None, start: int, end: int) -> None:
        if state is not None:
            self.append_states(*state)


class QuantizedAttention(LayerKind):
    """Full attention held as per-token codes (cache_sessions/quantized.py): each position's codes
    stand alone, so a crop is exact and a segment is a slice, as for `FullAttention`."""

    crops_anywhere = True

    def can_crop(self, current: int, target: int) -> bool:
        return True

    def crop(self, current: int, target: int) -> None:
        if target < current:
            self.layer.crop(target - current)

    def restore(self, state: Any, current: int, position: int) -> None:
        self.crop(current, position)

    def cut_segment(self, start: int, end: int) -> dict[str, torch.Tensor] | None:
        return self.layer.slice(start, end) if self.layer.held() else None

    def append_segment(self, state: dict[str, torch.Tensor] | None, start: int, end: int) -> None:
        if state:
            self.layer.append(state)

    def tensors(self) -> Iterator[torch.Tensor]:
        yield from self.layer.arrays().values()

    def to(self, device: torch.device | str) -> None:
        self.layer.to(device)


@dataclass
class WindowState:
    keys: torch.Tensor | None
    values: torch.Tensor | None
    cumulative_length: int


class SlidingWindow(_Attention):
    """Holds states for positions [cumulative_length - stored, cumulative_length)."""

    def set_up(self) -> None:
        self.layer.activate_past_recording()

    def _stored(self) -> int:
        return 0 if not self.layer.is_initialized else self.layer.keys.shape[-2]

    def can_crop(self, current: int, target: int) -> bool:
        if target >= current:
            return True
        first_stored = self.layer.cumulative_length - self._stored()
        first_needed = max(0, target - (self.layer.sliding_window - 1))
        return self.layer.record_past and first_stored <= first_needed

    def crop(self, current: int, target: int) -> None:
        if target >= current:
            return
        # Slice ourselves: the library's crop keeps only `window - 1` states, which is right
        # for the next forward but would make a later crop further back inexact.
        keep_from = max(0, target - (self.layer.sliding_window - 1)) - (current - self._stored())
        keep_to = self._stored() - (current - target)
        self.layer.keys = self.layer.keys[..., keep_from:keep_to, :]
        self.layer.values = self.layer.values[..., keep_from:keep_to, :]
        self.layer.cumulative_length = target

    def snapshot(self) -> WindowState:
        if not self.layer.is_initialized:
            return WindowState(None, None, self.layer.cumulative_length)
        window = self.layer.sliding_window - 1
        return WindowState(
            self.layer.keys[..., -window:, :].clone(),
            self.layer.values[..., -window:, :].clone(),
            self.layer.cumulative_length,
        )

    def restore(self, state: WindowState, current: int, position: int) -> None:
        if state.keys is None:
            self.layer.keys = self.layer.values = None
            self.layer.is_initialized = False
            self.layer.cumulative_length = 0
            return
        # Safe to share: layers only ever replace their tensors (torch.cat, slicing), never write in place.
        if not self.layer.is_initialized:
            self.layer.lazy_initialization(state.keys, state.values)
        self.layer.keys, self.layer.values = state.keys, state.values
        self.layer.cumulative_length = state.cumulative_length

    def trim(self) -> None:
        if self.layer.is_initialized and self._stored() > self.layer.sliding_window - 1:
            window = self.layer.sliding_window - 1
            # Clone so the long recorded tensor can be freed.
            self.layer.keys = self.layer.keys[..., -window:, :].clone()
            self.layer.values = self.layer.values[..., -window:, :].clone()

    def append_states(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        super().append_states(keys, values)
        self.layer.cumulative_length += keys.shape[-2]

    def to(self, device: torch.device | str) -> None:
        super().to(device)
        self.layer._sliding_window_tensor = self.layer._sliding_window_tensor.to(device)


_RECURRENT_FIELDS = (
    "conv_states",
    "recurrent_states",
    "is_conv_states_initialized",
    "is_recurrent_states_initialized",
    "has_previous_state",
    "conv_kernel_size",
)


class RecurrentState(LayerKind):
    """Linear attention / state-space layers: the past is folded into states updated in place."""

    def can_crop(self, current: int, target: int) -> bool:
        return target == current

    def crop(self, current: int, target: int) -> None:
        if target != current:
            raise RuntimeError("a recurrent state cannot be cropped; restore a checkpoint")

    def snapshot(self) -> dict[str, dict]:
        state = {}
        for name in _RECURRENT_FIELDS:
            field = getattr(self.layer, name)
            # Clone: the model updates these tensors in place (`copy_`).
            state[name] = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in field.items()}
        return state

    def restore(self, state: dict[str, dict], current: int, position: int) -> None:
        for name in _RECURRENT_FIELDS:
            restored = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state[name].items()}
            setattr(self.layer, name, restored)
        first = next(self.tensors(), None)
        if first is not None and self.layer.device is None:
            self.layer.dtype, self.layer.device = first.dtype, first.device

    def tensors(self) -> Iterator[torch.Tensor]:
        for field in (self.layer.conv_states, self.layer.recurrent_states):
            yield from (t for t in field.values() if isinstance(t, torch.Tensor))

    def to(self, device: torch.device | str) -> None:
        for field in (self.layer.conv_states, self.layer.recurrent_states):
            for key, tensor in field.items():
                if isinstance(tensor, torch.Tensor):
                    field[key] = tensor.to(device)
        if self.layer.device is not None:
            self.layer.device = torch.device(device)


# Exact classes only: a subclass may store more (quantized, indexed) and crop differently.
_KINDS_BY_LAYER_CLASS: dict[type, tuple[type[LayerKind], ...]] = {
    DynamicLayer: (FullAttention,),
    GrowingLayer: (FullAttention,),
    QuantizedLayer: (QuantizedAttention,),
    DynamicSlidingWindowLayer: (SlidingWindow,),
    LinearAttentionLayer: (RecurrentState,),
    LinearAttentionAndFullAttentionLayer: (RecurrentState, FullAttention),
    LinearAttentionAndSlidingWindowAttentionLayer: (RecurrentState, SlidingWindow),
    DummyLayer: (),  # layers that share another layer's states or have no attention: nothing stored
}


def layer_kinds(cache: DynamicCache) -> list[LayerKind]:
    """The rollback behaviour of every layer of `cache`, in layer order."""
    kinds: list[LayerKind] = []
    for layer in cache.layers:
        if type(layer) not in _KINDS_BY_LAYER_CLASS:
            raise UnsupportedCacheLayer(f"no exact rollback is known for cache layer {type(layer).__name__}")
        kinds.extend(kind(layer) for kind in _KINDS_BY_LAYER_CLASS[type(layer)])
    return kinds


def needs_checkpoints(kinds: list[LayerKind]) -> bool:
    return not all(kind.crops_anywhere for kind in kinds)


def takes_back_recent(kinds: list[LayerKind]) -> bool:
    """Whether tokens fed since the last checkpoint can always be taken back by a crop (a decode
    step's verified guesses, chat/scheduling/drafting.py): full attention and quantized codes crop anywhere;
    a sliding window records what it was fed since its last trim, which happens only at a
    checkpoint; a recurrent state folded the tokens in and cannot give them back."""
    return all(kind.crops_anywhere or (isinstance(kind, SlidingWindow) and kind.layer.record_past) for kind in kinds)


def guess_point(kinds: list[LayerKind], position: int) -> Checkpoint | None:
    """Where a decode step that feeds guesses starts, for layers that cannot give guesses back by
    a crop (recurrent states fold every token in): their states at `position`, held by the
    caller for that step only (not in the store, whose checkpoints a Retry goes back to; no
    trim). None where every layer crops back exactly (`takes_back_recent`)."""
    if takes_back_recent(kinds):
        return None
    return Checkpoint(position, [kind.snapshot() if isinstance(kind, RecurrentState) else None for kind in kinds])


def back_to_point(kinds: list[LayerKind], point: Checkpoint, current: int) -> None:
    """Undo a step begun at `point` (`guess_point`): recurrent states as they were there, every
    other layer cropped back to it (exact: a sliding window records since its last trim)."""
    if any(state is None and not kind.can_crop(current, point.position) for kind, state in zip(kinds, point.states)):
        raise RuntimeError(f"cannot go back from {current} to the step's start at {point.position}")
    for kind, state in zip(kinds, point.states, strict=True):
        if state is None:
            kind.crop(current, point.position)
        else:
            kind.restore(state, current, point.position)


def take_checkpoint(kinds: list[LayerKind], position: int) -> Checkpoint:
    """Snapshot the bounded states at `position`, then trim the sliding windows behind it."""
    checkpoint = Checkpoint(position, [kind.snapshot() for kind in kinds])
    for kind in kinds:
        kind.trim()
    return checkpoint


RollbackHow = Literal["none", "crop", "checkpoint", "rebuild"]


@dataclass(frozen=True)
class RollbackResult:
    position: int  # where the cache now ends; <= the target asked for
    how: RollbackHow


def reachable(kinds: list[LayerKind], checkpoints: CheckpointStore, current: int, target: int) -> int:
    """Where `roll_back(..., target)` would land, without moving anything."""
    if target >= current or all(kind.can_crop(current, target) for kind in kinds):
        return min(target, current)
    checkpoint = checkpoints.latest_at_or_before(target)
    return checkpoint.position if checkpoint is not None else 0


def roll_back(kinds: list[LayerKind], checkpoints: CheckpointStore, current: int, target: int) -> RollbackResult:
    """Move the cache from `current` back to `target` (or to the closest exact point before it).

    "rebuild" means no exact path exists: the caller must start again from an empty cache.
    """
    if target > current:
        raise ValueError(f"cannot roll forward from {current} to {target}")
    if target == current:
        return RollbackResult(current, "none")
    checkpoints.drop_after(target)
    if all(kind.can_crop(current, target) for kind in kinds):
        for kind in kinds:
            kind.crop(current, target)
        return RollbackResult(target, "crop")
    checkpoint = checkpoints.latest_at_or_before(target)
    if checkpoint is None:
        checkpoints.clear()
        return RollbackResult(0, "rebuild")
    for kind, state in zip(kinds, checkpoint.states, strict=True):
        kind.restore(state, current, checkpoint.position)
    return RollbackResult(checkpoint.position, "checkpoint")
