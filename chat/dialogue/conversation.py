"""A conversation: the canonical history (a tree of branches) and the reply source that serves it.

Every operation is planned first (validated, prompt rendered, context fitted: chat/dialogue/plans.py) and
only then run, so bad input raises before anything changes. Running means: the source makes the
reply (chat/backends/sources.py: the embedded engine, a model server, a ZeroGPU worker) and the reply is
recorded in the history (chat/dialogue/history.py). A branch switch, an undo or a hand-edited reply tells
the source how the shown path changes, so it can keep and put back its states.

Three classes by role, each on the one before: `ConversationView` (the state and what any thread
may read), `PathChanges` (what is shown changes, nothing generated) and `Conversation` (replies).
"""

from __future__ import annotations

import threading
import weakref
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator

from cache_sessions.branches import BranchMove
from cache_sessions.session import CacheSession
from chat.dialogue import saved
from chat.errors import ChatError, ConversationBusyError, ConversationError, StalePlanError
from chat.dialogue.history import History, Message, Node, ReplyVersion, system_text
from chat.dialogue.operations import Continue, Edit, Operation, Regenerate, Send, checked_text
from chat.dialogue.options import GenerationOptions
from chat.dialogue.plans import Plan, Planner
from chat.dialogue.reasoning import Delta
from chat.backends.sources import ReplySource, ReplyStream, TurnStats

Cancelled = Callable[[], bool]  # True once whoever asked for the operation went away


class ConversationView:
    """A conversation's state and what can be read of it from any thread: its history (the tree
    and the shown path), the reply running now, whether it is busy. The operations are in the
    classes below: `PathChanges` (what is shown changes, nothing generated) and `Conversation`
    (a reply is made)."""

    def __init__(self, planner: Planner, source: ReplySource, history: History | None = None,
                 system_prompt: str | None = None):
        self.planner, self.source = planner, source
        self.history = history or History(system_prompt)
        self.stats: TurnStats | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._revision = 0
        self._running: RunningReply | None = None
        # a reply's recording and the end of its run are one step for `snapshot`, which takes it too
        self._recording = threading.Lock()
        self._prepared: threading.Event | None = None  # calls off the prompt being prepared (`prepare`)
        self._prepare_lock = threading.RLock()
        self._prepare_asks = 0  # the newest ask to prepare; an older one is never started

    # ---- read-only views -------------------------------------------------------------------
    @property
    def session(self) -> CacheSession | None:
        """The cache states kept here for this conversation (None: a model server keeps them)."""
        return self.source.session

    @property
    def messages(self) -> list[Message]:
        """The shown path."""
        return self.history.messages

    @property
    def reply_ids(self) -> list[int]:
        path = self.history.entries
        return self.planner.reply_tokens(path)[1] if path and path[-1].role == "assistant" else []

    def branches(self, index: int) -> tuple[int, int]:
        """(shown, count) of the siblings at message `index` of `messages`; (0, 1) if it has none."""
        return self.history.branches(index)

    @property
    def versions(self) -> tuple[int, int]:
        """(shown, count) of the last reply's siblings; (0, 0) when the last message is no reply."""
        return self.history.versions

    @property
    def system_prompt(self) -> str | None:
        return self.history.system_prompt

    @property
    def is_busy(self) -> bool:
        """An operation runs (a reply, a switch, an undo...) or a reply was started and has not
        ended: the one meaning of busy. (A started reply holds the lock only once its stream is
        read; before that, a second operation must be refused too.)"""
        return self._lock.locked() or self._running is not None

    @property
    def is_running(self) -> bool:
        """A reply was started and has not ended (`snapshot()` then includes it)."""
        return self._running is not None

    @property
    def revision(self) -> int:
        """Counts the changes to the history: equal revisions, equal `to_dict()`."""
        return self._revision

    def to_dict(self) -> dict[str, Any]:
        """The whole tree and the shown path, JSON-safe (`engine.restore` takes it back)."""
        return saved.to_dict(self.history)

    def snapshot(self) -> dict[str, Any]:
        """`to_dict()` as it will be if the running reply is stopped now: its message and the text
        written so far, recorded on a copy (the history itself changes only when the reply ends).
        The browser keeps this while a reply streams, so a reload mid-reply loses neither."""
        with self._recording:
            running = self._running
            if running is None:
                return self.to_dict()
            plan = running.plan
            return saved.to_dict_as_recorded(self.history, plan.history, plan.reply, running.stopped_now())

    def reply_so_far(self) -> dict[str, Any] | None:
        """The running reply's message as `snapshot()` has it now (its "content",
        "reasoning_content", "thought_s"), or None when no reply runs: what a page's draft of the
        reply is brought up to date with while it streams, without the whole conversation."""
        with self._recording:
            running = self._running
            if running is None:
                return None
            version = running.stopped_now()
        return saved.reply_fields(version)

    # ---- shared by the operations ----------------------------------------------------------
    def cancel_prepared(self) -> None:
        """Call off the prompt being prepared, if one is (what it fed stays)."""
        with self._prepare_lock:
            self._prepare_asks += 1  # an ask being planned now is not started
            if self._prepared is not None:
                self._prepared.set()
                self._prepared = None

    def exclusive(self) -> "_Exclusive":
        """Hold the conversation for one operation (its states are in use while the scheduler
        holds a request of it: chat/scheduling/scheduler.py keeps that record); refused while a reply runs."""
        return _Exclusive(self._lock, lambda: self._running is not None)


class PathChanges(ConversationView):
    """The operations that change what is shown and generate nothing: a branch switch, an undo,
    a hand-edited reply, a new system prompt; and Stop and close. Each tells the reply source how
    the shown path changes, so it can keep the branch left and put back the one arriving."""

    def edit_reply(self, index: int, text: str) -> None:
        """A new sibling of the reply at `index` with this text (nothing generated); the next turn
        or Continue goes on from it."""
        text = checked_text(text)
        with self.exclusive():
            replaced = self.history.message_at(index, "assistant")
            version = ReplyVersion(text, "", None, None, replaced.reply.opens_reasoning, False, edited=True)
            written = self.history.node("assistant", reply=version)
            self._move(self.history.entries[:index] + [written], index, lambda: self.history.add_reply(index, written))

    def switch_branch(self, index: int, branch: int) -> bool:
        """Show sibling `branch` at message `index` and the path below it. True when its cache
        states were put back (or are held already) without a forward pass; otherwise the next
        turn prefills from the fork."""
        with self.exclusive():
            arriving = self.history.sibling(index, branch)
            target = self.history.path_through(index, arriving)
            if arriving is self.history.entries[index]:
                return self._move(target, index)  # nothing changes: are its states held?
            return self._move(target, index, lambda: self.history.parent_at(index).show(arriving))

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
            target = [self.history.node("system", text)] if text else []
            self._move(target, 0, lambda: self.history.set_system_prompt(text))
            return True

    def undo(self) -> None:
        """Step back before the last user message; the undone turn stays as a branch there.
        The cache is rolled back lazily, next turn."""
        with self.exclusive():
            index = self.history.last_user_index()
            self._move(self.history.entries[:index], index, self.history.undo)

    def stop(self) -> None:
        """End the running stream early; safe from any thread. The partial reply is kept."""
        self._stop.set()

    def close(self) -> None:
        """The conversation is gone: its reply (if one runs) stopped, its states freed after it."""
        self.cancel_prepared()
        self.stop()
        self.source.close()

    def _move(self, target: list[Node], index: int, change: Callable[[], object] | None = None) -> bool:
        """The shown path becomes `target` from message `index` on (`change` makes it so): the
        source keeps the branch left and puts back the one arriving, where it can (no forward pass
        either way). True when it then holds the target's states."""
        self.cancel_prepared()
        messages = [node.message() for node in target]
        target_ids = self.planner.template.render_history(messages, about=self.planner.context_limit) \
            if target else []
        shown = [node.uid for node in self.history.entries]
        moved = self.source.move(BranchMove(shown, [node.uid for node in target], index, target_ids))
        if change is not None:
            change()
            self._revision += 1
        return moved


class Conversation(PathChanges):
    """A conversation's operations that make a reply (send, regenerate, edit, continue; and
    prepare, which prefills a message being typed): planned first, then run by the reply source
    and recorded in the history."""

    def send(self, text: str, *, fit_context: bool = False, **options: Any) -> ReplyStream:
        """Add a user message and stream the reply (see `operations.Send` for `fit_context`)."""
        return self.start(Send(text, fit_context), GenerationOptions.from_kwargs(**options))

    def regenerate(self, index: int | None = None, *, fit_context: bool = False, **options: Any) -> ReplyStream:
        """A new sibling of the reply at `index` (default: the last); the others stay switchable."""
        return self.start(Regenerate(index, fit_context), GenerationOptions.from_kwargs(**options))

    def edit(self, index: int, text: str, *, fit_context: bool = False, **options: Any) -> ReplyStream:
        """A new branch at the user message `index`, answered; the old one is kept."""
        return self.start(Edit(index, text, fit_context), GenerationOptions.from_kwargs(**options))

    def continue_reply(self, **options: Any) -> ReplyStream:
        """Extend the last reply in the same turn: the cache goes on from where it stopped."""
        return self.start(Continue(), GenerationOptions.from_kwargs(**options))

    def prepare(self, text: str, generation: GenerationOptions | None = None, *, fit_context: bool = True,
                **options: Any) -> bool:
        """Prefill the conversation as it will be once `text` is sent (the message being typed),
        in the steps where no reply has work: a Send of the same text with the same
        options then finds its prompt in the cache and starts at once. One at a time: a newer one,
        a Send, a change of what is shown or a close calls it off; what it fed stays where the
        Send's prompt shares it. Nothing is recorded and the text is kept nowhere but in the
        cache's token ids. False where nothing was started: a reply runs, the text is empty or
        cannot fit, or the replies come from a model server (which keeps its own cache)."""
        with self._prepare_lock:  # asks racing: the newest is the one started, the others are called off
            self.cancel_prepared()
            self._prepare_asks += 1
            ask = self._prepare_asks
        prepare = getattr(self.source, "prepare", None)
        if prepare is None or self.is_busy or not isinstance(text, str) or not text.strip():
            return False
        try:
            plan = self.planner.plan(Send(text, fit_context), self.history,
                                     generation or GenerationOptions.from_kwargs(**options), self._revision)
            self.source.check(plan.request)
        except ChatError:
            return False
        with self._prepare_lock:
            if ask != self._prepare_asks or self.is_busy:  # a newer ask, a Send or a close came meanwhile
                return False
            self._prepared = prepare(plan.request)
        return True

    def start(self, operation: Operation, options: GenerationOptions | None = None,
              cancelled: Cancelled = lambda: False) -> ReplyStream:
        """Plan `operation` now (raising before anything changes) and return its stream. From now
        until the stream ends, `snapshot()` includes the new message and the text so far, and a
        `stop()` ends it (even one before its first step: it then ends at once)."""
        self.cancel_prepared()
        plan = self.plan(operation, options or GenerationOptions(), cancelled)
        self._stop.clear()
        self._running = RunningReply(plan)
        stream = ReplyStream(self.run(plan), plan.dropped_turns, plan.dropped_turns > plan.dropped_before)
        weakref.finalize(stream, self._end_running, plan)  # a stream dropped unread frees the conversation
        return stream

    def plan(self, operation: Operation, options: GenerationOptions, cancelled: Cancelled = lambda: False) -> Plan:
        if self.is_busy:
            raise ConversationBusyError("a reply is still being generated; stop it first")
        plan = self.planner.plan(operation, self.history, options, self._revision, cancelled)
        self.source.check(plan.request)
        return plan

    def run(self, plan: Plan) -> Iterator[Delta]:
        """Stream the reply of a plan made by `plan()`; refused if the conversation changed since."""
        started = self._running is not None and self._running.plan is plan  # by start(), which cleared Stop
        running = self._running if started else RunningReply(plan)
        try:
            with _Exclusive(self._lock, lambda: self._running is not None and not started):
                if plan.revision != self._revision:
                    raise StalePlanError("the conversation changed after this operation was planned")
                if not started:
                    self._stop.clear()
                run = self.source.reply(plan.request, self._stop)
                try:
                    for delta in run:
                        running.take(delta)
                        yield delta
                finally:
                    reply = run.result()
                    with self._recording:  # a snapshot sees the reply running or recorded, never both
                        if reply is not None:  # recorded, stopped or not
                            if plan.reply is None:  # the reply's prompt, and its cut, as they were
                                version = replace(running.recorded(reply.version),
                                                  dropped_turns=plan.history[-1].reply.dropped_turns)
                                self.history.record_continuation(plan.history, version)
                            else:
                                version = replace(running.recorded(reply.version), dropped_turns=plan.dropped_turns)
                                self.history.record_reply(plan.history, plan.reply, version)
                            self.stats = replace(reply.stats, dropped_turns=plan.dropped_turns)
                            self._revision += 1
                            self.cancel_prepared()  # one planned before this reply began: stale now
                        self._end_running(plan)
        finally:
            self._end_running(plan)  # (refused before it ran)

    def _end_running(self, plan: Plan) -> None:
        if self._running is not None and self._running.plan is plan:
            self._running = None


@dataclass
class RunningReply:
    """A reply started and not ended yet: its plan and the text streamed so far."""

    plan: Plan
    answer: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    thinking_from: float | None = None  # when its first reasoning came
    answering_from: float | None = None  # when its first answer after reasoning came

    def take(self, delta: Delta) -> None:
        now = time.perf_counter()
        if delta.kind == "reasoning":
            self.reasoning.append(delta.text)
            self.thinking_from = self.thinking_from or now
        else:
            self.answer.append(delta.text)
            if self.thinking_from is not None and self.answering_from is None:
                self.answering_from = now

    def thought_s(self) -> float | None:
        """How long this run has thought (so far, if it still does); None if it did not think. A
        continued reply adds its earlier thinking."""
        earlier = self.plan.history[-1].reply.thought_s if self.plan.reply is None else None  # type: ignore[union-attr]
        if self.thinking_from is None:
            return earlier
        return (earlier or 0.0) + (self.answering_from or time.perf_counter()) - self.thinking_from

    def recorded(self, version: ReplyVersion) -> ReplyVersion:
        """What the history records of the source's version: with how long it thought."""
        return replace(version, thought_s=self.thought_s())

    def stopped_now(self) -> ReplyVersion:
        """The version the history would record if the reply stopped now."""
        answer, reasoning = "".join(self.answer), "".join(self.reasoning)
        if self.plan.reply is None:  # Continue: the last reply, longer
            earlier = self.plan.history[-1].reply
            assert earlier is not None
            return replace(earlier, content=earlier.content + answer, reasoning_content=earlier.reasoning_content
                           + reasoning, stopped=True, ended=False, thought_s=self.thought_s())
        return ReplyVersion(answer, reasoning, None, None, self.plan.request.opens_reasoning, True,
                            thought_s=self.thought_s())


class _Exclusive:
    """Holds the conversation lock for one operation; a second concurrent one is refused, not queued."""

    def __init__(self, lock: threading.Lock, running: Callable[[], bool]):
        self._lock = lock
        self._running = running  # another reply was started (its stream not read yet)

    def __enter__(self) -> None:
        if not self._lock.acquire(blocking=False):
            raise ConversationBusyError("a reply is still being generated; stop it first")
        if self._running():
            self._lock.release()
            raise ConversationBusyError("a reply is still being generated; stop it first")

    def __exit__(self, *exc: object) -> None:
        self._lock.release()
