"""Running a conversation operation in another process: what Hugging Face ZeroGPU does.

On ZeroGPU, a `spaces.GPU` function runs in a forked worker process: its arguments are pickled
there and what it yields is pickled back, so nothing it changes in place reaches the server. The
conversation therefore travels as data with the plan made on the server: it goes to the worker
(its cache on the CPU), is attached to the worker's copy of the engine, runs the plan with the
cache on the GPU, and comes back with its cache on the CPU again (GPU memory does not survive
between calls). A stop request crosses as a file, since the worker cannot see the server's memory.
"""

from __future__ import annotations

import os
import tempfile
import threading
from typing import Any, Callable, Iterator

from chat.conversation import Conversation
from chat.engine import ChatEngine
from chat.operations import Operation
from chat.options import GenerationOptions
from chat.plans import Plan
from chat.reasoning import Delta

ENGINE: ChatEngine | None = None  # set at start-up; forked workers inherit it
Runner = Callable[[Conversation, Plan, str], Iterator[tuple[str, Any]]]


def run_plan(conversation: Conversation, plan: Plan, stop_file: str) -> Iterator[tuple[str, Any]]:
    """In the worker: ("delta", Delta) while streaming, then ("conversation", the updated one)."""
    assert ENGINE is not None, "chat.remote.ENGINE is not set"
    conversation.attach(ENGINE.runtime)
    finished = threading.Event()

    def watch_stop() -> None:
        while not finished.wait(0.05):
            if os.path.exists(stop_file):
                conversation.stop()

    threading.Thread(target=watch_stop, daemon=True).start()
    try:
        for delta in conversation.run(plan):
            yield "delta", delta
    finally:
        finished.set()
    yield "conversation", conversation


class RemoteOperation:
    """The server's side: plans here (bad input fails at once, nothing runs twice), runs the plan
    in the worker, takes the updated conversation back. Iterate it like a reply stream;
    `stop()` reaches the worker."""

    def __init__(self, conversation: Conversation, runner: Runner, operation: Operation,
                 options: GenerationOptions | None = None):
        self.plan = conversation.plan(operation, options or GenerationOptions())
        self.dropped_turns = self.plan.dropped_turns
        self.conversation = conversation
        self._runner = runner
        handle, self._stop_file = tempfile.mkstemp(prefix="rewind-chat-stop-")
        os.close(handle)
        os.unlink(self._stop_file)

    def stop(self) -> None:
        open(self._stop_file, "w").close()

    def __iter__(self) -> Iterator[Delta]:
        try:
            with self.conversation.exclusive():
                for kind, value in self._runner(self.conversation, self.plan, self._stop_file):
                    if kind == "delta":
                        yield value
                    else:
                        self.conversation.take_state_of(value)
        finally:
            if os.path.exists(self._stop_file):
                os.unlink(self._stop_file)
