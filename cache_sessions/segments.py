"""Segments: the states a cache gained over a span of tokens, cut out to be put back later.

A reply version that is switched away from keeps its segment; switching back rolls the cache
to where the reply began and appends the segment, with no forward pass. A shared prefix (a
system prompt) is a segment that starts at 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import torch

from cache_sessions.checkpoints import tensors_in, moved


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
