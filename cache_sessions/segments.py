"""Segments: the states a cache gained over a span of tokens, cut out to be put back later.

A reply version that is switched away from keeps its segment; switching back rolls the cache
to where the reply began and appends the segment, with no forward pass. A shared prefix (a
system prompt) is a segment that starts at 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Hashable, Iterator

import torch

from cache_sessions.tensors import moved, tensors_in


@dataclass
class Segment:
    start: int  # the cache held `start` tokens when the segment began
    token_ids: list[int]  # the tokens it covers, positions [start, start + len)
    states: list[Any]  # one entry per LayerKind

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)

    def tensors(self) -> Iterator[torch.Tensor]:
        yield from tensors_in(self.states)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def to(self, device: torch.device | str) -> None:
        self.states = moved(self.states, device)


class SegmentStore:
    """A session's kept segments, by a key its owner chooses (a reply version's id)."""

    def __init__(self) -> None:
        self._segments: dict[Hashable, Segment] = {}

    def __contains__(self, key: Hashable) -> bool:
        return key in self._segments

    def get(self, key: Hashable) -> Segment | None:
        return self._segments.get(key)

    def put(self, key: Hashable, segment: Segment) -> None:
        self._segments[key] = segment

    def drop(self, key: Hashable) -> None:
        self._segments.pop(key, None)

    def drop_after(self, position: int) -> None:
        """Forget segments that start past `position`: the cache below them is being replaced."""
        self._segments = {key: s for key, s in self._segments.items() if s.start <= position}

    def keep_only(self, keys: set[Hashable]) -> None:
        self._segments = {key: s for key, s in self._segments.items() if key in keys}

    def tensors(self) -> Iterator[torch.Tensor]:
        for segment in self._segments.values():
            yield from segment.tensors()

    def to(self, device: torch.device | str) -> None:
        for segment in self._segments.values():
            segment.to(device)
