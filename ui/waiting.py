"""A bound on what clients may have waiting in the server: large request bodies, per client and in
all.

Gradio parses an event's body when it is queued (`/queue/join`) and keeps it until the event has
run; events that carry the browser's record run one at a time. Sixteen page loads at once, each
with a 25 MB forged record, so held sixteen parsed bodies (the attack saw the server grow from
454 MB to 3.2 GB, 1.4-1.6 GB still held after, and everyone's page loads wait ~80 s), and nothing
bounded what one client could have waiting.

`WaitingBodies` is a plain ASGI middleware that counts the declared size of every large body
(`LARGE_BYTES` or more; one sent without a length counts as the largest allowed) from the moment
its request arrives until what it carries is done with: the response, for a request answered at
once; the event's end (or its cancellation), for one queued. A request that would take its
client past `per_client_bytes`, or everyone past `total_bytes`, is refused before its body is
read: 429 for its client, 503 when the server as a whole holds enough, with a message that says
so. Small bodies (a message, a click) count no bytes, so a client sending large ones slows no one
else; each queued event, whatever its size, counts one of its client's `per_client_events`, so
one client cannot fill Gradio's queue (256 events for everyone) either. Once a large body is done with, the C heap is given back to the system (`malloc_trim`):
freed parsed bodies otherwise stay in the process as fragmented arenas.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from ui.shared import client_key

LARGE_BYTES = 1 << 20  # smaller bodies are not counted: every ordinary event is one
ABANDONED_S = 3600.0  # a queued event never seen to end is let go after this

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]


def _malloc_trim() -> Callable[[], None]:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to give back this way
        return lambda: None
    return lambda: trim(0) and None


@dataclass
class _Held:
    client: str
    nbytes: int
    event: bool  # a queued event (counted against the client's waiting events, whatever its size)
    since: float = field(default_factory=time.monotonic)


class WaitingBook:
    """What each client has waiting, shared by the middleware and the queue's end-of-event hook.
    `alive(event_id)`: whether Gradio's queue still holds that event (set once the app launched)."""

    def __init__(self, per_client_bytes: int, total_bytes: int, per_client_events: int = 64):
        self.per_client_bytes, self.total_bytes = per_client_bytes, total_bytes
        self.per_client_events = per_client_events
        self.alive: Callable[[str], bool] = lambda event_id: True
        self._lock = threading.Lock()
        self._held: dict[object, _Held] = {}  # keyed by a token, then by the queued event's id
        self._trim = _malloc_trim()
        self.refused = 0
        self._watching = False  # a thread lets go of ended events while anything is queued

    def take(self, client: str, nbytes: int, event: bool = False) -> tuple[object | None, str]:
        """Hold `nbytes` for `client` (and, for a queued `event`, one of its waiting events): (a
        token to let go of, "") or (None, why it was refused)."""
        self.settle()
        with self._lock:
            theirs = [held for held in self._held.values() if held.client == client]
            mine = sum(held.nbytes for held in theirs)
            everyone = sum(held.nbytes for held in self._held.values())
            if event and sum(held.event for held in theirs) >= self.per_client_events:
                self.refused += 1
                return None, (f"you already have {self.per_client_events} requests waiting here; wait until "
                              "they are answered")
            if mine + nbytes > self.per_client_bytes:
                self.refused += 1
                return None, (f"you already have {mine / 2**20:.0f} MB of requests waiting here; wait until "
                              "they are answered")
            if everyone + nbytes > self.total_bytes:
                self.refused += 1
                return None, "the server is busy with other large requests; try again in a moment"
            token = object()
            self._held[token] = _Held(client, nbytes, event)
            return token, ""

    def queued(self, token: object, event_id: str) -> None:
        """The body went into Gradio's queue as event `event_id`: held until that event ends."""
        with self._lock:
            held = self._held.pop(token, None)
            if held is not None:
                self._held[event_id] = held
            start = held is not None and not self._watching
            self._watching = self._watching or start
        if start:  # events end inside Gradio's queue: looked for here, twice a second, while any is held
            threading.Thread(target=self._watch, name="waiting-bodies", daemon=True).start()

    def _watch(self) -> None:
        while True:
            time.sleep(0.5)
            self.settle()
            with self._lock:
                if not any(isinstance(key, str) for key in self._held):
                    self._watching = False
                    return

    def let_go(self, token: object) -> None:
        with self._lock:
            held = self._held.pop(token, None)
        if held is not None:
            self._trim()

    def settle(self) -> None:
        """Let go of every queued event that ended (or was abandoned), giving the heap back."""
        now = time.monotonic()
        with self._lock:
            ended = [key for key, held in self._held.items() if isinstance(key, str)
                     and (not self.alive(key) or now - held.since > ABANDONED_S)]
            for key in ended:
                del self._held[key]
        if ended:
            self._trim()

    def held_bytes(self) -> int:
        with self._lock:
            return sum(held.nbytes for held in self._held.values())


class WaitingBodies:
    """Plain ASGI middleware: large bodies counted against `book` (see the module's docstring)."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], book: WaitingBook,
                 largest_bytes: int):
        self.app, self.book, self.largest_bytes = app, book, largest_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        nbytes = self._counted_bytes(scope)
        if nbytes is None:
            await self.app(scope, receive, send)
            return
        client = client_key(scope["client"][0]) if scope.get("client") else "unknown"
        queued = scope["path"].endswith("/queue/join")
        token, why = self.book.take(client, nbytes, event=queued)
        if token is None:
            status = 503 if why.startswith("the server is busy") else 429
            body = json.dumps({"detail": why}).encode()
            await send({"type": "http.response.start", "status": status,
                        "headers": [(b"content-type", b"application/json"), (b"retry-after", b"5"),
                                    (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
            return
        answer = bytearray()

        async def watching(message: dict) -> None:
            if queued and message["type"] == "http.response.body":
                answer.extend(message.get("body", b"")[:4096])
            await send(message)

        try:
            await self.app(scope, receive, watching)
        finally:
            event_id = _event_id(bytes(answer)) if queued else None
            if event_id is not None:
                self.book.queued(token, event_id)
            else:
                self.book.let_go(token)

    def _counted_bytes(self, scope: Scope) -> int | None:
        """The body size to count for this request (0: a queued event with a small body, counted
        as one of its client's waiting events); None: not counted (an upload, which Gradio spools
        to disk as it arrives; a small request answered at once; one over the largest allowed,
        which Gradio refuses, 413, before reading it)."""
        if scope["type"] != "http" or scope.get("method") != "POST" or scope["path"].endswith("/upload"):
            return None
        headers = dict(scope.get("headers", []))
        try:
            declared = int(headers[b"content-length"])
        except (KeyError, ValueError):
            declared = self.largest_bytes if b"transfer-encoding" in headers else 0
        if declared > self.largest_bytes:
            return None
        large = declared if declared >= LARGE_BYTES else 0
        return large if large or scope["path"].endswith("/queue/join") else None


def _event_id(answer: bytes) -> str | None:
    try:
        event_id = json.loads(answer).get("event_id")
    except (ValueError, AttributeError):
        return None
    return event_id if isinstance(event_id, str) else None
