"""A conversation: the canonical message history and the one cache session that serves it.

Every operation is planned first (validated, prompt rendered, context checked) and only then
run, so bad input raises before anything changes. Running means: roll the cache back to where
the new prompt diverges, prefill the rest, stream the reply, record it.
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator

from cache_sessions.session import CacheSession, PrefillResult
from chat.errors import (
    ContextOverflowError,
    ConversationBusyError,
    ConversationError,
    EmptyMessageError,
    NothingToRegenerateError,
    NothingToUndoError,
    NotAUserMessageError,
)
from chat.generation import GenerationOptions, GenerationRun, IncrementalDecoder
from chat.reasoning import Delta, ReasoningSplitter

if TYPE_CHECKING:
    from chat.engine import ChatEngine

Message = dict[str, Any]
MAX_VERSIONS = 8
_version_ids = itertools.count()


@dataclass(frozen=True)
class TurnStats:
    """What the last generating operation cost and reused."""

    reused_tokens: int
    prefilled_tokens: int
    generated_tokens: int
    rebuilt: bool
    ttft_s: float
    decode_tokens_per_s: float
    cache_tokens: int
    cache_bytes: int
    prompt_tokens: int = 0
    rollback: str = "none"
    stopped: bool = False
    shared_prefix_tokens: int = 0
    dropped_turns: int = 0


@dataclass
class ReplyVersion:
    """One reply to a user message: its text, its tokens and the prompt they continued."""

    content: str
    reasoning_content: str
    reply_ids: list[int]
    prompt_ids: list[int]
    opens_reasoning: bool
    stopped: bool
    uid: int = field(default_factory=lambda: next(_version_ids))


@dataclass
class _Entry:
    """A history entry; an assistant entry holds its reply versions and which one is shown."""

    role: str
    content: str = ""
    versions: list[ReplyVersion] = field(default_factory=list)
    active: int = 0

    @property
    def reply(self) -> ReplyVersion:
        return self.versions[self.active]

    def message(self) -> Message:
        if self.role != "assistant":
            return {"role": self.role, "content": self.content}
        return {"role": "assistant", "content": self.reply.content, "reasoning_content": self.reply.reasoning_content}


@dataclass(frozen=True)
class _Plan:
    kind: str  # "reply" (send, regenerate, edit) or "continue"
    history: list[_Entry]  # for "reply": ends with the user message; for "continue": with the reply
    prompt_ids: list[int]
    opens_reasoning: bool
    options: GenerationOptions
    revision: int
    dropped_turns: int = 0


class ReplyStream:
    """The deltas of one reply; iterate it. `dropped_turns` is known before the first delta."""

    def __init__(self, deltas: Iterator[Delta], dropped_turns: int):
        self._deltas = deltas
        self.dropped_turns = dropped_turns

    def __iter__(self) -> "ReplyStream":
        return self

    def __next__(self) -> Delta:
        return next(self._deltas)

    def close(self) -> None:
        self._deltas.close()


class Conversation:
    def __init__(self, engine: "ChatEngine", system_prompt: str | None = None):
        self._engine = engine
        self.session = CacheSession(engine.model, max_checkpoints=engine.max_checkpoints)
        self._entries: list[_Entry] = []
        if system_prompt is not None and system_prompt.strip():
            self._entries.append(_Entry("system", system_prompt))
        self.stats: TurnStats | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._revision = 0

    # ---- moving between processes (ZeroGPU runs each call in a forked worker) ---------------
    def __getstate__(self) -> dict[str, Any]:
        """Everything but the engine, locks and events: a conversation travels without its model."""
        state = self.__dict__.copy()
        for name in ("_engine", "_lock", "_stop"):
            del state[name]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._engine = None  # type: ignore[assignment]  # attach() gives it one
        self._lock = threading.Lock()
        self._stop = threading.Event()

    def attach(self, engine: "ChatEngine") -> None:
        """Serve this conversation with `engine` (after it crossed a process boundary)."""
        self._engine = engine
        self.session.model = engine.model

    def take_state_of(self, other: "Conversation", engine: "ChatEngine") -> None:
        """Become `other` (the same conversation, updated in a worker process)."""
        self.__dict__.update(other.__getstate__())
        self.attach(engine)

    def exclusive(self) -> "_Exclusive":
        """Hold the conversation for an operation run elsewhere; concurrent ones are refused."""
        return self._exclusive()

    # ---- read-only views -------------------------------------------------------------------
    @property
    def messages(self) -> list[Message]:
        return [entry.message() for entry in self._entries]

    @property
    def reply_ids(self) -> list[int]:
        last = self._last_reply()
        return list(last.reply.reply_ids) if last else []

    @property
    def versions(self) -> tuple[int, int]:
        """(index of the shown version, number of versions) of the last reply; (0, 0) if none."""
        last = self._last_reply()
        return (last.active, len(last.versions)) if last else (0, 0)

    @property
    def system_prompt(self) -> str | None:
        return self._entries[0].content if self._entries and self._entries[0].role == "system" else None

    @property
    def is_generating(self) -> bool:
        return self._lock.locked()

    # ---- operations ------------------------------------------------------------------------
    def send(self, text: str, *, fit_context: bool = False, **options: Any) -> ReplyStream:
        """Add a user message and stream the reply. With `fit_context`, the oldest turns are
        dropped (the system prompt stays) when the history would not fit the context."""
        history = self._entries + [_Entry("user", _checked_text(text))]
        return self._stream(self._plan_reply(history, options, fit_context=fit_context))

    def regenerate(self, **options: Any) -> ReplyStream:
        """A new version of the last reply; the earlier versions stay selectable."""
        if self._entries and self._entries[-1].role == "assistant":
            history = self._entries[:-1]
        elif self._entries and self._entries[-1].role == "user":
            history = list(self._entries)  # a user message left without a reply (failure)
        else:
            raise NothingToRegenerateError("there is no reply to regenerate")
        return self._stream(self._plan_reply(history, options))

    def edit(self, index: int, text: str, **options: Any) -> ReplyStream:
        """Replace the user message at `index`, drop everything after it, reply again."""
        if not isinstance(index, int) or not 0 <= index < len(self._entries):
            raise NotAUserMessageError(f"no message at index {index!r}")
        if self._entries[index].role != "user":
            raise NotAUserMessageError(f"message {index} is a {self._entries[index].role} message, not a user one")
        history = self._entries[:index] + [_Entry("user", _checked_text(text))]
        return self._stream(self._plan_reply(history, options))

    def continue_reply(self, **options: Any) -> ReplyStream:
        """Extend the last reply in the same turn: the cache goes on from where it stopped."""
        last = self._last_reply()
        if last is None:
            raise NothingToRegenerateError("there is no reply to continue")
        generation_options = self._options(options)
        reply = last.reply
        prompt_ids = reply.prompt_ids + reply.reply_ids
        self._check_context(len(prompt_ids), generation_options)
        return self._stream(_Plan("continue", list(self._entries), prompt_ids, reply.opens_reasoning,
                                  generation_options, self._revision))

    def undo(self) -> None:
        """Drop the last user message and its reply. The cache is rolled back lazily, next turn."""
        with self._exclusive():
            users = [i for i, entry in enumerate(self._entries) if entry.role == "user"]
            if not users:
                raise NothingToUndoError("there is no user message to undo")
            del self._entries[users[-1]:]
            self._revision += 1

    def select_version(self, index: int) -> bool:
        """Show version `index` of the last reply. Returns True when its cache states were put
        back without running the model; otherwise the next turn prefills it."""
        last = self._last_reply()
        if last is None or not isinstance(index, int) or not 0 <= index < len(last.versions):
            raise ConversationError(f"there is no reply version {index!r}")
        with self._exclusive():
            if index == last.active:
                return True
            return self._engine.worker.run(self._switch_version, last, index)

    def _switch_version(self, last: _Entry, index: int) -> bool:
        """On the compute thread: keep the shown reply's states, put back those of `index`.
        No forward pass: this works wherever the cache lies, on the CPU between ZeroGPU calls too."""
        self._stash_reply_segment(last.reply)
        last.active = index
        self._revision += 1
        segment = self.session.segments.get(last.reply.uid)
        return segment is not None and self.session.append_segment(segment)

    def stop(self) -> None:
        """End the running stream early; safe from any thread. The partial reply is kept."""
        self._stop.set()

    # ---- planning ----------------------------------------------------------------------------
    def _options(self, options: dict[str, Any]) -> GenerationOptions:
        if self.is_generating:
            raise ConversationBusyError("a reply is still being generated; stop it first")
        return GenerationOptions.from_kwargs(**options)

    def _check_context(self, prompt_tokens: int, options: GenerationOptions) -> None:
        limit = self._engine.context_limit
        if limit is not None and prompt_tokens + options.max_new_tokens > limit:
            raise ContextOverflowError(
                f"the prompt ({prompt_tokens} tokens) plus max_new_tokens ({options.max_new_tokens}) "
                f"exceeds the model's context of {limit} tokens",
                prompt_tokens=prompt_tokens,
                max_new_tokens=options.max_new_tokens,
                context_limit=limit,
            )

    def _plan_reply(self, history: list[_Entry], options: dict[str, Any], *, fit_context: bool = False) -> _Plan:
        generation_options = self._options(options)
        dropped = 0
        while True:
            prompt = self._engine.template.render([entry.message() for entry in history],
                                                  enable_thinking=generation_options.enable_thinking)
            try:
                self._check_context(len(prompt.ids), generation_options)
                break
            except ContextOverflowError:
                turn = _oldest_turn(history)
                if not fit_context or turn is None:
                    raise
                del history[turn[0]:turn[1]]
                dropped += 1
        return _Plan("reply", history, prompt.ids, prompt.opens_reasoning, generation_options,
                     self._revision, dropped)

    # ---- running -----------------------------------------------------------------------------
    def _exclusive(self) -> "_Exclusive":
        return _Exclusive(self._lock)

    def _stream(self, plan: _Plan) -> ReplyStream:
        return ReplyStream(self._run(plan), plan.dropped_turns)

    def _run(self, plan: _Plan) -> Iterator[Delta]:
        with self._exclusive():
            if plan.revision != self._revision:
                raise ConversationBusyError("the conversation changed after this operation was planned")
            self._engine.worker.run(self._move_session_to_model)
            try:
                yield from self._generate(plan)
            finally:
                self._engine.worker.run(self._offload_session)

    def _generate(self, plan: _Plan) -> Iterator[Delta]:
        engine = self._engine
        self._stop.clear()
        started = time.perf_counter()
        prefill = engine.worker.run(self._prepare, plan)
        run = GenerationRun(engine.model, self.session.cache, plan.prompt_ids, plan.options, self._stop, engine.worker)
        earlier_ids = self._last_reply().reply.reply_ids if plan.kind == "continue" else []
        decoder = IncrementalDecoder(engine.tokenizer, engine.eos_token_ids, context_ids=earlier_ids)
        splitter = ReasoningSplitter(starts_in_reasoning=plan.opens_reasoning)
        splitter.feed(decoder.context_text)
        finished_stream = False
        try:
            for token_id in run.tokens():
                yield from splitter.feed(decoder.push(token_id))
            yield from splitter.feed(decoder.flush())
            yield from splitter.finish()
            finished_stream = True
        finally:
            try:
                sequence = run.finish()
                self.session.commit(sequence)
            except BaseException:
                self.session.invalidate()
                raise
            stopped = not finished_stream or self._stop.is_set()
            self._record(plan, sequence, earlier_ids, stopped)
            self._record_stats(plan, sequence, started, prefill, run, stopped)

    def _prepare(self, plan: _Plan) -> PrefillResult:
        """On the compute thread: keep the reply being regenerated, then roll back and prefill."""
        if self._is_regeneration(plan):
            self._stash_reply_segment(self._entries[-1].reply)
        return self.session.prepare(plan.prompt_ids, prefix_store=self._engine.prefix_store,
                                    shared_prefix_length=self._shared_prefix_length(plan))

    def _record(self, plan: _Plan, sequence: list[int], earlier_ids: list[int], stopped: bool) -> None:
        engine = self._engine
        new_ids = [token for token in sequence[len(plan.prompt_ids):] if token not in engine.eos_token_ids]
        reply_ids = earlier_ids + new_ids
        splitter = ReasoningSplitter(starts_in_reasoning=plan.opens_reasoning)
        splitter.feed(engine.tokenizer.decode(reply_ids, skip_special_tokens=False))
        splitter.finish()
        content, reasoning = splitter.message_fields()
        prompt_ids = plan.prompt_ids[: len(plan.prompt_ids) - len(earlier_ids)]
        version = ReplyVersion(content, reasoning, reply_ids, prompt_ids, plan.opens_reasoning, stopped)
        if plan.kind == "continue":
            entry = plan.history[-1]
            self.session.segments.pop(entry.reply.uid, None)
            version.uid = entry.reply.uid
            entry.versions[entry.active] = version
            self._entries = plan.history
        else:
            old = self._entries[len(plan.history)] if self._is_regeneration(plan) else None
            versions = ((old.versions if old else []) + [version])[-MAX_VERSIONS:]
            for entry in plan.history:  # only the last reply keeps versions
                if entry.role == "assistant" and len(entry.versions) > 1:
                    entry.versions, entry.active = [entry.reply], 0
            kept = {v.uid for v in versions}
            self.session.segments = {uid: s for uid, s in self.session.segments.items() if uid in kept}
            self._entries = plan.history + [_Entry("assistant", versions=versions, active=len(versions) - 1)]
        self._revision += 1

    def _record_stats(self, plan: _Plan, sequence: list[int], started: float, prefill: PrefillResult,
                      run: GenerationRun, stopped: bool) -> None:
        now = time.perf_counter()
        first, last = run.first_token_at or now, run.last_token_at or now
        self.stats = TurnStats(
            reused_tokens=prefill.reused_tokens,
            prefilled_tokens=prefill.prefilled_tokens,
            generated_tokens=len(sequence) - len(plan.prompt_ids),
            rebuilt=prefill.rebuilt,
            ttft_s=first - started,
            decode_tokens_per_s=(run.token_count - 1) / (last - first) if run.token_count > 1 and last > first else 0.0,
            cache_tokens=len(self.session.token_ids),
            cache_bytes=self.session.nbytes(),
            prompt_tokens=len(plan.prompt_ids),
            rollback=prefill.rollback,
            stopped=stopped,
            shared_prefix_tokens=prefill.shared_prefix_tokens,
            dropped_turns=plan.dropped_turns,
        )

    # ---- helpers -----------------------------------------------------------------------------
    def _last_reply(self) -> _Entry | None:
        if self._entries and self._entries[-1].role == "assistant" and self._entries[-1].versions:
            return self._entries[-1]
        return None

    def _is_regeneration(self, plan: _Plan) -> bool:
        """The plan answers the same history as the current last reply (a new version of it)."""
        n = len(plan.history)
        return (n == len(self._entries) - 1 and self._entries[n].role == "assistant"
                and all(a is b for a, b in zip(plan.history, self._entries)))

    def _stash_reply_segment(self, reply: ReplyVersion) -> None:
        """Keep the cache states of the shown reply, if the cache holds them, to switch back later."""
        session = self.session
        start = len(reply.prompt_ids) - 1
        held = session.token_ids
        if (reply.uid not in session.segments and len(held) > start + 1
                and held[: len(reply.prompt_ids)] == reply.prompt_ids
                and held[len(reply.prompt_ids):] == reply.reply_ids[: len(held) - len(reply.prompt_ids)]):
            session.segments[reply.uid] = session.cut_segment(start)

    def _shared_prefix_length(self, plan: _Plan) -> int:
        """Tokens of the system prompt turn, when the template renders it as a prompt prefix."""
        engine = self._engine
        if (engine.prefix_store is None or not engine.template.accepts_system or not plan.history
                or plan.history[0].role != "system"):
            return 0
        prefix = engine.template.render_history([plan.history[0].message()])
        return len(prefix) if plan.prompt_ids[: len(prefix)] == prefix else 0

    def _move_session_to_model(self) -> None:
        if self._engine.offload_sessions:
            self.session.to(self._engine.model.device)

    def _offload_session(self) -> None:
        if self._engine.offload_sessions:
            self.session.to("cpu")


class _Exclusive:
    """Holds the conversation lock for one operation; a second concurrent one is refused, not queued."""

    def __init__(self, lock: threading.Lock):
        self._lock = lock

    def __enter__(self) -> None:
        if not self._lock.acquire(blocking=False):
            raise ConversationBusyError("a reply is still being generated; stop it first")

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


def _oldest_turn(history: list[_Entry]) -> tuple[int, int] | None:
    """[start, end) of the oldest user turn and its replies, never the last user message."""
    users = [i for i, entry in enumerate(history) if entry.role == "user"]
    if len(users) < 2:
        return None
    return users[0], users[1]


def _checked_text(text: Any) -> str:
    if not isinstance(text, str):
        raise ConversationError(f"a message must be text, not {type(text).__name__}")
    if not text.strip():
        raise EmptyMessageError("the message is empty")
    return text
