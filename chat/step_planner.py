"""What one step runs, decided before it runs (vLLM v1's scheduler, at this scale), and when
each request moves through the table: admitted, rolled back, prefilled in pieces, decoding,
ended (chat/request_stages.py carries those moves out over the cache owner).

chat/scheduler.py runs the loop around it (plan → run → sample); this decides. Each step: end
requests stopped wherever they wait (waiting, prefilling, decoding: a Stop is read before any
budget); admit waiting requests while rows are free (a client below its share of the rows takes
one from the client holding the most: chat/request_table.py); give this step's prompt budget in
pieces, fair by tokens owed (chat/prompt_fairness.py), shortest remaining prefill first; and ask
each decode row's guesses. Texts prepared while the person types wait in the same
table; chat/ahead.py runs them in steps no reply wants.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Hashable

from transformers import PreTrainedModel

from cache_sessions.owner import CacheOwner
from cache_sessions.session import common_prefix_length
from chat.guessing import StepGuesses
from chat.prompt_fairness import PromptFairness
from chat.request_table import RequestTable
from chat.requests import GenerationRequest
from chat.model_step.runner import Row
from chat.step_budget import StepBudget
from chat.request_stages import RequestStages

PREFILL_ORDERS = ("shortest", "arrival")


@dataclass
class StepPlan:
    """What one step runs, decided before it runs: the decode rows (each its inputs and its
    guesses to verify) and the prompt pieces, in the runner's row order (decode rows first)."""

    decoding: list[GenerationRequest]
    guesses: list[list[int]]
    pieces: list[tuple[GenerationRequest, list[int]]]
    started: float  # when the step's own work began (its guesses proposed): what a guess costs counts from here
    # each decode row's tokens before its guesses: its next input, after the tokens a step with
    # guesses took and gave back (recurrent states go back to the step's start: chat/guessing.py),
    # or, in its first step, after the rest of its prompt (`pieces`)
    inputs: list[list[int]]
    eager: bool = False  # run eagerly though a graph would take it: timed once for guesses (chat/drafting.py)

    def rows(self) -> list[Row]:
        return ([(request.session, fed + guess) for request, fed, guess in zip(self.decoding, self.inputs, self.guesses)]
                + [(request.session, piece) for request, piece in self.pieces])

    def tails(self) -> list[int]:
        """How many logits each decode row wants: after its last input and after each guess
        (not after inputs before its last: tokens fed again, or the rest of its prompt)."""
        return [len(guess) + 1 for guess in self.guesses]

    def extra_tokens(self) -> int:
        """Tokens past one a decode row: what the prompt pieces, the guesses and the tokens fed
        again add to the step."""
        return (sum(len(piece) for _, piece in self.pieces) + sum(len(guess) for guess in self.guesses)
                + sum(len(fed) - 1 for fed in self.inputs))


@dataclass(frozen=True)
class SchedulerStats:
    max_batch_size: int
    decoding: int  # rows in the running batch
    prefilling: int  # admitted, prefilling in chunks
    waiting: int  # waiting for a free row
    steps: int  # decode steps run so far
    joined: int  # requests that reached the batch so far
    largest_batch: int  # the most rows one decode step has run
    join_wait_mean_s: float  # from submit to the first decode step, over the last 32
    join_wait_max_s: float
    packed: bool = False  # steps run packed, one forward for every row (else row by row: chat/model_step/runner.py)
    prompt_tokens_per_step: int = 0  # the measured budget while rows decode (chat/step_budget.py)
    paused: int = 0  # decode rows given up for another client's share of the rows (chat/request_table.py)
    preparing: int = 0  # texts being prepared ahead of their Send (`prepare`)
    prepared: int = 0  # texts prepared to their end so far
    guessed: int = 0  # tokens guessed and verified in decode steps (chat/drafting.py)
    guesses_taken: int = 0  # of them, taken into replies
    first_tokens_kept: int = 0  # first tokens chosen from logits a cache kept, with no step (a Retry, a prepared Send)
    newcomers_apart: int = 0  # steps that ran newcomers' prompt ends without the other decode rows


class _Counters:
    """What the batch has done so far, for `stats` (read by other threads under the scheduler's lock)."""

    def __init__(self) -> None:
        self.steps = self.joined = self.largest_batch = self.prepared = self.guessed = self.guesses_taken = 0
        self.first_tokens_kept = self.newcomers_apart = 0
        self.join_waits: deque[float] = deque(maxlen=32)  # from submit to the first decode step

    def step(self, rows: list[GenerationRequest], guesses: list[list[int]], taken: int) -> None:
        """A step's decode rows were sampled: `taken` of their `guesses` went into replies."""
        self.guessed += sum(len(guess) for guess in guesses)
        self.guesses_taken += taken
        now = time.perf_counter()
        for request in rows:
            if request.joined_at is None:
                request.joined_at = now
                self.joined += 1
                self.join_waits.append(now - request.submitted_at)
        self.steps += 1
        self.largest_batch = max(self.largest_batch, len(rows))


class StepPlanner:
    """The table of requests and the decisions of every step over it; the cache owner applies
    what it decides to the sessions (rollback, pieces, the end of a request)."""

    def __init__(self, model: PreTrainedModel, caches: CacheOwner, guesses: StepGuesses, step_budget: StepBudget, *,
                 max_batch_size: int, prefill_chunk: int, prefill_chunk_alone: int, prefill_order: str,
                 last_piece_rows: int | None = None):
        """`last_piece_rows`: a prompt's last piece goes with its last token in the first decode
        row only within this many tokens (None: any), else a step before it. Where products keep
        rows apart up to that many (int8, chat/model_step/runner.py), the token then gets the bits a Retry's
        step of it alone gives: a greedy Retry is the reply it replaces (docs/performance.md)."""
        if max_batch_size < 1 or prefill_chunk < 1 or prefill_chunk_alone < 1:
            raise ValueError("max_batch_size, prefill_chunk and prefill_chunk_alone must be at least 1")
        if prefill_order not in PREFILL_ORDERS:
            raise ValueError(f"prefill_order must be one of {', '.join(PREFILL_ORDERS)}")
        self.model, self.caches, self.guesses, self.step_budget = model, caches, guesses, step_budget
        self.max_batch_size, self.prefill_chunk, self.prefill_chunk_alone = max_batch_size, prefill_chunk, prefill_chunk_alone
        self.prefill_order, self.last_piece_rows = prefill_order, last_piece_rows
        # (False: every row in every step; a message cut to the budget: as before, a benchmark's "before")
        self.newcomers_apart = self.whole_messages = True
        self.reset()

    def reset(self) -> None:
        self.requests = RequestTable()
        self.stages = RequestStages(self.model, self.caches, self.guesses, self.requests)  # starts and ends them
        self.shares = PromptFairness()  # prompt tokens owed to each client with a request waiting to prefill
        self.on_disk: set[GenerationRequest] = set()  # admitted, their states still being read
        self._rows_waited = False  # the last step ran newcomers apart: this one runs every row
        self.counters = _Counters()

    def stats(self, packed: bool) -> SchedulerStats:
        with self.requests.lock:
            counters, waits, requests = self.counters, list(self.counters.join_waits), self.requests
            return SchedulerStats(
                max_batch_size=self.max_batch_size, decoding=len(requests.decoding), prefilling=len(requests.prefilling),
                waiting=len(requests.waiting), paused=len(requests.paused), preparing=len(requests.ahead),
                prepared=counters.prepared, steps=counters.steps, guessed=counters.guessed,
                guesses_taken=counters.guesses_taken, first_tokens_kept=counters.first_tokens_kept,
                newcomers_apart=counters.newcomers_apart,
                joined=counters.joined, largest_batch=counters.largest_batch,
                join_wait_mean_s=sum(waits) / len(waits) if waits else 0.0, join_wait_max_s=max(waits, default=0.0),
                packed=packed,
                prompt_tokens_per_step=self.step_budget.tokens(self.prefill_chunk, len(requests.decoding)))

    def plan(self, clock: Callable[[], float], graph_ready: Callable[[int], bool]) -> StepPlan:
        """Who leaves (stopped wherever they wait), who is admitted, this step's prompt pieces
        and each decode row's guesses."""
        for request in self.requests.admit(self.max_batch_size):
            self.stages.finish(request)  # stopped while it waited (its cache untouched) or was paused
        stopped = [request for request in self.requests.decoding if request.stop.is_set()]
        if stopped:
            self.stages.leave(stopped)  # its last chosen token stays unfed, as after `generate`
        pieces = self.pieces()
        kept = self.stages.first_tokens_kept()
        if kept:
            with self.requests.lock:
                self.counters.first_tokens_kept += kept
        decoding, started = self._rows_this_step(pieces), clock()
        inputs = [request.unfed for request in decoding]
        guesses, eager = self.guesses.propose(decoding, graph_ready(len(decoding)))
        return StepPlan(decoding, guesses, pieces, started, inputs, eager)

    def pieces(self) -> list[tuple[GenerationRequest, list[int]]]:
        """This step's prefill pieces within its budget, in the order `PromptFairness` gives (fair
        by tokens owed, see chat/prompt_fairness.py); newcomers are rolled back first, and one with
        only its last token left starts decoding now, as does one whose last piece can go with
        that token in its first decode row (its cache keeps nothing at the generation start:
        `CacheSession.feeds_with_first_step`), so its first token comes from this step. A
        stopped request leaves here, whether or not the budget would have reached it (its turn at
        the budget could come after another user's whole prompt, and its Stop would do nothing
        meanwhile)."""
        if self.requests.decoding:
            budget = self.step_budget.tokens(self.prefill_chunk, len(self.requests.decoding))
        else:
            budget = self.step_budget.alone_tokens(self.prefill_chunk_alone)
        full_budget, pieces = budget, []
        wanting: list[Hashable] = []  # the flows (clients) with prompt left that could go on
        given: dict[Hashable, int] = {}
        self.on_disk = set()
        self.shares.retain([request.flow for request in self.requests.prefilling])
        for request in self._prefill_order(budget):
            if request.prefill is None and not self.caches.ready(request.session):
                # its states are being read beside the loop: the others go on (a stopped one too:
                # ending it now would wait for that read on the loop; it ends once the read is in)
                self.on_disk.add(request)
                continue
            if request.stop.is_set():
                self.stages.leave_prefill(request)
                continue
            wanting.append(request.flow)
            allowed = self._whole_or(request, budget, sum(given.values()))
            if allowed == 0:
                continue
            work = request.work
            try:
                self.stages.begin(request)
                piece = self.caches.prefill_piece(request.session, request.prompt_ids, allowed, work.prefix_store,
                                                  work.shared_prefix_length)
                # nothing left (held whole: its first token from the logits kept), or its last piece
                # with its first decode input: its first token this step, not the next
                decodes_now = not piece or self.ends_prompt(request, piece)
            except BaseException as error:
                self.stages.leave_prefill(request, error)
                continue
            if piece:
                budget = max(0, budget - len(piece))
                given[request.flow] = given.get(request.flow, 0) + len(piece)
            if decodes_now:
                self.requests.start_decoding(request)
            else:
                pieces.append((request, piece))
        self.shares.settle(wanting, given, full_budget)
        return pieces

    def _whole_or(self, request: GenerationRequest, budget: int, carried: int) -> int:
        """This request's piece at most: `budget`, or its whole prompt where it has fed none of it
        yet and the whole fits one step beside the decode rows with the `carried` tokens this step
        already has (`StepBudget.whole_tokens`): split, a message pays a second step's fixed part
        and waits that step more for its first token."""
        if not self.whole_messages or request.prefill is not None or not self.requests.decoding:
            return budget
        remaining = _remaining_prefill(request)
        room = self.step_budget.whole_tokens(self.prefill_chunk, len(self.requests.decoding)) - carried
        return remaining if budget < remaining <= room else budget

    def _rows_this_step(self, pieces: list[tuple[GenerationRequest, list[int]]]) -> list[GenerationRequest]:
        """The decode rows this step runs: all of them, or only newcomers whose prompt ends in
        it (their first tokens from it) where a step of those and this step's `pieces` keeps the
        other rows' gap within the step budget's bound (`StepBudget.apart_tokens`), never twice
        in a row. Beside seven rows, a newcomer's short message took 1.6-1.8x its first token on
        an idle engine: the step of its prompt's end carried every row (docs/performance.md)."""
        decoding = list(self.requests.decoding)
        newcomers = [request for request in decoding if request.token_count == 0 and len(request.unfed) > 1]
        others = len(decoding) - len(newcomers)
        tokens = sum(len(request.unfed) for request in newcomers) + sum(len(piece) for _, piece in pieces)
        apart = (self.newcomers_apart and not self._rows_waited and bool(newcomers) and others > 0
                 and tokens <= self.step_budget.apart_tokens(others))
        self._rows_waited = apart
        if not apart:
            return decoding
        with self.requests.lock:
            self.counters.newcomers_apart += 1
        return newcomers

    def ends_prompt(self, request: GenerationRequest, piece: list[int]) -> bool:
        """Whether `piece` (its next) may take its prompt's last token with it, the logits after
        that read in the same step: it reaches the generation start where the cache keeps nothing
        (`CacheSession.feeds_with_first_step`), within `last_piece_rows`."""
        work = request.work
        fits = self.last_piece_rows is None or len(piece) + 1 <= self.last_piece_rows
        return fits and self.caches.feeds_with_first_step(request.session, request.prompt_ids, piece,
                                                          work.prefix_store, work.shared_prefix_length)

    def _prefill_order(self, budget: int) -> list[GenerationRequest]:
        """Fair by tokens owed, shortest remaining prefill first otherwise (chat/prompt_fairness.py);
        or in arrival order."""
        if self.prefill_order != "shortest":
            return list(self.requests.prefilling)
        prefilling = self.requests.prefilling
        return self.shares.order({request: _remaining_prefill(request) for request in prefilling},
                                  {request: request.flow for request in prefilling}, budget)


def _remaining_prefill(request: GenerationRequest) -> int:
    """Prompt tokens it still has to feed: past what its cache holds in common with the prompt
    (before its rollback, an estimate: a shared prefix or a checkpoint may serve more or less;
    after it, the ledger is a prefix of the prompt and only its length is read)."""
    held = len(request.session.token_ids) if request.started else common_prefix_length(
        request.session.token_ids, request.prompt_ids)
    return max(0, len(request.prompt_ids) - 1 - held)
