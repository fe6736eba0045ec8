"""Shared prefixes: the prefilled states of a common prompt start (a system prompt), kept once.

A new conversation whose prompt starts with a stored prefix begins from a copy of it instead of
prefilling it again. Entries are evicted least recently used first.
"""

from __future__ import annotations

import threading
import time
from typing import Sequence

from cache_sessions.segments import Segment

DEFAULT_MAX_ENTRIES = 8


class PrefixStore:
    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES):
        self.max_entries = max_entries
        self._entries: dict[tuple[int, ...], Segment] = {}
        self._last_used: dict[tuple[int, ...], float] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def find(self, prompt_ids: Sequence[int]) -> Segment | None:
        """The longest stored prefix of `prompt_ids`."""
        with self._lock:
            best = None
            for key, segment in self._entries.items():
                if len(key) <= len(prompt_ids) and tuple(prompt_ids[: len(key)]) == key:
                    if best is None or len(key) > len(best.token_ids):
                        best = segment
            if best is not None:
                self._last_used[tuple(best.token_ids)] = time.monotonic()
            return best

    def has(self, token_ids: Sequence[int]) -> bool:
        return tuple(token_ids) in self._entries

    def add(self, segment: Segment) -> None:
        if segment.start != 0:
            raise ValueError("a shared prefix starts at position 0")
        if self.max_entries == 0:
            return
        key = tuple(segment.token_ids)
        with self._lock:
            self._entries[key] = segment
            self._last_used[key] = time.monotonic()
            while len(self._entries) > self.max_entries:
                self._evict_oldest()

    def evict_one(self) -> bool:
        with self._lock:
            if not self._entries:
                return False
            self._evict_oldest()
            return True

    def _evict_oldest(self) -> None:
        oldest = min(self._last_used, key=self._last_used.__getitem__)
        del self._entries[oldest], self._last_used[oldest]

    def nbytes(self) -> int:
        with self._lock:
            return sum(segment.nbytes() for segment in self._entries.values())
