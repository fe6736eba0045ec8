"""Continuous batching on the engine's loop (chat/scheduling/loop.py): every reply being generated advances in
one model step per step; every other change to a cache runs between steps.

Three roles (vLLM v1, nano-vllm): the scheduler decides (its planner, chat/scheduling/step_planner.py, over
the table of requests), the cache owner (cache_sessions/owner.py) applies, the runner
(chat/model_step/runner.py) executes. One step, after the commands other threads posted (a
branch switch, a close, a worker's result), reads in that order: **plan** (a `StepPlan`, plain
data, made without changing anything: who leaves, who is admitted and where each newcomer's
cache will land, this step's prompt pieces within its budget, each decode row's guesses) →
**apply** (the table's moves, the leavers ended, each rollback by the owner) → **run** (a first
token from logits a cache kept is chosen; then the runner's one model step: the next token of
every decoding row, its guesses and the prompt pieces, each row on its own cache in place, as
llama.cpp's slots; the owner notes what every row fed) → **sample** (each decode row's tokens by
its own sampler; rows that ended leave). Then the owner settles (frees closed sessions, keeps
the budget). A text prepared while the person types is the plan's lowest priority: a piece of it
runs only in a step no reply wants.

Prefill is always chunked, so nobody waits on another's whole prompt. While rows decode, a step
carries at most `prefill_chunk` prompt tokens (what a long pasted prompt delays the running
replies by, per step); while none decodes, `prefill_chunk_alone` (larger: a chunk reads the
weights and the whole history again, so small ones would slow a lone long prompt down, while a
newcomer still waits at most one such chunk). The budget goes to the request with the shortest
remaining prefill first, so a one-line message sent just after a 4,000-token one is answered
after a chunk, not after the long prompt; a request owed a whole budget (its fair share of past
steps, less what it got: chat/scheduling/prompt_fairness.py) goes before them, so a stream of short messages
cannot starve a long one. The
scheduler decides; the cache owner (cache_sessions/owner.py) applies every change to the
sessions. A request joins the decode rows once only its last prompt token is left to feed, or
once the rest of its prompt goes with that token in one step (where its cache keeps nothing at
the generation start: its first token then comes from the step that fed its prompt's end), or
at once where its cache holds the whole prompt and the logits after it (a Retry, a prepared
Send: its first token is chosen from those before the step, `CacheSession.next_logits`), and
leaves at an end token, its token limit, a stop, or an error: its own (a raising logits
processor) ends it alone, a failed forward ends every row of that step.
"""
from __future__ import annotations

import atexit
import os
import threading
import time
import weakref
from contextlib import contextmanager
from typing import Any, Callable, Hashable, Iterator, Sequence, TypeVar

import torch
from transformers import PreTrainedModel

from chat.model_step.compiled import CompiledDecode
from cache_sessions.kv_cache import KVCacheKind
from cache_sessions.owner import CacheOwner
from cache_sessions.session import CacheSession
from chat.config import DEFAULT_MAX_BATCH_SIZE, DEFAULT_PREFILL_CHUNK, DEFAULT_PREFILL_CHUNK_ALONE
from chat.scheduling.drafting import DraftPolicy
from chat.scheduling.guessing import StepGuesses
from chat.scheduling.loop import Loop
from chat.dialogue.options import GenerationOptions
from chat.scheduling.requests import CacheWork, GenerationRequest
from chat.model_step.runner import ModelRunner, Row
from chat.scheduling.step_budget import DEFAULT_ALONE_STEP_S, DEFAULT_GAP_FACTOR, StepBudget
from chat.scheduling.step_plan import SchedulerStats, StepPlan
from chat.scheduling.step_sampling import StepSampler
from chat.scheduling.step_planner import StepPlanner
from chat.scheduling.worker import ModelWorker

T = TypeVar("T")


class DecodeScheduler:
    def __init__(self, model: PreTrainedModel, worker: ModelWorker, *, max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK, prefill_chunk_alone: int = DEFAULT_PREFILL_CHUNK_ALONE,
                 prefill_order: str = "shortest", compiled: CompiledDecode | None = None,
                 kv_cache: KVCacheKind = KVCacheKind(),
                 step_gap_factor: float | None = DEFAULT_GAP_FACTOR, alone_step_s: float | None = DEFAULT_ALONE_STEP_S,
                 draft: str = "auto", **cache_settings: Any):
        """`prefill_order`: "shortest" (remaining prefill first, see above) or "arrival" (oldest
        first, measured against it in benchmarks/fairness.py). `compiled`: the graphs the runner
        takes a step of decode rows alone to, once built (chat/model_step/compiled.py). `kv_cache`:
        the kind of cache every session's states live in (the owner's, and the runner's probe). `step_gap_factor`:
        while rows decode, a step's prompt tokens are at most `prefill_chunk` and as many as keep
        it within that many decode steps, measured (chat/scheduling/step_budget.py; None: `prefill_chunk`
        always); `alone_step_s`: the same while none decodes, in seconds a step (None:
        `prefill_chunk_alone` always). `draft`: "auto", "ngram" or "off": how decode rows feed
        guessed tokens to verify (chat/scheduling/drafting.py). `cache_settings`:
        the cache owner's (budget_bytes, max_checkpoints, prefix_store, offload)."""
        self.model, self.worker, self.max_batch_size = model, worker, max_batch_size
        self.loop = Loop(worker, self._step, self._has_work, lambda: self.caches.settle())
        self.caches = CacheOwner(model, self.loop, self.in_use, kv_cache=kv_cache, **cache_settings)
        self.runner = ModelRunner(model, compiled, kv_cache)
        worker.run(self.runner.probe_plain)
        self.guessing = DraftPolicy(draft, refusal=self.runner.guess_refusal)
        self.guesses = StepGuesses(self.guessing, self.caches)
        self.step_budget, self.clock = StepBudget(step_gap_factor, alone_step_s), time.perf_counter
        self.planner = StepPlanner(model, self.caches, self.guesses, self.step_budget, max_batch_size=max_batch_size,
                                   prefill_chunk=prefill_chunk, prefill_chunk_alone=prefill_chunk_alone,
                                   prefill_order=prefill_order, last_piece_rows=self.runner.rows_apart)
        self.sampler = StepSampler(self.caches, self.guesses, self.planner)
        self._reset()
        os.register_at_fork(after_in_child=self._reset)  # a ZeroGPU worker starts with no batch
        atexit.register(_shut_down_at_exit, weakref.ref(self))  # before the worker's: atexit runs last first

    def _reset(self) -> None:
        self.planner.reset()
        self._on_disk: frozenset[GenerationRequest] = frozenset()  # the last plan's: woken when read
        self.loop.reset()
        self.caches.reset()

    # ---- any thread -----------------------------------------------------------------------------
    def submit(self, session: CacheSession, prompt_ids: Sequence[int], options: GenerationOptions,
               stop: threading.Event, work: CacheWork = CacheWork(), client: Hashable | None = None
               ) -> GenerationRequest:
        """Queue a reply; the cache is rolled back and prefilled on the compute thread, in turn
        (`client`: who asked, see `GenerationRequest`)."""
        request = GenerationRequest(session, prompt_ids, options, stop, work, client)
        self.guesses.attach(request)
        return self._queue(request, self.planner.requests.waiting)

    def prepare(self, session: CacheSession, prompt_ids: Sequence[int], stop: threading.Event,
                work: CacheWork = CacheWork(), client: Hashable | None = None) -> GenerationRequest:
        """Prefill `prompt_ids` into `session` ahead of its Send, at idle priority: only in steps
        with no reply to work on, a small piece a step, its progress kept when a reply comes
        first. It ends once prefilled, or at the first step after `stop` (a newer text, the Send,
        a close): what it fed stays, and the Send's rollback keeps what it shares."""
        request = GenerationRequest(session, prompt_ids, GenerationOptions(max_new_tokens=1), stop, work, client,
                                    ahead=True)
        return self._queue(request, self.planner.requests.ahead, newest_only=True)

    def _queue(self, request: GenerationRequest, queue: list[GenerationRequest],
               newest_only: bool = False) -> GenerationRequest:
        """Into `queue` of the table (`RequestTable.append`), checked, and the loop woken."""
        if self.loop.on_loop():  # it would wait for tokens from a job queued behind itself
            raise RuntimeError("submit a reply or a text to prepare from outside the engine's compute thread")
        if not request.prompt_ids:
            raise ValueError("cannot generate from or prepare an empty prompt")
        self.planner.requests.append(request, queue, newest_only)
        self.loop.wake()
        return request

    @contextmanager
    def made_elsewhere(self, session: CacheSession) -> Iterator[None]:
        """A reply of `session` is being made in another process (a ZeroGPU worker, from a copy
        of its states): in use until it comes back, so the budget leaves it as it was sent. The
        worker holds its copy so too, until it has been sent back."""
        try:
            with self.planner.requests.held_elsewhere(session):
                yield
        finally:
            self.loop.post(self.caches.settle)  # a close, or the budget, may have waited for it

    def shut_down(self, timeout: float = 30.0) -> None:
        """Stop every request and wait until each has left (its stream ends, its cache is checked
        and rested): at exit, before the compute thread ends, so no reader waits for ever."""
        requests = self.planner.requests.everyone()
        for request in requests:
            request.stop.set()
        self.loop.wake()
        deadline = time.monotonic() + timeout  # one bound for all of them: exit never waits longer
        for request in requests:
            request._done.wait(max(0.0, deadline - time.monotonic()))

    def in_use(self) -> set[CacheSession]:
        """The one record of what is in use (chat/scheduling/request_table.py)."""
        return self.planner.requests.in_use()

    def call(self, function: Callable[..., T], *args: Any) -> T:
        """Run `function(*args)` on the loop, between steps, and wait for it."""
        return self.loop.call(function, *args)

    def stats(self) -> SchedulerStats:
        return self.planner.stats(packed=self.runner.packs)

    # ---- one step, on the compute thread ------------------------------------------------------
    def _has_work(self) -> bool:
        """Whether another step is due: not while the only requests left wait for the disk (the
        read wakes the loop when it is done)."""
        return self.planner.requests.has_work(besides=self._on_disk)

    @torch.no_grad()
    def _step(self) -> None:
        """Plan → apply → run → sample (see the module's docstring)."""
        try:
            graph_steps = self.runner.graph_steps
            plan = self.planner.plan(self.clock, self.runner.graph_ready)
            self._on_disk = plan.on_disk
            plan = self.sampler.first_tokens_kept(self.planner.apply(plan))
            rows = plan.rows()
            extra = sum(len(fed) for _, fed in rows) - len(plan.decoding)  # past one token a decode row
            logits = self._run(plan, rows, extra)
            if logits is not None:
                self.sampler.sample(plan, logits)
                # the whole step, proposing, choosing and giving back included: what a guess really costs
                self.guessing.record_step(self.clock() - plan.started, len(plan.decoding), extra,
                                          compiled=self.runner.graph_steps > graph_steps)
        except BaseException as error:  # a fault of the scheduler itself: end everyone, hang no one
            for request in self.planner.requests.take_everyone():
                self.planner.stages.finish(request, error)

    def _run(self, plan: StepPlan, rows: list[Row], extra: int) -> torch.Tensor | None:
        """The plan's one model step (its `rows`, with `extra` tokens past one a decode row); the
        owner notes what every row fed. Returns the logits after every token of the decode rows
        (None: no decode row, or the step failed and every row of it ended: each row's states may
        hold part of it)."""
        if not rows:
            return None
        started = self.clock()
        text = plan.ahead if plan.ahead_runs() else None
        try:
            logits = self.runner.run(rows, *plan.logits_wanted(), eager=plan.eager)
            self.caches.fed(rows)
        except BaseException as error:
            everyone = [*plan.decoding, *(piece.request for piece in plan.pieces), *([text.request] if text else [])]
            self.planner.stages.leave(everyone, error)
            return None
        self.step_budget.record(self.clock() - started, len(plan.decoding), extra)
        for piece in plan.pieces:
            self.planner.stages.piece_fed(piece.request)
        if text is not None:
            self.planner.stages.text_fed(text, logits)
        return logits if plan.decoding else None

def _shut_down_at_exit(scheduler: "weakref.ref[DecodeScheduler]") -> None:
    if (alive := scheduler()) is not None:
        alive.shut_down()
