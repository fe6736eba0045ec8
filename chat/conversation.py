"""A conversation: the canonical history and the one cache session that serves it.

Every operation is planned first (validated, prompt rendered, context checked: chat/plans.py)
and only then run (chat/turns.py), so bad input raises before anything changes. Running means:
roll the cache back to where the new prompt diverges, prefill the rest, stream the reply,
record it in the history (chat/history.py).
"""

from __future__ import annotations

import threading
from typing import Any, Iterator

from cache_sessions.session import CacheSession
from chat.errors import ConversationBusyError, StalePlanError
from chat.history import Entry, History, Message, ReplyVersion
from chat.operations import Continue, Edit, Operation, Regenerate, Send
from chat.options import GenerationOptions
from chat.plans import Plan, plan_operation
from chat.reasoning import Delta
from chat.runtime import Runtime
from chat.turns import ReplyStream, Turn, TurnStats


class Conversation:
    def __init__(self, runtime: Runtime, system_prompt: str | None = None):
        self._runtime = runtime
        self.session = CacheSession(runtime.model, max_checkpoints=runtime.config.max_checkpoints)
        self.history = History(system_prompt)
        self.stats: TurnStats | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._revision = 0

    # ---- moving between processes (ZeroGPU runs each call in a forked worker) ---------------
    def __getstate__(self) -> dict[str, Any]:
        """Everything but the runtime, locks and events: a conversation travels without its model."""
        state = self.__dict__.copy()
        for name in ("_runtime", "_lock", "_stop"):
            del state[name]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._runtime = None  # type: ignore[assignment]  # attach() gives it one
        self._lock = threading.Lock()
        self._stop = threading.Event()

    def attach(self, runtime: Runtime) -> None:
        """Serve this conversation with `runtime` (after it crossed a process boundary)."""
        self._runtime = runtime
        self.session.model = runtime.model

    def take_state_of(self, other: "Conversation") -> None:
        """Become `other` (the same conversation, updated in a worker process)."""
        self.__dict__.update(other.__getstate__())
        self.session.model = self._runtime.model

    # ---- read-only views -------------------------------------------------------------------
    @property
    def messages(self) -> list[Message]:
        return self.history.messages

    @property
    def reply_ids(self) -> list[int]:
        last = self.history.last_reply()
        return list(last.reply.reply_ids) if last else []

    @property
    def versions(self) -> tuple[int, int]:
        """(index of the shown version, number of versions) of the last reply; (0, 0) if none."""
        last = self.history.last_reply()
        return (last.active, len(last.versions)) if last else (0, 0)

    @property
    def system_prompt(self) -> str | None:
        return self.history.system_prompt

    @property
    def is_generating(self) -> bool:
        return self._lock.locked()

    # ---- operations ------------------------------------------------------------------------
    def send(self, text: str, *, fit_context: bool = False, **options: Any) -> ReplyStream:
        """Add a user message and stream the reply (see `operations.Send` for `fit_context`)."""
        return self.start(Send(text, fit_context), GenerationOptions.from_kwargs(**options))

    def regenerate(self, **options: Any) -> ReplyStream:
        """A new version of the last reply; the earlier versions stay selectable."""
        return self.start(Regenerate(), GenerationOptions.from_kwargs(**options))

    def edit(self, index: int, text: str, **options: Any) -> ReplyStream:
        """Replace the user message at `index`, drop everything after it, reply again."""
        return self.start(Edit(index, text), GenerationOptions.from_kwargs(**options))

    def continue_reply(self, **options: Any) -> ReplyStream:
        """Extend the last reply in the same turn: the cache goes on from where it stopped."""
        return self.start(Continue(), GenerationOptions.from_kwargs(**options))

    def start(self, operation: Operation, options: GenerationOptions | None = None) -> ReplyStream:
        """Plan `operation` now (raising before anything changes) and return its stream."""
        plan = self.plan(operation, options or GenerationOptions())
        return ReplyStream(self.run(plan), plan.dropped_turns)

    def plan(self, operation: Operation, options: GenerationOptions) -> Plan:
        if self.is_generating:
            raise ConversationBusyError("a reply is still being generated; stop it first")
        return plan_operation(operation, self.history, self._runtime, options, self._revision)

    def undo(self) -> None:
        """Drop the last user message and its reply. The cache is rolled back lazily, next turn."""
        with self.exclusive():
            self.history.undo()
            self._revision += 1

    def select_version(self, index: int) -> bool:
        """Show version `index` of the last reply. Returns True when its cache states were put
        back without running the model; otherwise the next turn prefills it."""
        last = self.history.version_entry(index)
        with self.exclusive():
            if index == last.active:
                return True
            return self._runtime.worker.run(self._switch_version, last, index)

    def stop(self) -> None:
        """End the running stream early; safe from any thread. The partial reply is kept."""
        self._stop.set()

    # ---- running -----------------------------------------------------------------------------
    def run(self, plan: Plan) -> Iterator[Delta]:
        """Stream the reply of a plan made by `plan()`; refused if the conversation changed since."""
        with self.exclusive():
            if plan.revision != self._revision:
                raise StalePlanError("the conversation changed after this operation was planned")
            turn = Turn(self._runtime, self.session, plan, self._stop, before=lambda: self._before_turn(plan))
            try:
                yield from turn.deltas()
            finally:
                try:
                    if turn.generation is not None:
                        self._record(plan, *turn.finish())
                finally:
                    self._runtime.worker.run(self._after_turn)

    def _record(self, plan: Plan, version: ReplyVersion, stats: TurnStats) -> None:
        if plan.kind == "continue":
            self.session.drop_segment(plan.history[-1].reply.uid)
            self.history.record_continuation(plan.history, version)
        else:
            self.session.keep_segments(self.history.record_reply(plan.history, version, plan.regenerates))
        self.stats = stats
        self._revision += 1

    # ---- on the compute thread -----------------------------------------------------------------
    def _before_turn(self, plan: Plan) -> None:
        if self._runtime.config.offload_sessions:
            self.session.to(self._runtime.model.device)
        if plan.regenerates:  # keep the reply being replaced, to switch back to it
            self._stash_reply(self.history.entries[-1].reply)

    def _after_turn(self) -> None:
        if self._runtime.config.offload_sessions:
            self.session.to("cpu")

    def _switch_version(self, last: Entry, index: int) -> bool:
        """Keep the shown reply's states, put back those of `index`. No forward pass: this works
        wherever the cache lies, on the CPU between ZeroGPU calls too."""
        self._stash_reply(last.reply)
        last.active = index
        self._revision += 1
        return self.session.restore_segment(last.reply.uid)

    def _stash_reply(self, reply: ReplyVersion) -> None:
        self.session.stash_segment(reply.uid, len(reply.prompt_ids) - 1, reply.prompt_ids + reply.reply_ids)

    def exclusive(self) -> "_Exclusive":
        """Hold the conversation for one operation (here or in a worker process)."""
        return _Exclusive(self._lock)


class _Exclusive:
    """Holds the conversation lock for one operation; a second concurrent one is refused, not queued."""

    def __init__(self, lock: threading.Lock):
        self._lock = lock

    def __enter__(self) -> None:
        if not self._lock.acquire(blocking=False):
            raise ConversationBusyError("a reply is still being generated; stop it first")

    def __exit__(self, *exc: object) -> None:
        self._lock.release()
