"""What one step runs, decided before it runs, as plain data (vLLM v1's scheduler, at this
scale): `StepPlanner.plan` reads the table of requests and the caches and returns a `StepPlan`
(chat/step_plan.py); making it changes nothing. `StepPlanner.apply` carries it out (the request
stages, chat/request_stages.py, over the cache owner).

Each step: requests stopped wherever they wait leave (waiting, prefilling, decoding, a text being
prepared: a Stop is read before any budget); waiting requests are admitted while rows are free (a
client below its share of the rows takes one from the client holding the most:
chat/request_table.py); this step's prompt budget goes in pieces, fair by tokens owed
(chat/prompt_fairness.py), shortest remaining prefill first, each newcomer's piece read from where
its rollback will land (`CacheSession.landing`); each decode row's guesses are asked. A text
prepared while the person types is a prompt piece of the lowest priority: it runs only in a step
no reply wants, one piece of at most `prefill_chunk` tokens, so a reply arriving waits at most
that piece.
"""
from __future__ import annotations

from typing import Callable, Hashable, Sequence

from transformers import PreTrainedModel

from cache_sessions.owner import CacheOwner
from cache_sessions.session import Landing, common_prefix_length
from chat.guessing import StepGuesses
from chat.prompt_fairness import PromptFairness
from chat.request_stages import RequestStages
from chat.request_table import RequestTable
from chat.requests import GenerationRequest
from chat.step_budget import StepBudget
from chat.step_plan import Counters, Owed, Piece, SchedulerStats, StepPlan

PREFILL_ORDERS = ("shortest", "arrival")


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
        self.stages = RequestStages(self.model, self.caches, self.guesses, self.requests)  # applies plans
        self.shares = PromptFairness()  # prompt tokens owed to each client with a request waiting to prefill
        self._rows_waited = False  # the last step ran newcomers apart: this one runs every row
        self.counters = Counters()

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
            ahead, on_disk, failed = self._ahead([text for text in texts if (text, None) not in leaving])
            return StepPlan(admission, tuple(leaving + failed), ahead=ahead, on_disk=on_disk, started=clock())
        decoding = [request for request in admission.decoding if not request.stop.is_set()]
        leaving += [(request, None) for request in admission.decoding if request.stop.is_set()]
        prefill, on_disk, failed, owed = self._prefill(admission.prefilling, len(decoding))
        decoding += [piece.request for piece in prefill if piece.ends_prompt]
        rows, apart = self._rows_this_step(decoding, prefill)
        started = clock()
        joining = {piece.request: piece for piece in prefill if piece.ends_prompt}
        inputs = [len(request.unfed) if request not in joining else
                  None if joining[request].held_whole else len(joining[request].fed()) for request in rows]
        guesses, eager = self.guesses.propose(rows, inputs, graph_ready(len(rows)))
        return StepPlan(admission, tuple(leaving + failed), tuple(prefill), tuple(rows),
                        tuple(tuple(guess) for guess in guesses), None, on_disk, apart, eager, owed, started)

    def _prefill(self, prefilling: Sequence[GenerationRequest], decode_rows: int
                 ) -> tuple[list[Piece], frozenset[GenerationRequest], list[tuple[GenerationRequest, BaseException | None]], Owed]:
        """This step's prompt pieces within its budget, in the order `PromptFairness` gives (fair
        by tokens owed), each from where its cache will stand. One with only its last token left
        decodes from this step, as does one whose last piece can go with that token in its first
        decode row (its cache keeps nothing at the generation start:
        `CacheSession.feeds_with_first_step`) or one whose cache holds its whole prompt and the
        logits after it. Returns the pieces, those whose states are still being read, those that
        leave (stopped, whether or not the budget would have reached them, or failed), and what
        the budget owes."""
        budget = (self.step_budget.tokens(self.prefill_chunk, decode_rows) if decode_rows
                  else self.step_budget.alone_tokens(self.prefill_chunk_alone))
        full_budget, pieces, on_disk, leaving = budget, [], set(), []
        wanting: list[Hashable] = []  # the flows (clients) with prompt left that could go on
        given: dict[Hashable, int] = {}
        for request in self._prefill_order(prefilling, budget):
            if request.prefill is None and not self.caches.ready(request.session):
                # its states are being read beside the loop: the others go on (a stopped one too:
                # ending it now would wait for that read on the loop; it ends once the read is in)
                on_disk.add(request)
                continue
            if request.stop.is_set():
                leaving.append((request, None))
                continue
            wanting.append(request.flow)
            allowed = self._whole_or(request, budget, sum(given.values()), decode_rows)
            if allowed == 0:
                continue
            try:
                piece = self._piece(request, allowed, for_reply=True)
            except BaseException as error:
                leaving.append((request, error))
                continue
            budget = max(0, budget - len(piece.tokens))
            given[request.flow] = given.get(request.flow, 0) + len(piece.tokens)
            pieces.append(piece)
        return pieces, frozenset(on_disk), leaving, Owed(tuple(wanting), tuple(given.items()), full_budget)

    def _ahead(self, texts: list[GenerationRequest]
               ) -> tuple[Piece | None, frozenset[GenerationRequest], list[tuple[GenerationRequest, BaseException]]]:
        """The oldest text whose states are at hand, and its next piece (with no tokens and not
        ending its prompt: it was fed to its end and ends); its last piece takes the prompt's last
        token where the cache crops anywhere (as a reply's does), and the logits after it are
        kept: the Send then chooses its first token from them with no step."""
        on_disk = set()
        for text in texts:
            if text.prefill is None and not self.caches.ready(text.session):
                on_disk.add(text)  # read beside the loop; the loop is woken when it is in
                continue
            try:
                return self._piece(text, self.prefill_chunk, for_reply=False), frozenset(on_disk), []
            except BaseException as error:
                return None, frozenset(on_disk), [(text, error)]
        return None, frozenset(on_disk), []

    def _piece(self, request: GenerationRequest, allowed: int, for_reply: bool) -> Piece:
        """`request`'s next piece of at most `allowed` tokens, from where its cache stands (or will,
        once rolled back); whether it ends the prompt (`ends_prompt`; a reply with nothing left
        to feed ends it with no tokens)."""
        work, begins = request.work, request.prefill is None
        at = (self.caches.landing(request.session, request.prompt_ids, work.prefix_store) if begins
              else request.session.here())
        tokens = self.caches.prefill_piece(request.session, request.prompt_ids, allowed, work.prefix_store,
                                           work.shared_prefix_length, at)
        ends = self.ends_prompt(request, tokens, at) or (for_reply and not tokens)
        return Piece(request, at, tuple(tokens), ends, begins)

    def _whole_or(self, request: GenerationRequest, budget: int, carried: int, decode_rows: int) -> int:
        """This request's piece at most: `budget`, or its whole prompt where it has fed none of it
        yet and the whole fits one step beside the decode rows with the `carried` tokens this step
        already has (`StepBudget.whole_tokens`): split, a message pays a second step's fixed part
        and waits that step more for its first token."""
        if not self.whole_messages or request.prefill is not None or not decode_rows:
            return budget
        remaining = _remaining_prefill(request)
        room = self.step_budget.whole_tokens(self.prefill_chunk, decode_rows) - carried
        return remaining if budget < remaining <= room else budget

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

    def ends_prompt(self, request: GenerationRequest, piece: list[int], at: Landing) -> bool:
        """Whether `piece` (its next, from `at`) may take its prompt's last token with it, the
        logits after that read in the same step: it reaches the generation start where the cache
        keeps nothing (`CacheSession.feeds_with_first_step`), within `last_piece_rows`."""
        work = request.work
        fits = self.last_piece_rows is None or len(piece) + 1 <= self.last_piece_rows
        return fits and self.caches.feeds_with_first_step(request.session, request.prompt_ids, piece,
                                                          work.prefix_store, work.shared_prefix_length, at)

    def _prefill_order(self, prefilling: Sequence[GenerationRequest], budget: int) -> list[GenerationRequest]:
        """Fair by tokens owed, shortest remaining prefill first otherwise (chat/prompt_fairness.py);
        or in arrival order."""
        if self.prefill_order != "shortest":
            return list(prefilling)
        return self.shares.order({request: _remaining_prefill(request) for request in prefilling},
                                  {request: request.flow for request in prefilling}, budget)

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
            self.counters.prepared += plan.ahead is not None and not plan.ahead.fed() and plan.ahead.request.error is None
        return running


def _remaining_prefill(request: GenerationRequest) -> int:
    """Prompt tokens it still has to feed: past what its cache holds in common with the prompt
    (before its rollback, an estimate: a shared prefix or a checkpoint may serve more or less;
    after it, the ledger is a prefix of the prompt and only its length is read)."""
    held = len(request.session.token_ids) if request.started else common_prefix_length(
        request.session.token_ids, request.prompt_ids)
    return max(0, len(request.prompt_ids) - 1 - held)
