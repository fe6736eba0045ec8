"""A step's plan applied, and a request's stages through the table: its start (a sampler, its
cache rolled back to where the prompt parts from it), each prompt piece noted, and its end (the
cache owner checks and rests its session, then its reader is told).

The planner (chat/scheduling/step_planner.py) decides, as plain data (chat/scheduling/step_plan.py); this carries it
out over the cache owner, for replies and texts prepared ahead alike, so no second copy of how a
request starts or ends exists.
"""
from __future__ import annotations

import time
from typing import Sequence

import torch

from transformers import PreTrainedModel

from cache_sessions.owner import CacheOwner
from chat.scheduling.guessing import StepGuesses
from chat.scheduling.request_table import RequestTable
from chat.scheduling.requests import GenerationRequest
from chat.scheduling.sampling import TokenChooser
from chat.scheduling.step_plan import Counters, Piece, StepPlan


class RequestStages:
    """Starts, advances and ends the requests of one table (made anew with the table)."""

    def __init__(self, model: PreTrainedModel, caches: CacheOwner, guesses: StepGuesses, requests: RequestTable,
                 counters: Counters):
        self.model, self.caches, self.guesses, self.requests, self.counters = model, caches, guesses, requests, counters

    def apply(self, plan: StepPlan) -> StepPlan:
        """Carry `plan` out, in its order (see `StepPlan`): the table's moves, who leaves, each
        rollback (where it lands checked against the plan: a request whose cache lands elsewhere
        ends with that error, never fed from a wrong place), replies that decode from this step,
        a prepared text fed to its end, and each guessing row's point to go back to. Returns the
        plan that runs: less the requests that ended meanwhile."""
        self.requests.admit(plan.admission)
        for request in plan.admission.stopped:
            self.finish(request)  # stopped while it waited (its cache untouched) or was paused
        for request, error in plan.leaving:
            self.leave([request], error)
        gone = {request for request, _ in plan.leaving}
        for piece in (*plan.prefill, *([plan.ahead] if plan.ahead is not None else [])):
            if not self._began(piece):
                gone.add(piece.request)
            elif piece.ends_prompt and not piece.request.ahead:
                self.requests.start_decoding(piece.request)
        if plan.ahead is not None and plan.ahead.request not in gone and not plan.ahead.fed():
            self.prepared(plan.ahead.request)  # its prompt fed (whole, or all but the last token)
            gone.add(plan.ahead.request)
        running = plan.without(gone)
        self.guesses.mark(running.decoding, running.guesses)
        return running

    def text_fed(self, text: Piece, logits: torch.Tensor) -> None:
        """A piece of a text prepared ahead ran: where it ended the prompt, the logits after it are
        kept (its Send chooses its first token from them) and it is prepared; else noted (a
        checkpoint, a shared prefix), its last token, if it takes one, next step."""
        request = text.request
        if text.ends_prompt:
            self.caches.keep_next_logits(request.session, request.prompt_ids, logits[-1])
            self.prepared(request)
        else:
            self.prefilled(request)

    def prepared(self, text: GenerationRequest) -> None:
        with self.requests.lock:
            self.counters.prepared += 1
        self.leave([text])

    def _began(self, piece: Piece) -> bool:
        """Its first turn begun where it `begins` (False: it failed, and left)."""
        if not piece.begins:
            return True
        request = piece.request
        try:
            self.begin(request)
            if request.session.here() != piece.at:
                raise RuntimeError(f"the cache landed at {request.session.here()}, not where its step was planned "
                                   f"({piece.at})")
        except BaseException as error:
            self.leave([request], error)
            return False
        return True

    def begin(self, request: GenerationRequest) -> None:
        """Its first turn: its sampler, and its cache rolled back to where the prompt parts from it."""
        if request.prefill is None:
            work = request.work
            request.started_at = time.perf_counter()
            request.chooser = TokenChooser(self.model, request.options, len(request.prompt_ids))
            request.prefill = self.caches.begin(request.session, request.prompt_ids, work.keep, work.prefix_store,
                                                work.shared_prefix_length)

    def piece_fed(self, request: GenerationRequest) -> None:
        """A prompt piece ran: the request decodes from the next step once only its last token is left."""
        if self.prefilled(request):
            self.requests.start_decoding(request)

    def prefilled(self, request: GenerationRequest) -> bool:
        """Whether all of its prompt but the last token is in its cache now (the owner notes the
        piece: a shared prefix kept, a checkpoint); if that fails, it leaves with the error."""
        work = request.work
        try:
            return self.caches.piece_fed(request.session, request.prompt_ids, work.prefix_store,
                                         work.shared_prefix_length)
        except BaseException as error:
            self.leave([request], error)
            return False

    def leave(self, requests: Sequence[GenerationRequest], error: BaseException | None = None) -> None:
        """Take `requests` out of the table (whichever list holds them) and end them."""
        self.requests.remove(requests)
        for request in requests:
            self.finish(request, error)

    def finish(self, request: GenerationRequest, error: BaseException | None = None) -> None:
        """The request is out: the owner checks and rests its session, then its turn is told."""
        error = request.error or error
        try:
            request.cache_bytes = self.caches.end(request.session, request.sequence if request.started else None,
                                                  request.work.labels, failed=error is not None)
        except BaseException as mismatch:  # the ledger did not match what was fed (released: 0 bytes)
            error = error or mismatch
        request.cache_tokens = len(request.session.token_ids)
        request._end(error)
