"""Which prompt pieces a step carries, read from where each cache stands or will stand once
rolled back (`CacheSession.landing`): the replies' within the step's timed budget
(chat/scheduling/step_budget.py), in the order fairness gives (chat/scheduling/prompt_fairness.py), shortest remaining
prefill first; or, in a step no reply wants, one piece of a text prepared while typed. Reads
only: the planner (chat/scheduling/step_planner.py) puts what this finds into its plan.
"""
from __future__ import annotations

from typing import Hashable, Sequence

from cache_sessions.owner import CacheOwner
from cache_sessions.session import Landing, common_prefix_length
from chat.scheduling.prompt_fairness import PromptFairness
from chat.scheduling.requests import GenerationRequest
from chat.scheduling.step_budget import StepBudget
from chat.scheduling.step_plan import Owed, Piece

PREFILL_ORDERS = ("shortest", "arrival")
Leaving = list[tuple[GenerationRequest, BaseException | None]]


class PromptPieces:
    def __init__(self, caches: CacheOwner, budget: StepBudget, shares: PromptFairness, *, prefill_chunk: int,
                 prefill_chunk_alone: int, prefill_order: str, last_piece_rows: int | None):
        """`last_piece_rows`: a prompt's last piece goes with its last token in the first decode
        row only within this many tokens (None: any), else a step before it. Where products keep
        rows apart up to that many (int8, chat/model_step/runner.py), the token then gets the
        bits a Retry's step of it alone gives: a greedy Retry is the reply it replaces."""
        if prefill_order not in PREFILL_ORDERS:
            raise ValueError(f"prefill_order must be one of {', '.join(PREFILL_ORDERS)}")
        self.caches, self.budget, self.shares = caches, budget, shares
        self.prefill_chunk, self.prefill_chunk_alone = prefill_chunk, prefill_chunk_alone
        self.prefill_order, self.last_piece_rows = prefill_order, last_piece_rows

    def for_replies(self, prefilling: Sequence[GenerationRequest], decode_rows: int, whole: bool = True
                    ) -> tuple[list[Piece], frozenset[GenerationRequest], Leaving, Owed]:
        """This step's prompt pieces within its budget, in the order `PromptFairness` gives (fair
        by tokens owed), each from where its cache will stand. One with only its last token left
        decodes from this step, as does one whose last piece can go with that token in its first
        decode row (its cache keeps nothing at the generation start:
        `CacheSession.feeds_with_first_step`) or one whose cache holds its whole prompt and the
        logits after it. Returns the pieces, those whose states are still being read, those that
        leave (stopped, whether or not the budget would have reached them, or failed), and what
        the budget owes."""
        budget = (self.budget.tokens(self.prefill_chunk, decode_rows) if decode_rows
                  else self.budget.alone_tokens(self.prefill_chunk_alone))
        full_budget, pieces, on_disk, leaving = budget, [], set(), []
        wanting: list[Hashable] = []  # the flows (clients) with prompt left that could go on
        given: dict[Hashable, int] = {}
        for request in self._order(prefilling, budget):
            if request.prefill is None and not self.caches.ready(request.session):
                # its states are being read beside the loop: the others go on (a stopped one too:
                # ending it now would wait for that read on the loop; it ends once the read is in)
                on_disk.add(request)
                continue
            if request.stop.is_set():
                leaving.append((request, None))
                continue
            wanting.append(request.flow)
            allowed = self._whole_or(request, budget, sum(given.values()), decode_rows, whole)
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

    def for_text(self, texts: list[GenerationRequest]
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

    def _whole_or(self, request: GenerationRequest, budget: int, carried: int, decode_rows: int, whole: bool) -> int:
        """This request's piece at most: `budget`, or its whole prompt where it has fed none of it
        yet and the whole fits one step beside the decode rows with the `carried` tokens this step
        already has (`StepBudget.whole_tokens`): split, a message pays a second step's fixed part
        and waits that step more for its first token."""
        if not whole or request.prefill is not None or not decode_rows:
            return budget
        remaining = _remaining_prefill(request)
        room = self.budget.whole_tokens(self.prefill_chunk, decode_rows) - carried
        return remaining if budget < remaining <= room else budget

    def ends_prompt(self, request: GenerationRequest, piece: list[int], at: Landing) -> bool:
        """Whether `piece` (its next, from `at`) may take its prompt's last token with it, the
        logits after that read in the same step: it reaches the generation start where the cache
        keeps nothing (`CacheSession.feeds_with_first_step`), within `last_piece_rows`."""
        work = request.work
        fits = self.last_piece_rows is None or len(piece) + 1 <= self.last_piece_rows
        return fits and self.caches.feeds_with_first_step(request.session, request.prompt_ids, piece,
                                                          work.prefix_store, work.shared_prefix_length, at)

    def _order(self, prefilling: Sequence[GenerationRequest], budget: int) -> list[GenerationRequest]:
        """Fair by tokens owed, shortest remaining prefill first otherwise (chat/scheduling/prompt_fairness.py);
        or in arrival order."""
        if self.prefill_order != "shortest":
            return list(prefilling)
        return self.shares.order({request: _remaining_prefill(request) for request in prefilling},
                                  {request: request.flow for request in prefilling}, budget)


def _remaining_prefill(request: GenerationRequest) -> int:
    """Prompt tokens it still has to feed: past what its cache holds in common with the prompt
    (before its rollback, an estimate: a shared prefix or a checkpoint may serve more or less;
    after it, the ledger is a prefix of the prompt and only its length is read)."""
    held = len(request.session.token_ids) if request.started else common_prefix_length(
        request.session.token_ids, request.prompt_ids)
    return max(0, len(request.prompt_ids) - 1 - held)
