"""Many cache sessions on one model: a global byte budget, a session count, idle expiry.

Sessions are found by keys this class makes (never by an id a client sends). When the caches
together exceed the budget, the segments idle sessions keep for branches not shown go first,
oldest first (switching to such a branch then prefills it); then the least recently used *idle*
session is released: its owner keeps everything else (a conversation keeps its messages) and
its next turn rebuilds. A session in use (a generation running) is never touched.
"""

from __future__ import annotations

import secrets
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Protocol

from cache_sessions.prefixes import PrefixStore
from cache_sessions.session import CacheSession


class HasCacheSession(Protocol):
    session: CacheSession


class TooManySessions(RuntimeError):
    """Every session slot is held by a session in use."""


@dataclass
class _Slot:
    owner: Any
    last_used: float
    in_use: int = 0


@dataclass
class ManagerStats:
    sessions: int
    in_use: int
    cache_bytes: int
    shared_prefix_bytes: int
    evictions: int
    expired: int
    closed_for_room: int = 0
    budget_bytes: int | None = None
    segments_freed: int = 0


class SessionManager:
    def __init__(self, *, budget_bytes: int | None = None, max_sessions: int | None = None,
                 idle_timeout_s: float | None = None, prefix_store: PrefixStore | None = None,
                 clock: Callable[[], float] = time.monotonic, on_close: Callable[[str], None] | None = None,
                 extra_bytes: Callable[[], int] | None = None):
        """`on_close(key)` is told of every key that stops being valid (closed, expired, made room
        for), so whoever mapped something to it can forget it. `extra_bytes()`: memory held for
        the sessions elsewhere (a batched copy of the decoding caches), counted in the budget."""
        self.budget_bytes = budget_bytes
        self.max_sessions = max_sessions
        self.idle_timeout_s = idle_timeout_s
        self.prefix_store = prefix_store
        self._clock = clock
        self._on_close = on_close
        self._extra_bytes = extra_bytes
        self._slots: dict[str, _Slot] = {}
        self._lock = threading.RLock()
        self.evictions = 0
        self.expired = 0
        self.closed_for_room = 0
        self.segments_freed = 0

    def open(self, owner: HasCacheSession) -> str:
        """Register `owner` and return the new key that finds it."""
        with self._lock:
            self.expire_idle()
            if self.max_sessions is not None and len(self._slots) >= self.max_sessions:
                idle = [key for key, slot in self._slots.items() if not slot.in_use]
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

    @contextmanager
    def using(self, key: str) -> Iterator[Any]:
        """Mark the session busy (not evictable) while the block runs, then hold the budget."""
        with self._lock:
            slot = self._slots.get(key)
            if slot is None:
                raise KeyError("no such session")
            slot.in_use += 1
        try:
            yield slot.owner
        finally:
            with self._lock:
                slot.in_use -= 1
                slot.last_used = self._clock()
            self.enforce_budget()

    def close(self, key: str | None) -> None:
        with self._lock:
            slot = self._slots.pop(key, None) if isinstance(key, str) else None
        if slot is None:
            return
        if not slot.in_use:
            slot.owner.session.release()
        if self._on_close is not None:
            self._on_close(key)

    def expire_idle(self) -> list[str]:
        if self.idle_timeout_s is None:
            return []
        with self._lock:
            now = self._clock()
            stale = [k for k, s in self._slots.items() if not s.in_use and now - s.last_used > self.idle_timeout_s]
            for key in stale:
                self.close(key)
            self.expired += len(stale)
            return stale

    def total_bytes(self) -> int:
        with self._lock:
            owners = [slot.owner for slot in self._slots.values()]
        shared = self.prefix_store.nbytes() if self.prefix_store is not None else 0
        extra = self._extra_bytes() if self._extra_bytes is not None else 0
        return shared + extra + sum(owner.session.nbytes() for owner in owners)

    def enforce_budget(self) -> list[str]:
        """Free kept branch segments of idle sessions (oldest first), then release idle sessions
        (least recently used first), then shared prefixes, until within budget."""
        if self.budget_bytes is None:
            return []
        released: list[str] = []
        with self._lock:
            while self.total_bytes() > self.budget_bytes:
                keeping = [slot.owner.session for slot in self._slots.values()
                           if not slot.in_use and slot.owner.session.segment_count()]
                if keeping:
                    min(keeping, key=lambda session: session.oldest_segment_age()).drop_oldest_segment()
                    self.segments_freed += 1
                    continue
                idle = [key for key, slot in self._slots.items()
                        if not slot.in_use and slot.owner.session.nbytes() > 0 and key not in released]
                if idle:
                    key = min(idle, key=lambda k: self._slots[k].last_used)
                    self._slots[key].owner.session.release()
                    released.append(key)
                    self.evictions += 1
                elif self.prefix_store is None or not self.prefix_store.evict_one():
                    break  # only sessions in use are left: they finish first
        return released

    def __contains__(self, key: object) -> bool:
        return key in self._slots

    def __len__(self) -> int:
        return len(self._slots)

    def stats(self) -> ManagerStats:
        with self._lock:
            return ManagerStats(
                sessions=len(self._slots),
                in_use=sum(1 for slot in self._slots.values() if slot.in_use),
                cache_bytes=self.total_bytes(),
                shared_prefix_bytes=self.prefix_store.nbytes() if self.prefix_store is not None else 0,
                evictions=self.evictions,
                expired=self.expired,
                closed_for_room=self.closed_for_room,
                budget_bytes=self.budget_bytes,
                segments_freed=self.segments_freed,
            )
