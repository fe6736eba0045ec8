"""What the cache owner knows of each session without touching its tensors: pins (busy), when it
was last used, its bytes as last measured, and whether its conversation is gone. Any thread may
pin, unpin, close and read; only the owner, on the loop, measures."""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Callable

from cache_sessions.session import CacheSession


@dataclass
class _Entry:
    last_used: float
    pins: int = 0
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

    def pin(self, session: CacheSession) -> None:
        with self._lock:
            entry = self._entry(session)
            entry.pins += 1
            entry.last_used = self._clock()

    def unpin(self, session: CacheSession) -> bool:
        """True when that was its last pin."""
        with self._lock:
            entry = self._entry(session)
            entry.pins -= 1
            entry.last_used = self._clock()
            return entry.pins == 0

    def close(self, session: CacheSession) -> None:
        with self._lock:
            self._entry(session).closing = True

    def take_closed(self) -> list[CacheSession]:
        """The closed sessions no operation holds any more, forgotten here."""
        with self._lock:
            closed = [session for session, entry in self._entries.items() if entry.closing and not entry.pins]
            for session in closed:
                del self._entries[session]
        return closed

    def measured(self, session: CacheSession, nbytes: int) -> None:
        with self._lock:
            self._entry(session).nbytes = nbytes

    def idle(self) -> list[Idle]:
        with self._lock:
            return [Idle(session, entry.last_used, entry.nbytes) for session, entry in self._entries.items()
                    if not entry.pins]

    def totals(self) -> tuple[int, int, int]:
        """(sessions, busy ones, their bytes)."""
        with self._lock:
            entries = list(self._entries.values())
        return len(entries), sum(1 for entry in entries if entry.pins), sum(entry.nbytes for entry in entries)

    def _entry(self, session: CacheSession) -> _Entry:
        entry = self._entries.get(session)
        if entry is None:
            entry = self._entries[session] = _Entry(self._clock())
        return entry
