"""The scheduler's one record of its requests (chat/scheduling/scheduler.py): what waits, what prefills, what
decodes, what was paused to give another client its share of the rows, and which replies are
being made in another process (a ZeroGPU worker).

Rows go to clients, not to requests in arrival order: one address may hold as
many conversations as there are rows, and took every row. A free row goes to the waiting (or
paused) request whose client holds the fewest rows; with none free, a client below its share
(the rows over the clients with requests) takes a decode row from the client holding the most,
which is paused: its states stay in its session, its reader simply waits, and it goes on, exact,
once a row is free for it again. A request with no client is a client of its own, so without
clients this is arrival order.

It is the only meaning of "in use": the cache owner never frees, spills or releases a session
this table holds (cache_sessions/owner.py reads `in_use`). Any thread reads it under its lock; the
loop moves requests between the lists, and `submit` adds to the waiting ones.
"""

from __future__ import annotations

import threading
from collections import Counter, deque
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Collection, Iterator, Sequence

from cache_sessions.session import CacheSession
from chat.scheduling.requests import GenerationRequest


@dataclass(frozen=True)
class Admission:
    """Who moves between the table's lists this step (`RequestTable.admission`), and the lists
    that leaves."""

    stopped: tuple[GenerationRequest, ...]  # stopped while waiting or paused: out of the table
    moves: tuple[tuple[str, GenerationRequest], ...]  # in order: "admit" (waiting → prefilling),
    # "resume" (paused → decoding), "pause" (decoding → paused: a row for another client's share)
    prefilling: tuple[GenerationRequest, ...]
    decoding: tuple[GenerationRequest, ...]


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

    def admission(self, rows: int, may_pause: bool = True) -> Admission:
        """Who the `rows` go to this step (see the module's docstring), decided on copies of the
        lists: the table changes only when `admit` applies it. Waiting requests start prefilling,
        paused ones decode again, and with `may_pause` a client below its share takes a decode
        row from the client holding the most. A waiting request whose session another request
        of the table still holds (a reply or a text prepared ahead, stopped this step: it leaves first)
        waits for it to leave."""
        with self.lock:
            stopped = tuple(request for request in (*self.waiting, *self.paused) if request.stop.is_set())
            waiting = [request for request in self.waiting if request not in stopped]
            paused = [request for request in self.paused if request not in stopped]
            prefilling, decoding = list(self.prefilling), list(self.decoding)
            held = {request.session for request in (*stopped, *self.prefilling, *self.decoding, *self.paused,
                                                    *self.ahead)}
            moves: list[tuple[str, GenerationRequest]] = []
            while True:
                free = [request for request in waiting if request.session not in held]
                if not free and not paused:
                    break
                counts = Counter(request.flow for request in (*prefilling, *decoding))
                chosen = min((*free, *paused), key=lambda request: (counts[request.flow], request.submitted_at))
                if len(prefilling) + len(decoding) >= rows:
                    victim = _victim(chosen, counts, rows, (*waiting, *paused, *prefilling, *decoding), decoding)
                    if not may_pause or victim is None:
                        break
                    decoding.remove(victim)
                    paused.append(victim)
                    moves.append(("pause", victim))
                if chosen in paused:
                    paused.remove(chosen)
                    decoding.append(chosen)
                    moves.append(("resume", chosen))
                else:
                    waiting.remove(chosen)
                    prefilling.append(chosen)
                    held.add(chosen.session)
                    moves.append(("admit", chosen))
        return Admission(stopped, tuple(moves), tuple(prefilling), tuple(decoding))

    def admit(self, admission: Admission) -> None:
        """Apply `admission`: the stopped out, then its moves in order."""
        with self.lock:
            for request in admission.stopped:
                (self.paused if request in self.paused else self.waiting).remove(request)
            for move, request in admission.moves:
                source, target = {"admit": (self.waiting, self.prefilling), "resume": (self.paused, self.decoding),
                                  "pause": (self.decoding, self.paused)}[move]
                source.remove(request)
                target.append(request)

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

    def remove(self, requests: Sequence[GenerationRequest]) -> None:
        """Out of the table, from whichever list holds them."""
        with self.lock:
            for request in requests:
                for queue in (self.decoding, self.prefilling, self.ahead, self.paused, self.waiting):
                    if request in queue:
                        queue.remove(request)
                        break

    def take_everyone(self) -> list[GenerationRequest]:
        """Every request, out of the table (a fault of the scheduler itself ends them all)."""
        with self.lock:
            everyone = [*self.waiting, *self.prefilling, *self.decoding, *self.paused, *self.ahead]
            self.waiting.clear()
            self.prefilling, self.decoding, self.paused, self.ahead = [], [], [], []
        return everyone


def _victim(chosen: GenerationRequest, held: Counter, rows: int, everyone: Sequence[GenerationRequest],
            decoding: Sequence[GenerationRequest]) -> GenerationRequest | None:
    """With every row taken: the newest decode row of the client holding the most, where
    `chosen`'s client is below its share of the `rows` and that one above it (None: none)."""
    share = max(1, rows // len({request.flow for request in everyone}))
    if held[chosen.flow] >= share:
        return None
    richest = max(held, key=lambda flow: held[flow], default=None)
    if richest is None or held[richest] <= share:
        return None
    theirs = [request for request in decoding if request.flow == richest]
    return max(theirs, key=lambda request: request.submitted_at) if theirs else None
