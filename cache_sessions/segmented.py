"""The states of a conversation with spans of them cut out and put back: a reply's other
versions and branches (cache_sessions/branches.py) keep their states as segments, put back on
top of their start without a forward pass. Kept here under keys the caller chooses, since a
rollback must drop those that start past it (`CacheStates.rollback_to`)."""

from __future__ import annotations

from typing import Hashable, Sequence

from cache_sessions.segments import Segment
from cache_sessions.states import CacheStates


class SegmentedStates(CacheStates):
    def stash_segment(self, key: Hashable, start: int, labels: Sequence[Hashable] = ()) -> bool:
        """Keep the states from `start` to the end under `key` (replacing what it held), to come
        back to them later, with the labels of the messages they cover; False when the cache
        holds nothing past `start`."""
        if not 0 <= start < len(self.token_ids):
            return False
        segment = self.cut_segment(start)
        segment.labels = list(labels)
        self._segments.put(key, segment)
        return True

    def restore_segment(self, key: Hashable, labels_before: Sequence[Hashable] = ()) -> bool:
        """Put back the segment kept under `key`, which is then no longer kept apart (it is in the
        cache); the ledger's labels become `labels_before` and the segment's. False when there is
        none or the cache cannot reach its start (it is dropped)."""
        segment = self._segments.pop(key)
        if segment is None or not self.append_segment(segment):
            return False
        self.labels = list(labels_before) + segment.labels
        return True

    def segment_start(self, key: Hashable) -> int | None:
        segment = self._segments.get(key)
        return segment.start if segment is not None else None

    def drop_oldest_segment(self) -> bool:
        """Free the segment kept longest (memory pressure); False when none is kept."""
        return self._segments.drop_oldest()

    def segment_count(self) -> int:
        return len(self._segments)

    def oldest_segment_age(self) -> int | None:
        return self._segments.oldest_age()

    def cut_segment(self, start: int, end: int | None = None) -> Segment:
        """The states for positions [start, end) (`end` None: now), as a copy that later changes do
        not touch. An `end` before now is only for layers that crop anywhere (`crops_anywhere`):
        the others keep one state, the one at now."""
        now = len(self.token_ids)
        end = now if end is None else end
        if not 0 <= start <= end <= now:
            raise ValueError(f"segment [{start}, {end}) outside the cache (0..{now})")
        if end < now and not self.crops_anywhere():
            raise ValueError("only a cache whose layers crop anywhere gives a segment that ends before now")
        return Segment(start, self.token_ids[start:end], [kind.cut_segment(start, end) for kind in self._kinds])

    def append_segment(self, segment: Segment) -> bool:
        """Put `segment` back on top of its start; False (the cache untouched) when the cache
        cannot reach that start exactly."""
        if len(self.token_ids) < segment.start or self.reachable(segment.start) != segment.start:
            return False
        self.rollback_to(segment.start)
        self._append(segment)
        self._checkpoint_here()
        return True

    def _append(self, segment: Segment) -> None:
        for kind, state in zip(self._kinds, segment.states, strict=True):
            kind.append_segment(state, segment.start, segment.end)
        self.note_extended(segment.token_ids)

