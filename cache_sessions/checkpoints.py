"""Checkpoints: the bounded-size states of a cache at a token position, kept to roll back to.

Only layers that cannot be cropped exactly contribute (sliding windows, recurrent states); the
full-attention layers are cropped to the checkpoint's position instead, so a checkpoint costs
O(window + state size), never O(history).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Collection, Iterator

import torch

from cache_sessions.tensors import moved, tensors_in


@dataclass
class Checkpoint:
    position: int  # number of tokens the cache held when the snapshot was taken
    states: list[Any]  # one entry per LayerKind, in the same order

    def tensors(self) -> Iterator[torch.Tensor]:
        yield from tensors_in(self.states)

    def to(self, device: torch.device | str) -> None:
        self.states = moved(self.states, device)


class CheckpointStore:
    """Checkpoints ordered by position, at most `max_checkpoints` of them.

    Past the limit, the checkpoint dropped is the one whose loss leaves the smallest gap between
    its neighbours, never one of the newest `keep_newest`: recent turns stay finely covered (undo,
    regenerate), older ones coarsely but to the start, so an edit far back re-prefills from a
    nearby checkpoint instead of rebuilding everything. Nor one where a kept branch starts (its
    owner names them): switching back rolls the cache to exactly there, and without it the
    switch could only rebuild. Those may keep the store over its limit (the budget frees kept
    branches first).
    """

    keep_newest = 4

    def __init__(self, max_checkpoints: int):
        if max_checkpoints < 0:
            raise ValueError("max_checkpoints must be >= 0")
        self.max_checkpoints = max_checkpoints
        self._checkpoints: list[Checkpoint] = []

    def __len__(self) -> int:
        return len(self._checkpoints)

    def __iter__(self) -> Iterator[Checkpoint]:
        return iter(self._checkpoints)

    def positions(self) -> list[int]:
        return [checkpoint.position for checkpoint in self._checkpoints]

    def add(self, checkpoint: Checkpoint, keep: Collection[int] = ()) -> None:
        """`keep`: positions whose checkpoints must stay (where kept branches start)."""
        if self.max_checkpoints == 0:
            return
        self.drop_after(checkpoint.position - 1)
        self._checkpoints.append(checkpoint)
        while len(self._checkpoints) > self.max_checkpoints:
            cheapest = self._cheapest_to_drop(keep)
            if cheapest is None:
                return
            del self._checkpoints[cheapest]

    def _cheapest_to_drop(self, keep: Collection[int]) -> int | None:
        count = len(self._checkpoints)
        protected = min(self.keep_newest, count - 1)  # the newest always stays
        positions = [0] + self.positions()  # dropping i merges positions[i]..positions[i + 2]
        candidates = [i for i in range(count - protected) if positions[i + 1] not in keep]
        return min(candidates, key=lambda i: positions[i + 2] - positions[i], default=None)

    def has(self, position: int) -> bool:
        return any(checkpoint.position == position for checkpoint in self._checkpoints)

    def latest_at_or_before(self, position: int) -> Checkpoint | None:
        candidates = [checkpoint for checkpoint in self._checkpoints if checkpoint.position <= position]
        return candidates[-1] if candidates else None

    def drop_after(self, position: int) -> None:
        """Forget checkpoints past `position`: the tokens they describe are being replaced."""
        self._checkpoints = [checkpoint for checkpoint in self._checkpoints if checkpoint.position <= position]

    def clear(self) -> None:
        self._checkpoints.clear()

    def tensors(self) -> Iterator[torch.Tensor]:
        for checkpoint in self._checkpoints:
            yield from checkpoint.tensors()
