"""Many sessions on one server: found by keys this class makes (never by an id a client sends),
held to a count, and expired when idle.

Each entry is an owner that says whether it is busy and closes itself (a browser's chat closes
its conversation, which frees its cache once its operation ends). The memory the caches hold is
the cache owner's to budget (cache_sessions/owner.py); this class never touches a cache, so it
lives beside the conversations the UI reaches through `chat` (nothing under ui/ imports
cache_sessions).
"""

from __future__ import annotations

import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol


class Closable(Protocol):
    @property
    def busy(self) -> bool: ...

    def close(self) -> None: ...


class TooManySessions(RuntimeError):
    """Every session slot is held by a busy session."""


@dataclass
class _Slot:
    owner: Any
    last_used: float


@dataclass(frozen=True)
class ManagerStats:
    sessions: int
    busy: int
    expired: int
    closed_for_room: int


class SessionManager:
    def __init__(self, *, max_sessions: int | None = None, idle_timeout_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic, on_close: Callable[[str], None] | None = None,
                 expire_every_s: float | None = None):
        """`on_close(key)` is told of every key that stops being valid (closed, expired, made room
        for), so whoever mapped something to it can forget it. `expire_every_s`: also expire idle
        sessions on a timer (a daemon thread), not only when someone looks one up."""
        self.max_sessions = max_sessions
        self.idle_timeout_s = idle_timeout_s
        self._clock = clock
        self._on_close = on_close
        self._slots: dict[str, _Slot] = {}
        self._lock = threading.RLock()
        self.expired = 0
        self.closed_for_room = 0
        self._stopped = threading.Event()
        if expire_every_s is not None and idle_timeout_s is not None:
            threading.Thread(target=self._expire_every, args=(expire_every_s,), name="session-expiry",
                             daemon=True).start()

    def _expire_every(self, period_s: float) -> None:
        while not self._stopped.wait(period_s):
            self.expire_idle()

    def stop_timer(self) -> None:
        self._stopped.set()

    def open(self, owner: Closable) -> str:
        """Register `owner` and return the new key that finds it."""
        with self._lock:
            self.expire_idle()
            if self.max_sessions is not None and len(self._slots) >= self.max_sessions:
                idle = [key for key, slot in self._slots.items() if not slot.owner.busy]
                if not idle:
                    raise TooManySessions(f"all {self.max_sessions} sessions are busy; try again shortly")
                self.close(min(idle, key=lambda key: self._slots[key].last_used))
                self.closed_for_room += 1
            key = secrets.token_urlsafe(18)
            self._slots[key] = _Slot(owner, self._clock())
            return key

    def get(self, key: str | None) -> Any | None:
        with self._lock:
            self.expire_idle()
            slot = self._slots.get(key) if isinstance(key, str) else None
            if slot is None:
                return None
            slot.last_used = self._clock()
            return slot.owner

    def rekey(self, key: str | None) -> str | None:
        """Move a session to a new key, open as it was (another page takes it over; the old key
        finds nothing from now on, and `on_close` is told it stopped being valid). None if `key`
        holds nothing."""
        with self._lock:
            slot = self._slots.pop(key, None) if isinstance(key, str) else None
            if slot is None:
                return None
            new_key = secrets.token_urlsafe(18)
            slot.last_used = self._clock()
            self._slots[new_key] = slot
        if self._on_close is not None:
            self._on_close(key)
        return new_key

    def close(self, key: str | None) -> None:
        with self._lock:
            slot = self._slots.pop(key, None) if isinstance(key, str) else None
        if slot is None:
            return
        slot.owner.close()
        if self._on_close is not None:
            self._on_close(key)

    def expire_idle(self) -> list[str]:
        if self.idle_timeout_s is None:
            return []
        with self._lock:
            now = self._clock()
            for slot in self._slots.values():
                if slot.owner.busy:  # in use now: its idle time starts when it ends
                    slot.last_used = now
            stale = [key for key, slot in self._slots.items() if now - slot.last_used > self.idle_timeout_s]
            for key in stale:
                self.close(key)
            self.expired += len(stale)
            return stale

    def __contains__(self, key: object) -> bool:
        return key in self._slots

    def __len__(self) -> int:
        return len(self._slots)

    def stats(self) -> ManagerStats:
        with self._lock:
            return ManagerStats(sessions=len(self._slots), busy=sum(1 for s in self._slots.values() if s.owner.busy),
                                expired=self.expired, closed_for_room=self.closed_for_room)
