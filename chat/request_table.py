"""The scheduler's one record of its requests (chat/scheduler.py): what waits, what prefills, what
decodes, and which replies are being made in another process (a ZeroGPU worker).

It is the only meaning of "in use": the cache owner never frees, spills or releases a session
this table holds (cache_sessions/owner.py reads `in_use`). Any thread reads it under its lock; the
loop moves requests between the lists, and `submit` adds to the waiting ones.
"""

from __future__ import annotations

import threading
from collections import Counter, deque
from contextlib import contextmanager
from typing import TYPE_CHECKING, Collection, Iterator

from cache_sessions.session import CacheSession

if TYPE_CHECKING:
    from chat.scheduler import GenerationRequest


class RequestTable:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.waiting: deque[GenerationRequest] = deque()
        self.prefilling: list[GenerationRequest] = []
        self.decoding: list[GenerationRequest] = []
        self._elsewhere: Counter[CacheSession] = Counter()  # replies made in another process

    def everyone(self) -> list["GenerationRequest"]:
        with self.lock:
            return [*self.waiting, *self.prefilling, *self.decoding]

    def in_use(self) -> set[CacheSession]:
        """The sessions of every request not yet ended, and of replies made elsewhere."""
        with self.lock:
            return {request.session for request in (*self.waiting, *self.prefilling, *self.decoding)} | set(
                self._elsewhere)

    def has_work(self, besides: Collection["GenerationRequest"] = ()) -> bool:
        """Whether any request could go on, `besides` those (waiting on the disk)."""
        with self.lock:
            return bool(self.waiting or self.decoding or any(r not in besides for r in self.prefilling))

    @contextmanager
    def held_elsewhere(self, session: CacheSession) -> Iterator[None]:
        with self.lock:
            self._elsewhere[session] += 1
        try:
            yield
        finally:
            with self.lock:
                self._elsewhere[session] -= 1
                if not self._elsewhere[session]:
                    del self._elsewhere[session]

    def admit(self, rows: int) -> list["GenerationRequest"]:
        """Waiting requests start prefilling while fewer than `rows` are admitted; returns those
        stopped while they waited (out of the table, their caches never touched)."""
        with self.lock:
            stopped = [request for request in self.waiting if request.stop.is_set()]
            for request in stopped:
                self.waiting.remove(request)
            while self.waiting and len(self.prefilling) + len(self.decoding) < rows:
                self.prefilling.append(self.waiting.popleft())
        return stopped

    def start_decoding(self, request: "GenerationRequest") -> None:
        with self.lock:
            self.prefilling.remove(request)
            self.decoding.append(request)

    def remove(self, requests: list["GenerationRequest"]) -> None:
        """Out of the table, from whichever list holds them."""
        with self.lock:
            for request in requests:
                (self.decoding if request in self.decoding else self.prefilling).remove(request)

    def take_everyone(self) -> list["GenerationRequest"]:
        """Every request, out of the table (a fault of the scheduler itself ends them all)."""
        with self.lock:
            everyone = [*self.waiting, *self.prefilling, *self.decoding]
            self.waiting.clear()
            self.prefilling, self.decoding = [], []
        return everyone
