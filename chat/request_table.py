"""The scheduler's one record of its requests (chat/scheduler.py): what waits, what prefills, what
decodes, what was paused to give another client its share of the rows, and which replies are
being made in another process (a ZeroGPU worker).

Rows go to clients, not to requests in arrival order: one address may hold as
many conversations as there are rows, and took every row. A free row goes to the waiting (or
paused) request whose client holds the fewest rows; with none free, a client below its share
(the rows over the clients with requests) takes a decode row from the client holding the most,
which is paused: its states stay in its session, its reader simply waits, and it goes on, exact,
once a row is free for it again. A request with no client is a client of its own, so without
clients this is arrival order, as before.

It is the only meaning of "in use": the cache owner never frees, spills or releases a session
this table holds (cache_sessions/owner.py reads `in_use`). Any thread reads it under its lock; the
loop moves requests between the lists, and `submit` adds to the waiting ones.
"""

from __future__ import annotations

import threading
from collections import Counter, deque
from contextlib import contextmanager
from typing import Collection, Iterator

from cache_sessions.session import CacheSession
from chat.requests import GenerationRequest


class RequestTable:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.waiting: deque[GenerationRequest] = deque()
        self.prefilling: list[GenerationRequest] = []
        self.decoding: list[GenerationRequest] = []
        self.paused: list[GenerationRequest] = []  # decode rows given up for another client's share
        # prompts prepared ahead (a message being typed): prefilled only while no reply has work
        self.ahead: list[GenerationRequest] = []
        self._elsewhere: Counter[CacheSession] = Counter()  # replies made in another process

    def everyone(self) -> list[GenerationRequest]:
        with self.lock:
            return [*self.waiting, *self.prefilling, *self.decoding, *self.paused, *self.ahead]

    def in_use(self) -> set[CacheSession]:
        """The sessions of every request not yet ended, and of replies made elsewhere."""
        with self.lock:
            return {request.session for request in (*self.waiting, *self.prefilling, *self.decoding, *self.paused,
                                                    *self.ahead)} | set(self._elsewhere)

    def has_work(self, besides: Collection[GenerationRequest] = ()) -> bool:
        """Whether any request could go on, `besides` those (waiting on the disk)."""
        with self.lock:
            return bool(self.waiting or self.decoding or self.paused or any(r not in besides for r in self.prefilling)
                        or any(r not in besides for r in self.ahead))

    def idle(self) -> bool:
        """No reply has anything to do: what a text prepared ahead of its Send waits for."""
        with self.lock:
            return not (self.waiting or self.prefilling or self.decoding or self.paused)

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

    def admit(self, rows: int, may_pause: bool = True) -> list[GenerationRequest]:
        """Give the `rows` to clients (see the module's docstring): waiting requests start
        prefilling, paused ones decode again, and with `may_pause` a client below its share takes
        a decode row from the client holding the most. Returns the requests stopped while they
        waited or were paused (out of the table; a paused one's states are as it left them)."""
        with self.lock:
            stopped = [request for request in (*self.waiting, *self.paused) if request.stop.is_set()]
            for request in stopped:
                (self.paused if request in self.paused else self.waiting).remove(request)
            while self.waiting or self.paused:
                held = Counter(request.flow for request in (*self.prefilling, *self.decoding))
                order = {id(request): place for place, request in enumerate(
                    sorted((*self.waiting, *self.paused), key=lambda request: request.submitted_at))}
                chosen = min((*self.waiting, *self.paused), key=lambda request: (held[request.flow], order[id(request)]))
                if len(self.prefilling) + len(self.decoding) >= rows and not (
                        may_pause and self._pause_for(chosen, held, rows)):
                    break
                if chosen in self.paused:
                    self.paused.remove(chosen)
                    self.decoding.append(chosen)
                else:
                    self.waiting.remove(chosen)
                    self.prefilling.append(chosen)
        return stopped

    def _pause_for(self, chosen: GenerationRequest, held: Counter, rows: int) -> bool:
        """With every row taken: pause the newest decode row of the client holding the most, if
        `chosen`'s client is below its share and that one above it. Whether a row was freed."""
        clients = {request.flow for request in (*self.waiting, *self.paused, *self.prefilling, *self.decoding)}
        share = max(1, rows // len(clients))
        if held[chosen.flow] >= share:
            return False
        richest = max(held, key=lambda flow: held[flow], default=None)
        if richest is None or held[richest] <= share:
            return False
        theirs = [request for request in self.decoding if request.flow == richest]
        if not theirs:
            return False
        victim = max(theirs, key=lambda request: request.submitted_at)
        self.decoding.remove(victim)
        self.paused.append(victim)
        return True

    def append(self, request: GenerationRequest, queue: list[GenerationRequest], newest_only: bool = False) -> None:
        """`request` into `queue` (waiting replies, or texts prepared ahead). `newest_only`: the
        session's requests already in `queue` are called off in the same hold of the lock (one
        text prepared a conversation, whoever asks and however fast)."""
        with self.lock:
            for older in queue if newest_only else ():
                if older.session is request.session:
                    older.stop.set()
            queue.append(request)

    def start_decoding(self, request: GenerationRequest) -> None:
        with self.lock:
            self.prefilling.remove(request)
            self.decoding.append(request)

    def remove(self, requests: list[GenerationRequest]) -> None:
        """Out of the table, from whichever list holds them."""
        with self.lock:
            for request in requests:
                (self.decoding if request in self.decoding else self.prefilling).remove(request)

    def take_everyone(self) -> list[GenerationRequest]:
        """Every request, out of the table (a fault of the scheduler itself ends them all)."""
        with self.lock:
            everyone = [*self.waiting, *self.prefilling, *self.decoding, *self.paused, *self.ahead]
            self.waiting.clear()
            self.prefilling, self.decoding, self.paused, self.ahead = [], [], [], []
        return everyone
