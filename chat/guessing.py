"""The scheduler's side of draft-and-verify decoding (chat/drafting.py says what and why): which
rows guess and how many tokens, how a row's logits turn into tokens (each chosen by the reply's
own sampler, guessed or not), and the cache giving back what was not taken."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from chat.drafting import EARLIER_VERSION, Drafter, DraftPolicy
from chat.requests import GenerationRequest

if TYPE_CHECKING:
    from cache_sessions.owner import CacheOwner


class StepGuesses:
    def __init__(self, policy: DraftPolicy, caches: "CacheOwner"):
        self.policy, self.caches = policy, caches

    def begin(self, request: GenerationRequest) -> None:
        """A reply's first turn: its guesses (not for a prepared prompt). Where its cache cannot
        crop what a step fed (recurrent states), a step with guesses keeps the states it began
        from, and one whose guesses were refused goes back to them: the tokens it took are fed
        again before the next input, in the next step."""
        if self.policy.enabled and not request.ahead:
            request.drafter = Drafter(request.prompt_ids, len(request.prompt_ids), request.work.references,
                                      self.policy.seen)

    def propose(self, decoding: list[GenerationRequest], graph_ready: bool) -> tuple[list[list[int]], bool]:
        """Each decode row's guesses of its next tokens, to verify this step: as many as the
        policy finds worth their cost (`graph_ready`: a compiled graph would take the step
        without them), never past the reply's token limit. In a reply's first step only guesses
        from an earlier version (a Retry's): its first token is what the person waits for, and the
        prompt's n-grams are a weak guess there that made the step longer (a prepared message's
        first token 20.3 against 14.1 ms on the benchmark model, docs/performance.md). And whether
        the step should run eagerly though a graph would take it: a row has a guess, and the
        policy has never timed such a step (`DraftPolicy.times_eager_first`)."""
        guesses, guessable = [], False
        for request in decoding:
            drafter, chooser = request.drafter, request.chooser
            if drafter is None or chooser is None or request.stop.is_set() or len(request.unfed) > 1:
                # (more than its next input: it feeds again what a step took and gave back; a
                # refusal now would go back before them too, so this step only catches up)
                guesses.append([])
                continue
            left = chooser.max_new_tokens - request.token_count - 1  # the last token is never fed
            guess = drafter.propose(request.sequence, min(self.policy.max_draft, left))
            if request.token_count == 0 and drafter.source != EARLIER_VERSION:
                guess = []
            length = self.policy.length(drafter.acceptance(), len(decoding), graph_ready,
                                        feeds_again=not request.session.takes_back_recent()) if guess else 0
            guesses.append(guess[:length])
            guessable = guessable or bool(guess)
            request.guess_point = request.session.guess_point() if length else None
        return guesses, guessable and self.policy.times_eager_first(len(decoding), graph_ready)

    def give_back(self, decoding: list[GenerationRequest], guesses: list[list[int]],
                  ended: list[GenerationRequest]) -> list[GenerationRequest]:
        """After a step with guesses: each such row's cache gives back what it was fed past the
        reply's last token but one (the guesses not taken, and the place of the last one taken).
        Returns the rows that could not (or failed) and are not in `ended` yet: they end with
        that error, their states released."""
        failed = []
        for request, guess in zip(decoding, guesses):
            if not guess:
                continue
            point, request.guess_point = request.guess_point, None
            if request.error is None:
                try:
                    self.caches.take_back(request.session, len(request.session.token_ids) - (len(request.sequence) - 1),
                                          point)
                    continue
                except BaseException as error:
                    request.error = error
            if request not in ended:
                failed.append(request)
        return failed


def choose_tokens(rows: list[GenerationRequest], logits: torch.Tensor, guesses: list[list[int]]
                  ) -> tuple[list[GenerationRequest], int]:
    """Each row's next tokens from its own logits (one row of logits after its last input, then
    one after each of its guesses: the step's `StepPlan.tails`; inputs before its last, tokens
    taken already and fed again or the rest of its prompt, give none), emitted to its reader: the
    token chosen after its last input, then, while each chosen token is the guess fed after it,
    the one chosen after that guess. Returns the rows that ended (an end token, the limit, a stop,
    or a failure of their own: the others go on), and how many guesses were taken."""
    ended: list[GenerationRequest] = []
    offset = taken = 0
    for request, guess in zip(rows, guesses):
        chooser = request.chooser
        assert chooser is not None
        row_logits, offset = logits[offset:offset + len(guess) + 1], offset + len(guess) + 1
        matched = 0
        for position in range(len(guess) + 1):
            try:
                token = chooser.choose(request.sequence, row_logits[position:position + 1])
            except BaseException as error:  # this row's own fault
                request.error = error
                ended.append(request)
                break
            request._emit(token)
            if chooser.ends(token, request.token_count) or request.stop.is_set():
                ended.append(request)
                break
            if position == len(guess) or token != guess[position]:
                break
            matched += 1
        if guess and request.drafter is not None:
            request.drafter.record(len(guess), matched)
        taken += matched
    return ended, taken
