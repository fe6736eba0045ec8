"""What one step runs, decided before it runs, as plain data (vLLM v1's scheduler, at this
scale): `StepPlanner.plan` reads the table of requests and the caches and returns a `StepPlan`
(chat/scheduling/step_plan.py); making it changes nothing. `StepPlanner.apply` carries it out (the request
stages, chat/scheduling/request_stages.py, over the cache owner).

Each step: requests stopped wherever they wait leave (waiting, prefilling, decoding, a text being
prepared: a Stop is read before any budget); waiting requests are admitted while rows are free (a
client below its share of the rows takes one from the client holding the most:
chat/scheduling/request_table.py); this step's prompt budget goes in pieces, fair by tokens owed
(chat/scheduling/prompt_fairness.py), shortest remaining prefill first, each newcomer's piece read from where
its rollback will land (`CacheSession.landing`); each decode row's guesses are asked. A text
prepared while the person types is a prompt piece of the lowest priority: it runs only in a step
no reply wants, one piece of at most `prefill_chunk` tokens, so a reply arriving waits at most
that piece.
"""
from __future__ import annotations

from typing import Callable

from transformers import PreTrainedModel

from cache_sessions.owner import CacheOwner
from chat.scheduling.guessing import StepGuesses
from chat.scheduling.prompt_fairness import PromptFairness
from chat.scheduling.prompt_pieces import PromptPieces
from chat.scheduling.request_stages import RequestStages
from chat.scheduling.request_table import RequestTable
from chat.scheduling.requests import GenerationRequest
from chat.scheduling.step_budget import StepBudget
from chat.scheduling.step_plan import Counters, Piece, SchedulerStats, StepPlan


class StepPlanner:
    """The table of requests and the decisions of every step over it; the cache owner applies
    what it decides to the sessions (rollback, pieces, the end of a request)."""

    def __init__(self, model: PreTrainedModel, caches: CacheOwner, guesses: StepGuesses, step_budget: StepBudget, *,
                 max_batch_size: int, prefill_chunk: int, prefill_chunk_alone: int, prefill_order: str,
                 last_piece_rows: int | None = None):
        """The prompt settings are `PromptPieces`' (checked as `reset` makes it)."""
        if max_batch_size < 1 or prefill_chunk < 1 or prefill_chunk_alone < 1:
            raise ValueError("max_batch_size, prefill_chunk and prefill_chunk_alone must be at least 1")
        self.model, self.caches, self.guesses, self.step_budget = model, caches, guesses, step_budget
        self.max_batch_size, self.prefill_chunk = max_batch_size, prefill_chunk
        self._pieces = dict(prefill_chunk=prefill_chunk, prefill_chunk_alone=prefill_chunk_alone,
                            prefill_order=prefill_order, last_piece_rows=last_piece_rows)
        # (False: every row in every step; a message cut to the budget: a benchmark's other arm)
        self.newcomers_apart = self.whole_messages = True
        self.reset()

    def reset(self) -> None:
        self.requests, self.counters = RequestTable(), Counters()
        self.stages = RequestStages(self.model, self.caches, self.guesses, self.requests, self.counters)
        self.shares = PromptFairness()  # prompt tokens owed to each client with a request waiting to prefill
        self.pieces = PromptPieces(self.caches, self.step_budget, self.shares, **self._pieces)
        self._rows_waited = False  # the last step ran newcomers apart: this one runs every row

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

    # ---- the plan: reads, changes nothing ------------------------------------------------------
    def plan(self, clock: Callable[[], float], graph_ready: Callable[[int], bool]) -> StepPlan:
        """This step (see the module's docstring). `clock`: when its own work begins; `graph_ready`:
        whether a compiled graph would take a step of that many decode rows."""
        admission = self.requests.admission(self.max_batch_size)
        everyone = self.requests.everyone()  # read after it: a request come meanwhile waits a step
        texts = [request for request in everyone if request.ahead]
        replies = {request.session for request in everyone if not request.ahead}
        leaving: list[tuple[GenerationRequest, BaseException | None]] = [
            (text, None) for text in texts if text.stop.is_set() or text.session in replies]
        if not replies:  # no reply to work on: a piece of a text prepared ahead
            ahead, on_disk, failed = self.pieces.for_text([text for text in texts if (text, None) not in leaving])
            return StepPlan(admission, tuple(leaving + failed), ahead=ahead, on_disk=on_disk, started=clock())
        decoding = [request for request in admission.decoding if not request.stop.is_set()]
        leaving += [(request, None) for request in admission.decoding if request.stop.is_set()]
        prefill, on_disk, failed, owed = self.pieces.for_replies(admission.prefilling, len(decoding), self.whole_messages)
        decoding += [piece.request for piece in prefill if piece.ends_prompt]
        rows, apart = self._rows_this_step(decoding, prefill)
        started = clock()
        joining = {piece.request: piece for piece in prefill if piece.ends_prompt}
        inputs = [len(request.unfed) if request not in joining else
                  None if joining[request].held_whole else len(joining[request].fed()) for request in rows]
        guesses, eager = self.guesses.propose(rows, inputs, graph_ready(len(rows)))
        return StepPlan(admission, tuple(leaving + failed), tuple(prefill), tuple(rows),
                        tuple(tuple(guess) for guess in guesses), None, on_disk, apart, eager, owed, started)

    def _rows_this_step(self, decoding: list[GenerationRequest], prefill: list[Piece]
                        ) -> tuple[list[GenerationRequest], bool]:
        """The decode rows this step runs, and whether apart: all of them, or only newcomers
        whose prompt ends in it (their first tokens from it) where a step of those and this
        step's prompt rows keeps the other rows' gap within the step budget's bound
        (`StepBudget.apart_tokens`), never twice in a row: beside many rows, the step of a
        newcomer's prompt end would otherwise carry every row."""
        newcomers = [piece for piece in prefill if piece.ends_prompt and piece.tokens]
        others = len(decoding) - len(newcomers)
        tokens = sum(len(piece.tokens) + (1 if piece.ends_prompt else 0) for piece in prefill)
        apart = (self.newcomers_apart and not self._rows_waited and bool(newcomers) and others > 0
                 and tokens <= self.step_budget.apart_tokens(others))
        return ([piece.request for piece in newcomers] if apart else decoding), apart

    # ---- applying it ---------------------------------------------------------------------------
    def apply(self, plan: StepPlan) -> StepPlan:
        """Carry `plan` out (`RequestStages.apply`) and keep the planner's own books (what each
        client is owed, whether newcomers ran apart). Returns the plan that runs: without the
        requests that ended meanwhile."""
        running = self.stages.apply(plan)
        if plan.owed is not None:
            self.shares.retain([request.flow for request in plan.admission.prefilling])
            self.shares.settle(plan.owed.wanting, dict(plan.owed.given), plan.owed.budget)
        self._rows_waited = plan.apart
        with self.requests.lock:
            self.counters.newcomers_apart += plan.apart
        return running
