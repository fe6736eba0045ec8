"""The tensors of one conversation's cache: a `DynamicCache`, the rollback kind of each of its
layers, checkpoints and kept segments, with the ledger of token ids they hold. Rolling back,
memory and device moves live here; `CacheSession` adds the prompt-driven path on top.
"""

from __future__ import annotations

from typing import Hashable, Iterator, Sequence

import torch
from transformers import PreTrainedModel

from cache_sessions.checkpoints import Checkpoint, CheckpointStore
from cache_sessions.kv_cache import CacheShape, KVCacheKind
from cache_sessions.rollback import (
    LayerKind,
    RollbackResult,
    back_to_point,
    guess_point,
    layer_kinds,
    needs_checkpoints,
    reachable,
    roll_back,
    take_checkpoint,
    takes_back_recent,
)
from cache_sessions.segments import SegmentStore
from cache_sessions.tensors import storage_bytes

DEFAULT_MAX_CHECKPOINTS = 16


class CacheStates:
    def __init__(self, model: PreTrainedModel, *, max_checkpoints: int = DEFAULT_MAX_CHECKPOINTS,
                 kv_cache: KVCacheKind = KVCacheKind()):
        """`model`: only its shape is kept (its config and dtype: what a new cache is made for);
        a session never runs the model (chat/model_step/ does). `kv_cache`: the kind of cache the
        states live in (cache_sessions/kv_cache.py)."""
        self.shape = CacheShape(model.config, model.dtype)
        self.max_checkpoints = max_checkpoints
        self.kv_cache = kv_cache
        self.token_ids: list[int] = []
        # The ids of the messages whose tokens the ledger holds, in order, as its owner names
        # them (cache_sessions/branches.py): what to keep and put back, never what is exact.
        self.labels: list[Hashable] = []
        self._segments = SegmentStore()
        self._states_lost = False
        self._fork: int | None = None  # where the last prompt parted from the cache, if not reached yet
        self._reset_cache()

    def _reset_cache(self) -> None:
        self.cache = self.kv_cache.new_cache(self.shape)
        self._kinds = layer_kinds(self.cache)
        for kind in self._kinds:
            kind.set_up()
        self._uses_checkpoints = needs_checkpoints(self._kinds)
        self.checkpoints = CheckpointStore(self.max_checkpoints if self._uses_checkpoints else 0)
        self.token_ids = []
        self.labels = []
        # The logits after a prompt this cache holds, as the step that fed its last token gave
        # them: a Retry of that prompt, or the Send of a prepared one, takes its first token from
        # them with no step (cache_sessions/session.py, `next_logits`).
        self._next_logits: tuple[list[int], torch.Tensor] | None = None

    @property
    def kinds(self) -> tuple[LayerKind, ...]:
        """How each cache layer rolls back, in layer order (read-only: for inspection and tests)."""
        return tuple(self._kinds)

    def __getstate__(self) -> dict:
        """Pickled without its shape (a session crosses to a GPU worker process and back, and to
        the cold tier, whose reader takes only the classes states are made of)."""
        state = self.__dict__.copy()
        state["shape"] = None
        return state

    def take_state_of(self, other: "CacheStates") -> None:
        """Become `other` (this session, updated in a worker process), keeping this one's shape."""
        shape = self.shape
        self.__dict__.update(other.__dict__)
        self.shape = shape

    def rollback_to(self, target: int) -> RollbackResult:
        """Go back to `target` tokens, or to the closest exact point before it."""
        self._segments.drop_after(target)
        result = roll_back(self._kinds, self.checkpoints, len(self.token_ids), target)
        if result.how == "rebuild":
            self._reset_cache()
        self.token_ids = self.token_ids[: result.position]
        return result

    def crops_anywhere(self) -> bool:
        """Whether every layer's states can be cut back to any earlier position (full attention,
        quantized codes): no checkpoints needed."""
        return not needs_checkpoints(self._kinds)

    def takes_back_recent(self) -> bool:
        """Whether tokens fed after the last checkpoint can be taken back exactly (`take_back`)."""
        return takes_back_recent(self._kinds)

    def take_back(self, count: int, point: Checkpoint | None = None) -> None:
        """Drop the last `count` tokens fed (guesses a step verified and refused): a crop, exact
        where `takes_back_recent`; else back to `point`, the step's start (`guess_point`), and the
        caller feeds again what the step took. Anything else (a checkpoint further back, a
        rebuild) would lose what the reply needs, so it releases the states and raises instead."""
        if count <= 0:
            return
        if point is not None:
            self.back_to(point)
            return
        target = len(self.token_ids) - count
        if target < 0 or self.rollback_to(target).position != target:
            self.release()
            raise RuntimeError(f"could not take back the last {count} tokens fed")

    def guess_point(self) -> Checkpoint | None:
        """Where a step that feeds guesses begins, for a cache whose fed tokens `take_back` cannot
        crop (recurrent states): the caller holds it for that step and gives it to `back_to`
        if guesses were refused. None where `take_back` serves."""
        return guess_point(self._kinds, len(self.token_ids))

    def back_to(self, point: Checkpoint) -> None:
        """Undo everything fed since `point` (the tokens the step took are fed again after it)."""
        current = len(self.token_ids)
        if point.position > current:
            raise ValueError(f"the step began at {point.position}, past the {current} tokens held")
        self._segments.drop_after(point.position)
        self.checkpoints.drop_after(point.position)
        try:
            back_to_point(self._kinds, point, current)
        except BaseException:
            self.release()  # some layers moved, others not: nothing here can be trusted
            raise
        self.token_ids = self.token_ids[:point.position]

    def note_extended(self, token_ids: Sequence[int]) -> None:
        """The cache now also holds `token_ids` (fed here, put back as a segment, or decoded in a
        batch): add them to the ledger."""
        self.token_ids = self.token_ids + list(token_ids)
        self._check_invariant()

    def reachable(self, target: int) -> int:
        """Where `rollback_to(target)` would land (a checkpoint before it, where crops cannot go)."""
        return reachable(self._kinds, self.checkpoints, len(self.token_ids), target)

    # ---- internals -----------------------------------------------------------------------------
    def _checkpoint_here(self) -> None:
        position = len(self.token_ids)
        if self._uses_checkpoints and position > 0 and not self.checkpoints.has(position):
            self.checkpoints.add(take_checkpoint(self._kinds, position), keep=self._segments.starts())

    def _check_invariant(self) -> None:
        if self.cache.get_seq_length() != len(self.token_ids):
            held = self.cache.get_seq_length()
            self.release()
            raise RuntimeError(f"cache holds {held} tokens but the ledger {len(self.token_ids)}")

    # ---- memory ---------------------------------------------------------------------------------
    def release(self) -> None:
        """Free every tensor (memory pressure, or states that cannot be trusted after a failure
        mid-update); the next `rewind_to` rebuilds and says so."""
        self._states_lost = self._states_lost or bool(self.token_ids)
        self._segments = SegmentStore()
        self._reset_cache()

    def mark_rebuilt(self) -> None:
        """The states this session's owner once had are gone (it was restored from saved text):
        the next `rewind_to` computes the history again and says so."""
        self._states_lost = True

    def tensors(self) -> Iterator[torch.Tensor]:
        for kind in self._kinds:
            yield from kind.tensors()
        yield from self.checkpoints.tensors()
        yield from self._segments.tensors()
        if self._next_logits is not None:
            yield self._next_logits[1]

    def nbytes(self) -> int:
        """Bytes held by the cache, checkpoints and segments, each storage once (crops are views)."""
        return storage_bytes(self.tensors())

    def to(self, device: torch.device | str) -> None:
        """Move every held tensor, e.g. to the CPU between ZeroGPU calls."""
        for kind in self._kinds:
            kind.to(device)
        for checkpoint in self.checkpoints:
            checkpoint.to(device)
        self._segments.to(device)
        if self._next_logits is not None:
            self._next_logits = (self._next_logits[0], self._next_logits[1].to(device))
