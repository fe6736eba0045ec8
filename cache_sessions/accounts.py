"""What the cache owner knows of each session without touching its tensors: when it was last
used, its bytes as last measured, and whether its conversation is gone. Which sessions are in use
is not kept here: that is the scheduler's record of its requests (`in_use`, passed in). Any
thread may close and read; only the owner, on the loop, measures and marks use."""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Callable, Collection

from cache_sessions.session import CacheSession


@dataclass
class _Entry:
    last_used: float
    nbytes: int = 0
    closing: bool = False


@dataclass(frozen=True)
class Idle:
    session: CacheSession
    last_used: float
    nbytes: int


class Accounts:
    def __init__(self, clock: Callable[[], float]):
        self._clock = clock
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        self._entries: weakref.WeakKeyDictionary[CacheSession, _Entry] = weakref.WeakKeyDictionary()

    def register(self, session: CacheSession) -> None:
        with self._lock:
            self._entry(session)

    def used(self, session: CacheSession) -> None:
        """An operation of its conversation (a reply, a move) begins or ends now: the budget frees
        the least recently used first."""
        with self._lock:
            self._entry(session).last_used = self._clock()

    def close(self, session: CacheSession) -> None:
        with self._lock:
            self._entry(session).closing = True

    def take_closed(self, in_use: Collection[CacheSession]) -> list[CacheSession]:
        """The closed sessions no request holds any more, forgotten here."""
        with self._lock:
            closed = [session for session, entry in self._entries.items() if entry.closing and session not in in_use]
            for session in closed:
                del self._entries[session]
        return closed

    def measured(self, session: CacheSession, nbytes: int) -> None:
        with self._lock:
            self._entry(session).nbytes = nbytes

    def idle(self, in_use: Collection[CacheSession]) -> list[Idle]:
        with self._lock:
            return [Idle(session, entry.last_used, entry.nbytes) for session, entry in self._entries.items()
                    if session not in in_use]

    def totals(self) -> tuple[int, int]:
        """(sessions, their bytes)."""
        with self._lock:
            entries = list(self._entries.values())
        return len(entries), sum(entry.nbytes for entry in entries)

    def _entry(self, session: CacheSession) -> _Entry:
        entry = self._entries.get(session)
        if entry is None:
            entry = self._entries[session] = _Entry(self._clock())
        return entry
