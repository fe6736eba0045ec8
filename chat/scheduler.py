"""Continuous batching on the compute thread: every reply being generated decodes in one
batched forward per step.

One step: end requests stopped while they waited; admit waiting requests while rows are free;
roll back newcomers and prefill them within a budget of `prefill_chunk` tokens (so a long pasted
prompt delays the running replies by one chunk a step, not by its whole prefill); then one
decode forward for every row. A request joins the batch once only its last prompt token is left
to feed, and leaves at an end token, its token limit, a stop, or an error: its own (a raising
logits processor) ends it alone, a failed forward ends every row of that step. A step re-submits itself, so the
engine's other compute jobs (a version switch, a new conversation) run between steps.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch
from transformers import PreTrainedModel

from cache_sessions.batch import BatchedCache, SingleRow, decode_batch
from cache_sessions.prefixes import PrefixStore
from cache_sessions.session import CacheSession, PrefillResult
from chat.config import DEFAULT_MAX_BATCH_SIZE, DEFAULT_PREFILL_CHUNK
from chat.options import GenerationOptions
from chat.sampling import TokenChooser
from chat.worker import ModelWorker

_END = object()


class GenerationRequest:
    """One reply being made: submitted by a turn, served by the scheduler. Iterate `tokens()`,
    then call `finish()`, which stops it first if it still runs."""

    def __init__(self, session: CacheSession, prompt_ids: Sequence[int], options: GenerationOptions,
                 stop: threading.Event, prefix_store: PrefixStore | None, shared_prefix_length: int,
                 before: Callable[[], None] | None):
        self.session, self.options, self.stop, self.before = session, options, stop, before
        self.prompt_ids = list(prompt_ids)
        self.prefix_store, self.shared_prefix_length = prefix_store, shared_prefix_length
        self.sequence = list(prompt_ids)  # prompt, then each token as it is chosen
        self.prefill: PrefillResult | None = None  # set once it was admitted and rolled back
        self.chooser: TokenChooser | None = None
        self.error: BaseException | None = None
        self.submitted_at = time.perf_counter()
        self.started_at: float | None = None  # its rollback and prefill began (it waited until then)
        self.joined_at: float | None = None  # its first decode step
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.token_count = 0
        self._tokens: queue.SimpleQueue = queue.SimpleQueue()
        self._done = threading.Event()

    @property
    def started(self) -> bool:
        """Whether it was admitted (its cache rolled back); one stopped while waiting was not."""
        return self.prefill is not None

    @property
    def next_input(self) -> int:
        return self.sequence[-1]

    def tokens(self) -> Iterator[int]:
        while (item := self._tokens.get()) is not _END:
            yield item

    def finish(self) -> list[int]:
        """Stop it if it still runs, wait until it left the batch, and return the sequence."""
        if not self._done.is_set():
            self.stop.set()
            self._done.wait()
        if self.error is not None:
            raise self.error
        return self.sequence

    # ---- called by the scheduler, on the compute thread --------------------------------------
    def _emit(self, token_id: int) -> None:
        now = time.perf_counter()
        self.first_token_at = self.first_token_at or now
        self.last_token_at = now
        self.token_count += 1
        self.sequence.append(token_id)
        self._tokens.put(token_id)

    def _end(self, error: BaseException | None = None) -> None:
        self.error = self.error or error
        self._tokens.put(_END)
        self._done.set()


@dataclass(frozen=True)
class SchedulerStats:
    max_batch_size: int
    decoding: int  # rows in the running batch
    prefilling: int  # admitted, prefilling in chunks
    waiting: int  # waiting for a free row
    steps: int  # decode steps run so far
    batch_bytes: int  # the batched copy of the decoding caches, on top of their own
    joined: int  # requests that reached the batch so far
    largest_batch: int  # the most rows one decode step has run
    join_wait_mean_s: float  # from submit to the first decode step, over the last 32
    join_wait_max_s: float


class DecodeScheduler:
    def __init__(self, model: PreTrainedModel, worker: ModelWorker, *, max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK):
        if max_batch_size < 1 or prefill_chunk < 1:
            raise ValueError("max_batch_size and prefill_chunk must be at least 1")
        self.model, self.worker = model, worker
        self.max_batch_size, self.prefill_chunk = max_batch_size, prefill_chunk
        self._reset()
        os.register_at_fork(after_in_child=self._reset)  # a ZeroGPU worker starts with no batch

    def _reset(self) -> None:
        self._lock = threading.Lock()
        self._waiting: deque[GenerationRequest] = deque()
        self._prefilling: list[GenerationRequest] = []
        self._decoding: list[GenerationRequest] = []
        self._batch: BatchedCache | SingleRow | None = None
        self._scheduled = False
        self._steps = 0
        self._joined = 0
        self._largest_batch = 0
        self._batch_bytes = 0
        self._join_waits: deque[float] = deque(maxlen=32)

    def submit(self, session: CacheSession, prompt_ids: Sequence[int], options: GenerationOptions,
               stop: threading.Event, *, prefix_store: PrefixStore | None = None, shared_prefix_length: int = 0,
               before: Callable[[], None] | None = None) -> GenerationRequest:
        """Queue a reply; the cache is rolled back and prefilled on the compute thread, in turn.
        `before` runs there first, when the request is admitted (its owner's own cache work)."""
        if self.worker.on_compute_thread():  # it would wait for tokens from a job queued behind itself
            raise RuntimeError("stream a reply from outside the engine's compute thread")
        if not prompt_ids:
            raise ValueError("cannot generate from an empty prompt")
        request = GenerationRequest(session, prompt_ids, options, stop, prefix_store, shared_prefix_length, before)
        with self._lock:
            self._waiting.append(request)
            if not self._scheduled:
                self._scheduled = True
                self.worker.submit(self._step)
        return request

    def stats(self) -> SchedulerStats:
        with self._lock:
            waits = list(self._join_waits)
            return SchedulerStats(
                max_batch_size=self.max_batch_size, decoding=len(self._decoding), prefilling=len(self._prefilling),
                waiting=len(self._waiting), steps=self._steps, batch_bytes=self._batch_bytes, joined=self._joined,
                largest_batch=self._largest_batch,
                join_wait_mean_s=sum(waits) / len(waits) if waits else 0.0, join_wait_max_s=max(waits, default=0.0))

    def batch_bytes(self) -> int:
        """Bytes the batched copy holds now (the session manager counts them in its budget)."""
        return self._batch_bytes

    # ---- one step, on the compute thread ------------------------------------------------------
    @torch.no_grad()
    def _step(self) -> None:
        try:
            self._admit()
            self._prefill_chunks()
            self._decode_once()
        except BaseException as error:  # a fault of the scheduler itself: end everyone, hang no one
            for request in self._drop_everyone():
                request._end(error)
        finally:
            with self._lock:
                self._scheduled = bool(self._waiting or self._prefilling or self._decoding)
                if self._scheduled:
                    self.worker.submit(self._step)

    def _admit(self) -> None:
        with self._lock:
            for request in [r for r in self._waiting if r.stop.is_set()]:
                self._waiting.remove(request)
                request._end()  # stopped before it started: its cache was not touched
            while self._waiting and len(self._prefilling) + len(self._decoding) < self.max_batch_size:
                self._prefilling.append(self._waiting.popleft())

    def _prefill_chunks(self) -> None:
        """Roll newcomers back and prefill them, oldest first, `prefill_chunk` tokens in all per
        step while rows decode; all of it when none does (chunks would only slow them down)."""
        budget = self.prefill_chunk if self._decoding else None
        for request in list(self._prefilling):
            if budget == 0:
                return
            held = len(request.session.token_ids)
            try:
                if request.prefill is None:
                    request.started_at = time.perf_counter()
                    if request.before is not None:
                        request.before()
                    request.chooser = TokenChooser(self.model, request.options, len(request.prompt_ids))
                    request.prefill = request.session.prepare(
                        request.prompt_ids, prefix_store=request.prefix_store,
                        shared_prefix_length=request.shared_prefix_length, prefill=False)
                    held = len(request.session.token_ids)
                ready = request.stop.is_set() or request.session.prefill(
                    request.prompt_ids, budget=budget, prefix_store=request.prefix_store,
                    shared_prefix_length=request.shared_prefix_length)
            except BaseException as error:
                self._leave_prefill(request, error)
                continue
            if budget is not None:
                budget = max(0, budget - (len(request.session.token_ids) - held))
            if request.stop.is_set():
                self._leave_prefill(request)
            elif ready:
                with self._lock:
                    self._prefilling.remove(request)
                    self._decoding.append(request)

    def _decode_once(self) -> None:
        for request in [r for r in self._decoding if r.stop.is_set()]:
            self._leave([request])  # its last chosen token stays unfed, as after `generate`
        rows = list(self._decoding)
        if not rows:
            return
        now = time.perf_counter()
        for request in rows:
            if request.joined_at is None:
                request.joined_at = now
                self._joined += 1
                self._join_waits.append(now - request.submitted_at)
        inputs = [request.next_input for request in rows]
        try:
            batch = self._batch_for(rows)
            logits = self.model(**batch.inputs(inputs), logits_to_keep=1).logits[:, -1]
        except BaseException as error:  # the batched states are unusable (turns release the sessions)
            self._batch = None
            self._leave(rows, error, scatter=False)
            return
        batch.fed(inputs)
        self._steps += 1
        self._largest_batch = max(self._largest_batch, len(rows))
        self._batch_bytes = batch.nbytes()
        ended: list[GenerationRequest] = []
        for row, request in enumerate(rows):
            assert request.chooser is not None
            try:
                token = request.chooser.choose(request.sequence, logits[row : row + 1])
            except BaseException as error:  # this row's own fault: the others go on
                request.error = error
                ended.append(request)
                continue
            request._emit(token)
            if request.chooser.ends(token, request.token_count) or request.stop.is_set():
                ended.append(request)
        if ended:
            self._leave(ended)

    def _batch_for(self, rows: list[GenerationRequest]) -> BatchedCache | SingleRow:
        sessions = [request.session for request in rows]
        if self._batch is None or self._batch.sessions != sessions:
            if self._batch is not None:
                self._batch.scatter()
            self._batch = decode_batch(self.model, sessions)
        return self._batch

    def _leave(self, requests: list[GenerationRequest], error: BaseException | None = None,
               scatter: bool = True) -> None:
        """Take `requests` out of the batch: every row's states go back to its session first."""
        if scatter and self._batch is not None:
            self._batch.scatter()
        self._batch = None  # the next step builds one for the rows left
        self._batch_bytes = 0
        with self._lock:
            for request in requests:
                self._decoding.remove(request)
        for request in requests:
            request._end(error)

    def _leave_prefill(self, request: GenerationRequest, error: BaseException | None = None) -> None:
        with self._lock:
            self._prefilling.remove(request)
        request._end(error)

    def _drop_everyone(self) -> list[GenerationRequest]:
        with self._lock:
            everyone = list(self._waiting) + self._prefilling + self._decoding
            self._waiting.clear()
            self._prefilling, self._decoding = [], []
            self._batch, self._batch_bytes = None, 0
        return everyone
