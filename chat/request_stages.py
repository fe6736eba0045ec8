"""A request's stages through the table, applied: its start (a sampler, its cache rolled back to
where the prompt parts from it), each prompt piece noted, a first token from logits its cache
kept, and its end (the cache owner checks and rests its session, then its reader is told).

The planner (chat/step_planner.py) decides when each of these happens; this carries them out over
the cache owner, for replies and texts prepared ahead alike (chat/ahead.py), so neither holds a
second copy of how a request starts or ends.
"""
from __future__ import annotations

import time
from typing import Callable

import torch
from transformers import PreTrainedModel

from cache_sessions.owner import CacheOwner
from chat.guessing import StepGuesses, choose_tokens
from chat.request_table import RequestTable
from chat.requests import GenerationRequest
from chat.sampling import TokenChooser


class RequestStages:
    """Starts, advances and ends the requests of one table (made anew with the table)."""

    def __init__(self, model: PreTrainedModel, caches: CacheOwner, guesses: StepGuesses, requests: RequestTable):
        self.model, self.caches, self.guesses, self.requests = model, caches, guesses, requests

    def begin(self, request: GenerationRequest) -> None:
        """Its first turn: its sampler, and its cache rolled back to where the prompt parts from it."""
        if request.prefill is None:
            work = request.work
            request.started_at = time.perf_counter()
            request.chooser = TokenChooser(self.model, request.options, len(request.prompt_ids))
            self.guesses.begin(request)
            request.prefill = self.caches.begin(request.session, request.prompt_ids, work.keep, work.prefix_store,
                                                work.shared_prefix_length)

    def first_tokens_kept(self) -> int:
        """Rows that hold their whole prompt, the logits after it kept (a Retry, the Send of a
        prepared message: `CacheSession.next_logits`), choose their first token from those now,
        before the step, and feed it in this step as any decode row feeds its last token. Returns
        how many did."""
        ready = [request for request in self.requests.decoding if not request.unfed]
        if not ready:
            return 0
        logits = torch.cat([self.caches.next_logits(request.session, request.prompt_ids) for request in ready])
        ended, _ = choose_tokens(ready, logits, [[] for _ in ready])
        if ended:
            self.leave(ended)
        return len(ready)

    def piece_fed(self, request: GenerationRequest) -> None:
        """A prompt piece ran: the request decodes from the next step once only its last token is left."""
        if self.prefilled(request, self.leave_prefill):
            self.requests.start_decoding(request)

    def prefilled(self, request: GenerationRequest, fail: Callable[[GenerationRequest, BaseException], None]
                  ) -> bool:
        """Whether all of its prompt but the last token is in its cache now (the owner notes the
        piece: a shared prefix kept, a checkpoint); if that fails, `fail` ends it with the error."""
        work = request.work
        try:
            return self.caches.piece_fed(request.session, request.prompt_ids, work.prefix_store,
                                         work.shared_prefix_length)
        except BaseException as error:
            fail(request, error)
            return False

    def leave(self, requests: list[GenerationRequest], error: BaseException | None = None) -> None:
        """Take `requests` out of the decode rows and end them."""
        self.requests.remove(requests)
        for request in requests:
            self.finish(request, error)

    def leave_prefill(self, request: GenerationRequest, error: BaseException | None = None) -> None:
        self.requests.remove([request])
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
