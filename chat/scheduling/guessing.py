"""The scheduler's side of draft-and-verify decoding (chat/scheduling/drafting.py says what and why): which
rows guess and how many tokens, how a row's logits turn into tokens (each chosen by the reply's
own sampler, guessed or not), and the cache giving back what was not taken."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch

from chat.scheduling.drafting import EARLIER_VERSION, Drafter, DraftPolicy
from chat.scheduling.requests import GenerationRequest

if TYPE_CHECKING:
    from cache_sessions.owner import CacheOwner


class StepGuesses:
    def __init__(self, policy: DraftPolicy, caches: "CacheOwner"):
        self.policy, self.caches = policy, caches

    def attach(self, request: GenerationRequest) -> None:
        """A reply queued: its guesser (not for a prepared prompt), its prompt indexed off the
        loop. Where its cache cannot crop what a step fed (recurrent states), a step with guesses
        keeps the states it began from, and one whose guesses were refused goes back to them: the
        tokens it took are fed again before the next input, in the next step."""
        if self.policy.enabled and not request.ahead:
            request.drafter = Drafter(request.prompt_ids, len(request.prompt_ids), request.work.references,
                                      self.policy.seen)

    def propose(self, decoding: Sequence[GenerationRequest], inputs: Sequence[int | None], graph_ready: bool
                ) -> tuple[list[list[int]], bool]:
        """Each decode row's guesses of its next tokens, to verify this step: as many as the
        policy finds worth their cost (`graph_ready`: a compiled graph would take the step
        without them), never past the reply's token limit. `inputs`: how many tokens each row
        feeds before its guesses; None where its first token is chosen from the logits its cache
        kept, before the run: its first guess is of that token, and the others go only where it
        is right (`after_first`). In a reply's first step only guesses from an earlier version (a
        Retry's): its first token is what the person waits for, and the prompt's n-grams are a
        weak guess there that made the step longer (docs/performance.md). And whether the step
        should run eagerly though a graph would take it: a row has a guess, and the policy has
        never timed such a step (`DraftPolicy.times_eager_first`)."""
        guesses, guessable = [], False
        for request, fed in zip(decoding, inputs):
            drafter, first = request.drafter, fed is None
            if drafter is None or request.stop.is_set() or (fed or 0) > 1:
                # (more than its next input: the rest of its prompt, or what a step took and gave
                # back, fed again; a refusal now would go back before them too: this step catches up)
                guesses.append([])
                continue
            left = request.options.max_new_tokens - request.token_count - 1  # the last token is never fed
            guess = drafter.propose(request.sequence, min(self.policy.max_draft + first, left))
            if request.token_count == 0 and drafter.source != EARLIER_VERSION:
                guess = []
            length = self.policy.length(drafter.acceptance(), len(decoding), graph_ready,
                                        feeds_again=not request.session.takes_back_recent()) if guess else 0
            guesses.append(guess[:length + first] if length else [])
            guessable = guessable or bool(guess)
        return guesses, guessable and self.policy.times_eager_first(len(decoding), graph_ready)

    @staticmethod
    def after_first(guess: Sequence[int], first: int) -> tuple[int, ...]:
        """A row's guesses once its first token, chosen from kept logits, is `first`: those after
        the first guess where that was right, else none."""
        return tuple(guess[1:]) if guess and guess[0] == first else ()

    def mark(self, decoding: Sequence[GenerationRequest], guesses: Sequence[Sequence[int]]) -> None:
        """Before a step: each row with guesses keeps where its states begin it (recurrent states
        go back there if a guess is refused: `give_back`)."""
        for request, guess in zip(decoding, guesses):
            request.guess_point = request.session.guess_point() if guess else None

    def give_back(self, decoding: Sequence[GenerationRequest], guesses: Sequence[Sequence[int]],
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


def choose_tokens(rows: Sequence[GenerationRequest], logits: torch.Tensor, guesses: Sequence[Sequence[int]]
                  ) -> tuple[list[GenerationRequest], int]:
    """Each row's next tokens from its own logits (one row of logits after its last input, then
    one after each of its guesses: the step's `StepPlan.logits_wanted`; inputs before its last, tokens
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
