"""Replies from the embedded engine: the conversation's cache session, served by the scheduler's
loop and changed only by the cache owner (cache_sessions/owner.py).

A `LocalReply` submits the prompt to the scheduler (which rolls the cache back, prefills and
decodes it, batched with the other conversations' replies), streams the tokens as
reasoning/answer deltas, and at the end says what the reply and its statistics are.
"""

from __future__ import annotations

import threading
import time
from typing import Hashable, Iterator, Sequence

from cache_sessions.branches import BranchMove
from cache_sessions.session import CacheSession, PrefillResult
from chat.dialogue.detokenizer import IncrementalDecoder
from chat.dialogue.history import Message, ReplyVersion
from chat.dialogue.reasoning import Delta, ReasoningSplitter
from chat.runtime import Runtime
from chat.scheduling.requests import CacheWork, GenerationRequest
from chat.backends.sources import Reply, ReplyRequest, TurnStats


class LocalSource:
    """A `ReplySource` on this process's engine."""

    def __init__(self, runtime: Runtime, session: CacheSession | None = None, *, rebuilt: bool = False,
                 client: Hashable | None = None):
        """`rebuilt`: its conversation was restored from saved text, so the states its first turn
        computes were once held (its stats say so). `client`: who holds it (the scheduler's flow)."""
        self.runtime, self.client = runtime, client
        self.session: CacheSession = session or runtime.caches.new_session()
        if rebuilt:
            self.session.mark_rebuilt()  # a new session, not yet known to the loop

    def check(self, request: ReplyRequest) -> None:
        """The engine makes any reply it was asked for."""

    def reply(self, request: ReplyRequest, stop: threading.Event) -> "LocalReply":
        return LocalReply(self.runtime, self.session, request, stop, self.client)

    def move(self, move: BranchMove) -> bool:
        return self.runtime.scheduler.call(self.runtime.caches.move, self.session, move)

    def prepare(self, request: ReplyRequest) -> threading.Event:
        """Prefill `request`'s prompt ahead, at idle priority (`DecodeScheduler.prepare`); setting
        the returned event calls it off."""
        stop, runtime = threading.Event(), self.runtime
        work = CacheWork(runtime.prefix_store, shared_prefix_length(runtime, request), None, request.labels[:-1])
        runtime.scheduler.prepare(self.session, request.prompt_ids, stop, work, self.client)
        return stop

    def close(self) -> None:
        self.runtime.caches.close(self.session)


class LocalReply:
    def __init__(self, runtime: Runtime, session: CacheSession, request: ReplyRequest, stop: threading.Event,
                 client: Hashable | None = None):
        self.runtime, self.session, self.request, self.stop, self.client = runtime, session, request, stop, client
        self.generation: GenerationRequest | None = None
        self._finished_stream = False
        self._started = 0.0

    def __iter__(self) -> Iterator[Delta]:
        runtime, request = self.runtime, self.request
        self._started = time.perf_counter()
        work = CacheWork(runtime.prefix_store, shared_prefix_length(runtime, request), request.keep, request.labels,
                         request.references)
        self.generation = runtime.scheduler.submit(self.session, request.prompt_ids, request.options, self.stop, work,
                                                   self.client)
        decoder = IncrementalDecoder(runtime.tokenizer, runtime.eos_token_ids, context_ids=request.earlier_ids)
        splitter = ReasoningSplitter(starts_in_reasoning=request.opens_reasoning)
        splitter.feed(decoder.context_text)
        for token_id in self.generation.tokens():
            yield from splitter.feed(decoder.push(token_id))
        yield from splitter.feed(decoder.flush())
        yield from splitter.finish()
        self._finished_stream = True

    def result(self) -> Reply | None:
        """Stop the model if it still runs and describe the reply (the scheduler has checked what
        it fed). Raises what generation raised (the cache was released: it cannot be trusted)."""
        if self.generation is None:
            return None
        sequence = self.generation.finish()
        stopped = not self._finished_stream or self.stop.is_set()
        return Reply(self._version(sequence, stopped), self._stats(sequence, stopped))

    def _version(self, sequence: list[int], stopped: bool) -> ReplyVersion:
        request, tokenizer = self.request, self.runtime.tokenizer
        generated = sequence[len(request.prompt_ids):]
        new_ids = [token for token in generated if token not in self.runtime.eos_token_ids]
        # the model ended it: an end token, or (the chooser's own end tokens) before its length ran out
        ended = not stopped and bool(generated) and (generated[-1] in self.runtime.eos_token_ids
                                                    or len(generated) < request.options.max_new_tokens)
        reply_ids = request.earlier_ids + new_ids
        splitter = ReasoningSplitter(starts_in_reasoning=request.opens_reasoning)
        splitter.feed(tokenizer.decode(reply_ids, skip_special_tokens=False))
        splitter.finish()
        content, reasoning = splitter.message_fields()
        prompt_ids = request.prompt_ids[: len(request.prompt_ids) - len(request.earlier_ids)]
        return ReplyVersion(content, reasoning, reply_ids, prompt_ids, request.opens_reasoning, stopped, ended=ended)

    def _stats(self, sequence: list[int], stopped: bool) -> TurnStats:
        run = self.generation
        assert run is not None
        prefill = run.prefill or PrefillResult(0, 0, False, "none")
        now = time.perf_counter()
        first, last = run.first_token_at or now, run.last_token_at or now
        decode_rate = (run.token_count - 1) / (last - first) if run.token_count > 1 and last > first else 0.0
        return TurnStats(
            reused_tokens=prefill.reused_tokens,
            prefilled_tokens=prefill.prefilled_tokens,
            generated_tokens=len(sequence) - len(self.request.prompt_ids),
            rebuilt=prefill.rebuilt,
            ttft_s=first - self._started,
            decode_tokens_per_s=decode_rate,
            cache_tokens=run.cache_tokens,
            cache_bytes=run.cache_bytes,
            prompt_tokens=len(self.request.prompt_ids),
            rollback=prefill.rollback,
            stopped=stopped,
            shared_prefix_tokens=prefill.shared_prefix_tokens,
            waited_s=(run.started_at or now) - run.submitted_at,
        )


def shared_prefix_length(runtime: Runtime, request: ReplyRequest) -> int:
    """Tokens of the system prompt turn, when the template renders it as a prompt prefix."""
    return system_prefix_length(runtime, request.messages, request.prompt_ids)


def system_prefix_length(runtime: Runtime, messages: Sequence[Message], prompt_ids: Sequence[int]) -> int:
    """Tokens of `messages`' system turn, when the template renders it as a prefix of `prompt_ids`."""
    if runtime.prefix_store is None or not runtime.template.accepts_system:
        return 0
    if not messages or messages[0]["role"] != "system":
        return 0
    prefix = runtime.template.render_history(messages[:1])
    return len(prefix) if list(prompt_ids[: len(prefix)]) == prefix else 0
