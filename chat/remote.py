"""Running a conversation operation in another process: what Hugging Face ZeroGPU does.

On ZeroGPU, a `spaces.GPU` function runs in a forked worker process: its arguments are pickled
there and what it yields is pickled back, so nothing it changes in place reaches the server. The
conversation therefore travels as data: it goes to the worker (its cache on the CPU), is attached
to the worker's copy of the engine, runs one operation with the cache on the GPU, and comes back
with its cache on the CPU again (GPU memory does not survive between calls). A stop request
crosses as a file, since the worker cannot see the server's memory.
"""

from __future__ import annotations

import os
import tempfile
import threading
from typing import Any, Callable, Iterator

from chat.conversation import Conversation
from chat.engine import ChatEngine
from chat.reasoning import Delta

ENGINE: ChatEngine | None = None  # set at start-up; forked workers inherit it


def run_operation(conversation: Conversation, operation: str, args: tuple, kwargs: dict,
                  stop_file: str) -> Iterator[tuple[str, Any]]:
    """In the worker: ("delta", Delta) while streaming, then ("conversation", the updated one)."""
    assert ENGINE is not None, "chat.remote.ENGINE is not set"
    conversation.attach(ENGINE)
    finished = threading.Event()

    def watch_stop() -> None:
        while not finished.wait(0.05):
            if os.path.exists(stop_file):
                conversation.stop()

    threading.Thread(target=watch_stop, daemon=True).start()
    try:
        for delta in getattr(conversation, operation)(*args, **kwargs):
            yield "delta", delta
    finally:
        finished.set()
    yield "conversation", conversation


class RemoteOperation:
    """The server's side: plans locally (bad input fails at once), runs in the worker, takes the
    updated conversation back. Iterate it like a reply stream; `stop()` reaches the worker."""

    def __init__(self, conversation: Conversation, engine: ChatEngine, runner: Callable[..., Iterator],
                 operation: str, *args: Any, **kwargs: Any):
        planned = getattr(conversation, operation)(*args, **kwargs)  # validates; never started
        self.dropped_turns = getattr(planned, "dropped_turns", 0)
        planned.close()
        self.conversation = conversation
        self._engine = engine
        self._runner = runner
        self._call = (operation, args, kwargs)
        handle, self._stop_file = tempfile.mkstemp(prefix="rewind-chat-stop-")
        os.close(handle)
        os.unlink(self._stop_file)

    def stop(self) -> None:
        open(self._stop_file, "w").close()

    def __iter__(self) -> Iterator[Delta]:
        operation, args, kwargs = self._call
        try:
            with self.conversation.exclusive():
                for kind, value in self._runner(self.conversation, operation, args, kwargs, self._stop_file):
                    if kind == "delta":
                        yield value
                    else:
                        self.conversation.take_state_of(value, self._engine)
        finally:
            if os.path.exists(self._stop_file):
                os.unlink(self._stop_file)
