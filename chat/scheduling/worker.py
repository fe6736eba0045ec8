"""The model's compute threads: every forward pass and `generate` call of an engine runs here.

PyTorch's CPU thread pool (OpenMP) belongs to the thread that calls into it, and once two threads
have used it, the later one runs slower for good. Measured on 2 cores with a 34 M-parameter
model: greedy decode at 81 tokens/s on a thread that alone used torch, 46 tokens/s on the same
thread after the main thread had run one matmul (or one large tensor copy). So every torch
operation of an engine, loading included, runs on its compute thread(s), never on the thread of
the request that asked for it.

Why: GCC's OpenMP (libgomp, which torch and inductor's kernels use) keeps a pool of worker threads
for each thread that started a parallel region, for as long as that thread lives, and once more
threads are pooled than there are cores it spins only briefly between regions before sleeping, so
every region of the model thread then waits on a wake-up. A thread that ends frees its pool.
Measured again at Qwen3-0.6B's shape with int8 weights and the compiled step, 2 cores: 27-34 ms a
step with the model thread's pool alone, 45-59 ms with one other live thread that had run a
single parallel operation, 27 ms when that thread had ended (the engine's weights were converted
on the caller's thread until this was found: its decode ran at the slower speed for good).
"""

from __future__ import annotations

import atexit
import os
import queue
import threading
import time
import weakref
from concurrent.futures import Future
from typing import Any, Callable, TypeVar

T = TypeVar("T")
_CLOSE = object()


class ModelWorker:
    def __init__(self, threads: int = 1, name: str = "model"):
        if threads < 1:
            raise ValueError("a model worker needs at least one thread")
        self._count, self._name = threads, name
        self._start()
        # A forked child (a ZeroGPU worker) inherits this object but none of its threads.
        os.register_at_fork(after_in_child=self._start)
        atexit.register(_close_at_exit, weakref.ref(self))

    def _start(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._loop, name=f"{self._name}-{i}", daemon=True)
                         for i in range(self._count)]
        for thread in self._threads:
            thread.start()

    def close(self, timeout: float = 30.0) -> None:
        """End the threads once the job in hand is done (jobs queued behind are dropped). Run at
        exit: a compute thread still inside torch while the interpreter tears down aborted the
        process ("terminate called without an active exception", exit status 134)."""
        for _ in self._threads:
            self._jobs.put(_CLOSE)
        deadline = time.monotonic() + timeout  # one bound for all threads
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not _CLOSE:
            future, function, args, kwargs = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(function(*args, **kwargs))
            except BaseException as error:  # handed to whoever waits on the future
                future.set_exception(error)

    def submit(self, function: Callable[..., T], *args: Any, **kwargs: Any) -> "Future[T]":
        future: Future = Future()
        self._jobs.put((future, function, args, kwargs))
        return future

    def on_compute_thread(self) -> bool:
        return threading.current_thread() in self._threads

    def run(self, function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run on a compute thread and wait; directly if already on one."""
        if self.on_compute_thread():
            return function(*args, **kwargs)
        return self.submit(function, *args, **kwargs).result()


def _close_at_exit(worker: "weakref.ref[ModelWorker]") -> None:
    if (alive := worker()) is not None:
        alive.close()
