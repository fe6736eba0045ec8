"""A conversation: the canonical history (a tree of branches) and the one cache session that serves it.

Every operation is planned first (validated, prompt rendered, context checked: chat/plans.py)
and only then run (chat/turns.py), so bad input raises before anything changes. Running means:
roll the cache back to where the new prompt diverges, prefill the rest, stream the reply,
record it in the history (chat/history.py).
"""

from __future__ import annotations

import threading
from typing import Any, Iterator

from cache_sessions.session import CacheSession, common_prefix_length
from chat import saved
from chat.errors import ConversationBusyError, ConversationError, StalePlanError
from chat.history import History, Message, Node, ReplyVersion, system_text
from chat.operations import Continue, Edit, Operation, Regenerate, Send, checked_text
from chat.options import GenerationOptions
from chat.plans import Plan, plan_operation, reply_tokens
from chat.reasoning import Delta
from chat.runtime import Runtime
from chat.turns import ReplyStream, Turn, TurnStats


class Conversation:
    def __init__(self, runtime: Runtime, system_prompt: str | None = None, history: History | None = None,
                 session: CacheSession | None = None):
        """`session`: what holds the cache (by default a new `CacheSession` on the runtime's model)."""
        self._runtime = runtime
        self.session = session or CacheSession(runtime.model, max_checkpoints=runtime.config.max_checkpoints)
        self.history = history or History(system_prompt)
        self.stats: TurnStats | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._revision = 0
        # The messages (node ids) whose tokens the cache ledger holds, and those of each kept
        # segment: the cache may lag the shown path (switches and undo are lazy).
        self._cached_path: list[int] = []
        self._segment_paths: dict[int, list[int]] = {}

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
        """The shown path."""
        return self.history.messages

    @property
    def reply_ids(self) -> list[int]:
        path = self.history.entries
        return reply_tokens(self._runtime, path)[1] if path and path[-1].role == "assistant" else []

    def branches(self, index: int) -> tuple[int, int]:
        """(shown, count) of the siblings at message `index` of `messages`; (0, 1) if it has none."""
        return self.history.branches(index)

    @property
    def versions(self) -> tuple[int, int]:
        """(shown, count) of the last reply's siblings; (0, 0) when the last message is no reply."""
        path = self.history.entries
        return self.history.branches(len(path) - 1) if path and path[-1].role == "assistant" else (0, 0)

    @property
    def system_prompt(self) -> str | None:
        return self.history.system_prompt

    @property
    def is_generating(self) -> bool:
        return self._lock.locked()

    def to_dict(self) -> dict[str, Any]:
        """The whole tree and the shown path, JSON-safe (`engine.restore` takes it back)."""
        return saved.to_dict(self.history)

    # ---- operations ------------------------------------------------------------------------
    def send(self, text: str, *, fit_context: bool = False, **options: Any) -> ReplyStream:
        """Add a user message and stream the reply (see `operations.Send` for `fit_context`)."""
        return self.start(Send(text, fit_context), GenerationOptions.from_kwargs(**options))

    def regenerate(self, index: int | None = None, **options: Any) -> ReplyStream:
        """A new sibling of the reply at `index` (default: the last); the others stay switchable."""
        return self.start(Regenerate(index), GenerationOptions.from_kwargs(**options))

    def edit(self, index: int, text: str, **options: Any) -> ReplyStream:
        """A new branch at the user message `index`, answered; the old one is kept."""
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

    def edit_reply(self, index: int, text: str) -> None:
        """A new sibling of the reply at `index` with this text (nothing generated); the next turn
        or Continue goes on from it."""
        text = checked_text(text)
        with self.exclusive():
            path = self.history.entries
            replaced = self.history.message_at(index, "assistant")
            version = ReplyVersion(text, "", None, None, replaced.reply.opens_reasoning, False, edited=True)
            written = self.history.node("assistant", reply=version)
            self._leave(path, path[:index] + [written], index)
            self.history.add_reply(index, written)
            self._revision += 1

    def switch_branch(self, index: int, branch: int) -> bool:
        """Show sibling `branch` at message `index` and the path below it. True when its cache
        states were put back (or are held already) without a forward pass; otherwise the next
        turn prefills from the fork."""
        with self.exclusive():
            path = self.history.entries
            arriving = self.history.sibling(index, branch)
            if arriving is path[index]:
                return self._holds(path[: index + 1])
            target = path[:index] + [arriving]
            while target[-1].shown_child is not None:
                target.append(target[-1].shown_child)
            restored = self._leave(path, target, index)
            self.history.parent_at(index).show(arriving)
            self._revision += 1
            return restored

    def select_version(self, index: int) -> bool:
        """Show version `index` of the last reply (its branch): `switch_branch` on the last reply."""
        if self.versions == (0, 0):
            raise ConversationError(f"there is no reply version {index!r}")
        return self.switch_branch(len(self.history.entries) - 1, index)

    def set_system_prompt(self, text: str | None) -> bool:
        """Start a new branch at the root with this system prompt; the conversation so far stays
        one switch away (`switch_branch(0, ...)` once the new branch has a message). False when
        it is the prompt shown already."""
        text = system_text(text)
        with self.exclusive():
            if text == self.history.system_prompt:
                return False
            self._leave(self.history.entries, [self.history.node("system", text)] if text else [], 0)
            self.history.set_system_prompt(text)
            self._revision += 1
            return True

    def undo(self) -> None:
        """Step back before the last user message; the undone turn stays as a branch there.
        The cache is rolled back lazily, next turn."""
        with self.exclusive():
            path = self.history.entries
            index = self.history.undo()
            self._leave(path, path[:index], index)
            self._revision += 1

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
            self.history.record_continuation(plan.history, version)
        else:
            self.history.record_reply(plan.history, version)
        self._cached_path = [node.uid for node in self.history.entries]
        self.stats = stats
        self._revision += 1

    # ---- keeping each branch's cache states ----------------------------------------------------
    def _leave(self, shown: list[Node], target: list[Node], index: int) -> bool:
        """The shown path is about to become `target`, which differs from message `index` on:
        keep the cache states of the shown branch there and put back those of the target's,
        where kept. No forward pass, so it works wherever the cache lies (between ZeroGPU calls
        too). True when the cache then holds the target's branch."""
        target_ids = self._runtime.template.render_history([node.message() for node in target]) if target else []
        return self._runtime.worker.run(self._move_cache, shown, target, index, target_ids)

    def _move_cache(self, shown: list[Node], target: list[Node], index: int, target_ids: list[int]) -> bool:
        arriving = target[index] if index < len(target) else None
        start = common_prefix_length(self.session.token_ids, target_ids)
        if arriving is not None and (kept := self.session.segment_start(arriving.uid)) is not None:
            start = min(start, kept)  # restoring rolls back there: what is kept now must survive it
        self._stash(shown, index, self.session.reachable(start))
        if arriving is None:
            return True
        if self.session.restore_segment(arriving.uid):
            self._cached_path = [node.uid for node in target[:index]] + self._segment_paths.pop(arriving.uid)
            return True
        self._segment_paths.pop(arriving.uid, None)
        return self._holds(target[: index + 1])

    def _stash(self, shown: list[Node], index: int, start: int) -> None:
        """Keep the cache's states from token `start` on under the shown message `index`, if the
        cache holds that branch."""
        if index < len(shown) and self._holds(shown[: index + 1]):
            if self.session.stash_segment(shown[index].uid, start):
                self._segment_paths[shown[index].uid] = self._cached_path[index:]

    def _holds(self, path: list[Node]) -> bool:
        return self._cached_path[: len(path)] == [node.uid for node in path] and bool(self.session.token_ids)

    # ---- on the compute thread -----------------------------------------------------------------
    def _before_turn(self, plan: Plan) -> None:
        if self._runtime.config.offload_sessions:
            self.session.to(self._runtime.model.device)
        if plan.fork is not None:  # keep the branch being replaced, to switch back to it
            self._stash(self.history.entries, plan.fork,
                        self.session.reachable(self.session.rollback_target(plan.prompt_ids)))

    def _after_turn(self) -> None:
        if self._runtime.config.offload_sessions:
            self.session.to("cpu")

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
