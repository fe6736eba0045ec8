"""One reply being made: prefill, generate, stream text deltas, then what to record.

A `Turn` runs on behalf of its conversation, which holds the lock: it submits the prompt to the
engine's decode scheduler (which rolls the cache back, prefills and decodes it, batched with
the other conversations' replies), streams the tokens as reasoning/answer deltas, and at the
end checks what the model fed to the cache and says what the reply and its statistics are.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterator

from cache_sessions.rollback import RollbackHow
from cache_sessions.session import CacheSession, PrefillResult
from chat.detokenizer import IncrementalDecoder
from chat.history import ReplyVersion
from chat.plans import Plan
from chat.reasoning import Delta, ReasoningSplitter
from chat.runtime import Runtime
from chat.scheduler import GenerationRequest


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
    rollback: RollbackHow = "none"
    stopped: bool = False
    shared_prefix_tokens: int = 0
    dropped_turns: int = 0
    waited_s: float = 0.0  # from the request until its prefill began: waiting for other replies
    cache_reuse_known: bool = True  # False: a model server that did not say how much of its cache it used


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


class Turn:
    def __init__(self, runtime: Runtime, session: CacheSession, plan: Plan, stop: threading.Event,
                 before: Callable[[], None] | None = None):
        """`before`: the conversation's own cache work, run on the compute thread when the
        scheduler takes the reply up."""
        self.runtime, self.session, self.plan, self.stop, self.before = runtime, session, plan, stop, before
        self.generation: GenerationRequest | None = None
        self._finished_stream = False
        self._started = 0.0

    def deltas(self) -> Iterator[Delta]:
        runtime, plan = self.runtime, self.plan
        self._started = time.perf_counter()
        self.stop.clear()
        self.generation = runtime.scheduler.submit(self.session, plan.prompt_ids, plan.options, self.stop,
                                                   prefix_store=runtime.prefix_store,
                                                   shared_prefix_length=plan.shared_prefix_length,
                                                   before=self.before)
        decoder = IncrementalDecoder(runtime.tokenizer, runtime.eos_token_ids, context_ids=plan.earlier_ids)
        splitter = ReasoningSplitter(starts_in_reasoning=plan.opens_reasoning)
        splitter.feed(decoder.context_text)
        for token_id in self.generation.tokens():
            yield from splitter.feed(decoder.push(token_id))
        yield from splitter.feed(decoder.flush())
        yield from splitter.finish()
        self._finished_stream = True

    def finish(self) -> tuple[ReplyVersion, TurnStats]:
        """Stop the model if it still runs, check what it fed, and describe the reply.
        Raises what generation raised (the cache is then released: it cannot be trusted)."""
        assert self.generation is not None
        try:
            sequence = self.generation.finish()
            if self.generation.started:  # one stopped while it waited never touched the cache
                self.session.commit(sequence)
        except BaseException:
            self.session.release()
            raise
        stopped = not self._finished_stream or self.stop.is_set()
        return self._reply(sequence, stopped), self._stats(sequence, stopped)

    def _reply(self, sequence: list[int], stopped: bool) -> ReplyVersion:
        plan, tokenizer = self.plan, self.runtime.tokenizer
        new_ids = [token for token in sequence[len(plan.prompt_ids):] if token not in self.runtime.eos_token_ids]
        reply_ids = plan.earlier_ids + new_ids
        splitter = ReasoningSplitter(starts_in_reasoning=plan.opens_reasoning)
        splitter.feed(tokenizer.decode(reply_ids, skip_special_tokens=False))
        splitter.finish()
        content, reasoning = splitter.message_fields()
        prompt_ids = plan.prompt_ids[: len(plan.prompt_ids) - len(plan.earlier_ids)]
        return ReplyVersion(content, reasoning, reply_ids, prompt_ids, plan.opens_reasoning, stopped)

    def _stats(self, sequence: list[int], stopped: bool) -> TurnStats:
        run, plan = self.generation, self.plan
        assert run is not None
        prefill = run.prefill or PrefillResult(0, 0, False, "none")
        now = time.perf_counter()
        first, last = run.first_token_at or now, run.last_token_at or now
        decode_rate = (run.token_count - 1) / (last - first) if run.token_count > 1 and last > first else 0.0
        return TurnStats(
            reused_tokens=prefill.reused_tokens,
            prefilled_tokens=prefill.prefilled_tokens,
            generated_tokens=len(sequence) - len(plan.prompt_ids),
            rebuilt=prefill.rebuilt,
            ttft_s=first - self._started,
            decode_tokens_per_s=decode_rate,
            cache_tokens=len(self.session.token_ids),
            cache_bytes=self.session.nbytes(),
            prompt_tokens=len(plan.prompt_ids),
            rollback=prefill.rollback,
            stopped=stopped,
            shared_prefix_tokens=prefill.shared_prefix_tokens,
            dropped_turns=plan.dropped_turns,
            waited_s=(run.started_at or now) - run.submitted_at,
        )
