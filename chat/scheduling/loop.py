"""The engine's one update loop, on its compute thread (llama.cpp's server has one such loop).

Other threads never run model or cache work themselves: they `post` a command (or `call` one
and wait), and the loop runs the commands first, then one step of the scheduler's work, then
what settles after it, and comes round again while there is anything left to do. Nothing but
this thread changes a cache, so no two changes can meet.
"""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future
from typing import Any, Callable, TypeVar

from chat.scheduling.worker import ModelWorker

T = TypeVar("T")


class Loop:
    def __init__(self, worker: ModelWorker, step: Callable[[], None], has_work: Callable[[], bool],
                 settle: Callable[[], None]):
        """`step`: one round of the scheduler; `has_work`: whether another is due; `settle`: what
        runs after every round, a failed one too (the cache owner's bookkeeping)."""
        self.worker = worker
        self._step, self._has_work, self._settle = step, has_work, settle
        self.reset()

    def reset(self) -> None:
        """No commands and no round pending (a forked ZeroGPU worker starts so)."""
        self._lock = threading.Lock()
        self._commands: deque[tuple[Future, Callable[[], Any]]] = deque()
        self._scheduled = False

    def post(self, function: Callable[[], Any]) -> "Future[Any]":
        """Run `function` on the loop before its next step (its result or error in the future)."""
        future: Future = Future()
        with self._lock:
            self._commands.append((future, function))
        self.wake()
        return future

    def call(self, function: Callable[..., T], *args: Any) -> T:
        """Run `function(*args)` on the loop and wait for it (at once if already there)."""
        if self.on_loop():
            return function(*args)
        return self.post(lambda: function(*args)).result()

    def on_loop(self) -> bool:
        return self.worker.on_compute_thread()

    def wake(self) -> None:
        """Make sure a round is coming (call after adding work the loop will see)."""
        with self._lock:
            if not self._scheduled:
                self._scheduled = True
                self.worker.submit(self._round)

    def _round(self) -> None:
        try:
            self._run_commands()
            self._step()
        finally:
            try:
                self._settle()
            finally:
                with self._lock:
                    self._scheduled = False
                    again = bool(self._commands) or self._has_work()
                if again:
                    self.wake()

    def _run_commands(self) -> None:
        while True:
            with self._lock:
                if not self._commands:
                    return
                future, function = self._commands.popleft()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(function())
            except BaseException as error:  # handed to whoever waits on it
                future.set_exception(error)
