"""A conversation: the canonical message history and the one cache session that serves it.

Every operation is planned first (validated, prompt rendered, context checked) and only then
run, so bad input raises before anything changes. Running means: roll the cache back to where
the new prompt diverges, prefill the rest, stream the reply, record it.
"""

from __future__ import annotations

import copy
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator

from cache_sessions.session import CacheSession
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
from chat.templates import RenderedPrompt

if TYPE_CHECKING:
    from chat.engine import ChatEngine

Message = dict[str, Any]


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


@dataclass(frozen=True)
class _Plan:
    history: list[Message]  # what the reply answers: ends with a user message
    prompt: RenderedPrompt
    options: GenerationOptions
    revision: int


class Conversation:
    def __init__(self, engine: "ChatEngine", system_prompt: str | None = None):
        self._engine = engine
        self.session = CacheSession(engine.model, max_checkpoints=engine.max_checkpoints)
        self._messages: list[Message] = []
        if system_prompt is not None and system_prompt.strip():
            self._messages.append({"role": "system", "content": system_prompt})
        self._generated_ids: dict[int, list[int]] = {}  # message index -> reply token ids
        self.stats: TurnStats | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._revision = 0

    # ---- read-only views -------------------------------------------------------------------
    @property
    def messages(self) -> list[Message]:
        return copy.deepcopy(self._messages)

    @property
    def reply_ids(self) -> list[int]:
        if not self._messages or self._messages[-1]["role"] != "assistant":
            return []
        return list(self._generated_ids.get(len(self._messages) - 1, []))

    @property
    def is_generating(self) -> bool:
        return self._lock.locked()

    # ---- operations ------------------------------------------------------------------------
    def send(self, text: str, **options: Any) -> Iterator[Delta]:
        """Add a user message and stream the reply."""
        history = self._messages + [{"role": "user", "content": _checked_text(text)}]
        return self._stream(self._plan(history, options))

    def regenerate(self, **options: Any) -> Iterator[Delta]:
        """A new reply to the same last user message (the old reply is replaced)."""
        if self._messages and self._messages[-1]["role"] == "assistant":
            history = self._messages[:-1]
        elif self._messages and self._messages[-1]["role"] == "user":
            history = list(self._messages)  # a user message left without a reply (failure)
        else:
            raise NothingToRegenerateError("there is no reply to regenerate")
        return self._stream(self._plan(history, options))

    def edit(self, index: int, text: str, **options: Any) -> Iterator[Delta]:
        """Replace the user message at `index`, drop everything after it, reply again."""
        if not isinstance(index, int) or not 0 <= index < len(self._messages):
            raise NotAUserMessageError(f"no message at index {index!r}")
        if self._messages[index]["role"] != "user":
            raise NotAUserMessageError(f"message {index} is a {self._messages[index]['role']} message, not a user one")
        history = self._messages[:index] + [{"role": "user", "content": _checked_text(text)}]
        return self._stream(self._plan(history, options))

    def undo(self) -> None:
        """Drop the last user message and its reply. The cache is rolled back lazily, next turn."""
        with self._exclusive():
            users = [i for i, message in enumerate(self._messages) if message["role"] == "user"]
            if not users:
                raise NothingToUndoError("there is no user message to undo")
            self._truncate(users[-1])
            self._revision += 1

    def stop(self) -> None:
        """End the running stream early; safe from any thread. The partial reply is kept."""
        self._stop.set()

    # ---- internals -------------------------------------------------------------------------
    def _plan(self, history: list[Message], options: dict[str, Any]) -> _Plan:
        if self.is_generating:
            raise ConversationBusyError("a reply is still being generated; stop it first")
        generation_options = GenerationOptions.from_kwargs(**options)
        prompt = self._engine.template.render(history, enable_thinking=generation_options.enable_thinking)
        limit = self._engine.context_limit
        needed = len(prompt.ids) + generation_options.max_new_tokens
        if limit is not None and needed > limit:
            raise ContextOverflowError(
                f"the prompt ({len(prompt.ids)} tokens) plus max_new_tokens "
                f"({generation_options.max_new_tokens}) exceeds the model's context of {limit} tokens",
                prompt_tokens=len(prompt.ids),
                max_new_tokens=generation_options.max_new_tokens,
                context_limit=limit,
            )
        return _Plan(copy.deepcopy(history), prompt, generation_options, self._revision)

    def _exclusive(self) -> "_Exclusive":
        return _Exclusive(self._lock)

    def _truncate(self, length: int) -> None:
        del self._messages[length:]
        self._generated_ids = {i: ids for i, ids in self._generated_ids.items() if i < length}

    def _stream(self, plan: _Plan) -> Iterator[Delta]:
        with self._exclusive():
            if plan.revision != self._revision:
                raise ConversationBusyError("the conversation changed after this operation was planned")
            yield from self._generate(plan)

    def _generate(self, plan: _Plan) -> Iterator[Delta]:
        engine = self._engine
        self._stop.clear()
        started = time.perf_counter()
        prefill = self.session.prepare(plan.prompt.ids)
        run = GenerationRun(engine.model, self.session.cache, plan.prompt.ids, plan.options, self._stop)
        decoder = IncrementalDecoder(engine.tokenizer, engine.eos_token_ids)
        splitter = ReasoningSplitter(starts_in_reasoning=plan.prompt.opens_reasoning)
        finished_stream = False
        try:
            for token_id in run.tokens():
                for delta in splitter.feed(decoder.push(token_id)):
                    yield delta
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
            self._record_reply(plan, sequence, started, prefill, run, stopped=not finished_stream or self._stop.is_set())

    def _record_reply(self, plan: _Plan, sequence: list[int], started: float, prefill: Any, run: GenerationRun,
                      stopped: bool) -> None:
        engine = self._engine
        generated = sequence[len(plan.prompt.ids):]
        reply_ids = generated[:-1] if generated and generated[-1] in engine.eos_token_ids else generated
        reply_ids = [token for token in reply_ids if token not in engine.eos_token_ids]
        splitter = ReasoningSplitter(starts_in_reasoning=plan.prompt.opens_reasoning)
        splitter.feed(engine.tokenizer.decode(reply_ids, skip_special_tokens=False))
        splitter.finish()
        content, reasoning = splitter.message_fields()
        self._messages = plan.history + [{"role": "assistant", "content": content, "reasoning_content": reasoning}]
        self._generated_ids = {i: ids for i, ids in self._generated_ids.items() if i < len(plan.history)}
        self._generated_ids[len(self._messages) - 1] = reply_ids
        self._revision += 1
        first, last = run.first_token_at or time.perf_counter(), run.last_token_at or time.perf_counter()
        self.stats = TurnStats(
            reused_tokens=prefill.reused_tokens,
            prefilled_tokens=prefill.prefilled_tokens,
            generated_tokens=len(generated),
            rebuilt=prefill.rebuilt,
            ttft_s=first - started,
            decode_tokens_per_s=(run.token_count - 1) / (last - first) if run.token_count > 1 and last > first else 0.0,
            cache_tokens=len(self.session.token_ids),
            cache_bytes=self.session.nbytes(),
            prompt_tokens=len(plan.prompt.ids),
            rollback=prefill.rollback,
            stopped=stopped,
        )


class _Exclusive:
    """Holds the conversation lock for one operation; a second concurrent one is refused, not queued."""

    def __init__(self, lock: threading.Lock):
        self._lock = lock

    def __enter__(self) -> None:
        if not self._lock.acquire(blocking=False):
            raise ConversationBusyError("a reply is still being generated; stop it first")

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


def _checked_text(text: Any) -> str:
    if not isinstance(text, str):
        raise ConversationError(f"a message must be text, not {type(text).__name__}")
    if not text.strip():
        raise EmptyMessageError("the message is empty")
    return text
