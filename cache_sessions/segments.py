"""Segments: the states a cache gained over a span of tokens, cut out to be put back later.

A branch that is switched away from keeps its segment; switching back rolls the cache to where
the branch began and appends the segment, with no forward pass. A shared prefix (a
system prompt) is a segment that starts at 0.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Hashable, Iterator

import torch

from cache_sessions.tensors import filled_bytes, moved, tensors_in


@dataclass
class Segment:
    start: int  # the cache held `start` tokens when the segment began
    token_ids: list[int]  # the tokens it covers, positions [start, start + len)
    states: list[Any]  # one entry per LayerKind
    labels: list[Hashable] = field(default_factory=list)  # the messages it covers (cache_sessions/branches.py)

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)

    def tensors(self) -> Iterator[torch.Tensor]:
        yield from tensors_in(self.states)

    def nbytes(self) -> int:
        return filled_bytes(self.tensors())

    def to(self, device: torch.device | str) -> None:
        self.states = moved(self.states, device)


_ages = itertools.count()  # one order for every session's segments: "oldest" across sessions


class SegmentStore:
    """A session's kept segments, by a key its owner chooses (a message's id), oldest first."""

    def __init__(self) -> None:
        self._segments: dict[Hashable, Segment] = {}
        self._ages: dict[Hashable, int] = {}

    def __contains__(self, key: Hashable) -> bool:
        return key in self._segments

    def __len__(self) -> int:
        return len(self._segments)

    def get(self, key: Hashable) -> Segment | None:
        return self._segments.get(key)

    def put(self, key: Hashable, segment: Segment) -> None:
        self.pop(key)  # a new one is the youngest
        self._segments[key] = segment
        self._ages[key] = next(_ages)

    def pop(self, key: Hashable) -> Segment | None:
        self._ages.pop(key, None)
        return self._segments.pop(key, None)

    def oldest_age(self) -> int | None:
        """When the oldest segment was kept, in an order shared by all sessions; None if none is."""
        return next(iter(self._ages.values()), None)

    def drop_oldest(self) -> bool:
        if not self._segments:
            return False
        self.pop(next(iter(self._segments)))
        return True

    def drop_after(self, position: int) -> None:
        """Forget segments that start past `position`: the cache below them is being replaced."""
        for key in [key for key, s in self._segments.items() if s.start > position]:
            self.pop(key)

    def starts(self) -> set[int]:
        """Where the kept segments begin: the positions a switch back must roll the cache to."""
        return {segment.start for segment in self._segments.values()}

    def tensors(self) -> Iterator[torch.Tensor]:
        for segment in self._segments.values():
            yield from segment.tensors()

    def to(self, device: torch.device | str) -> None:
        for segment in self._segments.values():
            segment.to(device)
