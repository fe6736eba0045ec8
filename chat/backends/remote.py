"""Replies made in another process: what Hugging Face ZeroGPU does.

On ZeroGPU, a `spaces.GPU` function runs in a forked worker process: its arguments are pickled
there and what it yields is pickled back, so nothing it changes in place reaches the server. So
only plain data crosses: the conversation's cache session (on the CPU between calls) and the
`ReplyRequest` go to the worker, which makes the reply on its copy of the engine with the states
on the GPU; the deltas come back as they stream, then the reply and the session (on the CPU
again), which the server's cache owner adopts. The history never leaves the server (its message
ids come from one place), and branch moves run there, on the CPU (no forward pass). A stop
crosses as a file, since the worker cannot see the server's memory.
"""

from __future__ import annotations

import os
import tempfile
import threading
from typing import Any, Callable, Iterator, Protocol

from cache_sessions.branches import BranchMove
from cache_sessions.kv_cache import CacheShape
from cache_sessions.session import CacheSession
from chat.backends.local import LocalSource
from chat.dialogue.reasoning import Delta
from chat.runtime import Runtime
from chat.backends.sources import Reply, ReplyRequest


class Engine(Protocol):
    """What a worker reads of the engine (a `ChatEngine`; named here by what it offers, so this
    module and chat/engine.py, which makes `RemoteSource`s, do not import each other)."""

    model: Any
    runtime: Runtime


ENGINE: Engine | None = None  # set at start-up; forked workers inherit it
Runner = Callable[[CacheSession, ReplyRequest, str], Iterator[tuple[str, Any]]]
STOP_POLL_S = 0.05


def run_in_worker(session: CacheSession, request: ReplyRequest, stop_file: str) -> Iterator[tuple[str, Any]]:
    """In the worker: ("delta", Delta) while streaming, then ("reply", (Reply | None, the session))."""
    assert ENGINE is not None, "chat.backends.remote.ENGINE is not set"
    session.shape = CacheShape(ENGINE.model.config, ENGINE.model.dtype)  # pickled without it
    stop, finished = threading.Event(), threading.Event()

    def watch_stop() -> None:
        while not finished.wait(STOP_POLL_S):
            if os.path.exists(stop_file):
                stop.set()

    threading.Thread(target=watch_stop, daemon=True).start()
    run = LocalSource(ENGINE.runtime, session).reply(request, stop)
    # In use until the caller has pickled it back: once the reply ends, the worker's own budget
    # would otherwise free it on the loop while this thread pickles it (a ledger and a cache that
    # disagree reached the server).
    try:
        with ENGINE.runtime.scheduler.made_elsewhere(session):
            for delta in run:
                yield "delta", delta
            yield "reply", (run.result(), session)
    finally:
        finished.set()


class RemoteSource:
    """A `ReplySource` whose replies run through a runner (ZeroGPU's `spaces.GPU`); everything
    else is the server's own local source, its states resting on the CPU."""

    def __init__(self, local: LocalSource, runner: Runner):
        self.local, self.runner = local, runner
        self.session = local.session

    def check(self, request: ReplyRequest) -> None:
        self.local.check(request)

    def reply(self, request: ReplyRequest, stop: threading.Event) -> "RemoteReply":
        return RemoteReply(self.local, self.runner, request, stop)

    def move(self, move: BranchMove) -> bool:
        return self.local.move(move)

    def close(self) -> None:
        self.local.close()


class RemoteReply:
    def __init__(self, local: LocalSource, runner: Runner, request: ReplyRequest, stop: threading.Event):
        self.local, self.runner, self.request, self.stop = local, runner, request, stop
        self._reply: Reply | None = None

    def __iter__(self) -> Iterator[Delta]:
        handle, stop_file = tempfile.mkstemp(prefix="rewind-chat-stop-")
        os.close(handle)
        os.unlink(stop_file)
        finished = threading.Event()
        threading.Thread(target=self._pass_stop_on, args=(stop_file, finished), daemon=True).start()
        with self.local.runtime.scheduler.made_elsewhere(self.local.session):
            yield from self._stream(stop_file, finished)

    def _stream(self, stop_file: str, finished: threading.Event) -> Iterator[Delta]:
        items = self.runner(self.local.session, self.request, stop_file)
        try:
            for kind, value in items:
                if kind == "delta":
                    yield value
                else:
                    self._adopt(*value)
        except GeneratorExit:  # the reader went away: as Stop, and the reply so far comes back
            open(stop_file, "w").close()
            for kind, value in items:
                if kind == "reply":
                    self._adopt(*value)
            raise
        finally:
            finished.set()
            if os.path.exists(stop_file):
                os.unlink(stop_file)

    def result(self) -> Reply | None:
        return self._reply

    def _adopt(self, reply: Reply | None, session: CacheSession) -> None:
        runtime = self.local.runtime
        runtime.scheduler.call(runtime.caches.adopt_state, self.local.session, session)
        self._reply = reply

    def _pass_stop_on(self, stop_file: str, finished: threading.Event) -> None:
        """The server's Stop, written where the worker looks."""
        while not finished.is_set():
            if self.stop.wait(STOP_POLL_S):
                if not finished.is_set():
                    open(stop_file, "w").close()
                return
