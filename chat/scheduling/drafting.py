"""Draft-and-verify decoding: tokens guessed from the conversation itself, checked in one step.

A reply often repeats what is already there: quoted text, code being edited, a name, the
question restated, and above all an earlier version of itself (a Retry, a reply regenerated after
an edit). A decoding row whose next tokens can be guessed feeds its next input and up to k
guesses in one packed step (a piece of k+1 tokens on its own cache, as a prompt piece is); the
logits after each of them say what the model would have chosen there. The reply takes the
chosen tokens for as long as each matches the guess before it, plus the first that differs (or,
all matched, the one after the last guess), and the cache gives back the guesses past that with
its own rollback (cache_sessions/rollback.py: a crop within the reply, exact for full attention,
quantized codes and sliding windows). Recurrent states cannot be cropped: a row with them keeps
its states as the step began, goes back there when a guess was refused, and feeds again what
the step took at the start of its next step (which guesses nothing: a refusal there would go
back before those tokens too); "auto" counts that cost.

Exactness: every emitted token is chosen by the reply's own `TokenChooser` from the logits after
exactly the tokens before it, as without drafts. Greedy: the same argmax. Sampling: the standard
rejection rule (accept a guess x with probability min(1, p(x)/q(x)), else sample from the
residual max(0, p - q)) with a guess that is one token for certain (q = 1 at x) is "accept with
probability p(x), else draw from p without x", which is drawing from p and keeping the guess if
the draw is it: one draw per emitted token, from the same distribution, with the same generator,
so the distribution (and a seeded reply) is the one without drafts. Only float noise differs: a
row of k+1 tokens sums its products in another order than k+1 single steps, as any prompt piece
does (checked against a from-scratch forward in tests/test_drafting.py).

Where guesses come from (`Drafter`), most trusted first: an earlier version of this reply (its
continuation where the reply so far is its prefix, else after the last n tokens where they occur
in it), then the conversation's own tokens (the most recent earlier occurrence of the last 3, else
2, tokens: prompt lookup, as transformers' `prompt_lookup_num_tokens` and llama.cpp's n-gram
modes). Each source's acceptance is kept apart, per reply and over all replies (a new reply starts
from what earlier replies' guesses from that source scored).

How many (`DraftPolicy`): "ngram" guesses up to `MAX_DRAFT` wherever a match is found; "auto"
picks the length that maximizes the row's expected tokens a second from its measured acceptance
and what extra tokens add to a step on this machine, timed as steps run (`DraftPolicy`), down to
none; where a compiled decode graph is ready (chat/model_step/compiled.py) a row of several tokens
leaves it for the eager forward (1.47x slower a step at Qwen3-0.6B's shape), so guesses must beat
the graph's timed step, and none are fed while no eager step of that many rows was timed;
"off" never.
"""

from __future__ import annotations

from collections import deque
from statistics import median
from typing import Callable, Sequence

DRAFT_MODES = ("auto", "ngram", "off")
MAX_DRAFT = 8  # guesses a step at most (a longer run is rarely all right, and each costs a token)
NGRAM_SIZES = (3, 2)  # the tail looked up, longest first
FIRST_GUESS = 2  # "auto"'s length at a row count whose plain step is not timed yet (once any is)
_SAMPLES = 9  # recent steps a cost is the median of


def check_draft_mode(mode: str) -> None:
    if mode not in DRAFT_MODES:
        raise ValueError(f"draft is one of {', '.join(DRAFT_MODES)}, not {mode!r}")


class NgramIndex:
    """Where each n-gram of a token sequence was followed by a token: appended to as the sequence
    grows, so a lookup costs a dictionary read, not a scan of the history."""

    def __init__(self, tokens: Sequence[int] = ()):
        self.tokens: list[int] = []
        self._followed_at: dict[tuple[int, ...], list[int]] = {}  # n-gram -> positions after it, in order
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            position = len(self.tokens)
            for size in NGRAM_SIZES:
                if position >= size:
                    self._followed_at.setdefault(tuple(self.tokens[position - size:position]), []).append(position)
            self.tokens.append(token)

    def after(self, tail: Sequence[int], limit: int, from_position: int | None = None) -> tuple[list[int], int]:
        """Up to `limit` tokens that followed the longest n-gram ending `tail` here, and where they
        start: after its latest occurrence, or (`from_position`) its first at or after that
        position (else its latest). ([], -1): none of the n-grams occurs."""
        for size in NGRAM_SIZES:
            if len(tail) < size:
                continue
            positions = self._followed_at.get(tuple(tail[-size:]))
            if positions:
                start = positions[-1]
                if from_position is not None:
                    start = next((p for p in positions if p >= from_position), start)
                return self.tokens[start:start + limit], start
        return [], -1


SOURCES = ("earlier version", "conversation")  # where a guess came from (acceptance is kept for each)
EARLIER_VERSION = SOURCES[0]
PRIOR_WEIGHT = 4.0  # guesses' worth of what earlier replies' guesses from a source scored


class Drafter:
    """One reply's guesses: from `references` (earlier versions of this reply, their tokens only)
    and from its own sequence (prompt and reply so far), with what each source scored so far,
    here and (`seen`, shared by every reply of the engine) before."""

    def __init__(self, sequence: Sequence[int], prompt_length: int, references: Sequence[Sequence[int]] = (),
                 seen: dict[str, list[int]] | None = None):
        self.prompt_length = prompt_length
        self.own = NgramIndex(sequence)
        self.references = [NgramIndex(reference) for reference in references if reference]
        self._cursors = [0] * len(self.references)  # where each reference's last guess was taken
        self.counts = {source: [0, 0] for source in SOURCES}  # guesses taken, steps with one refused
        self.seen = seen if seen is not None else {source: [0, 0] for source in SOURCES}
        self.source = SOURCES[1]  # of the last guess proposed

    def propose(self, sequence: Sequence[int], limit: int) -> list[int]:
        """At most `limit` guesses of the tokens after `sequence` (this reply's whole sequence);
        `source` then says where they came from."""
        self.own.extend(sequence[len(self.own.tokens):])
        if limit <= 0:
            return []
        reply = sequence[self.prompt_length:]
        self.source = SOURCES[0]
        for index, reference in enumerate(self.references):
            if list(reference.tokens[:len(reply)]) == list(reply):  # so far this reply is that one
                guess = reference.tokens[len(reply):len(reply) + limit]
                if guess:
                    self._cursors[index] = len(reply)
                    return list(guess)
                continue
            guess, start = reference.after(sequence, limit, from_position=self._cursors[index])
            if guess:
                self._cursors[index] = start
                return guess
        self.source = SOURCES[1]
        guess, _ = self.own.after(sequence, limit)
        return guess

    def record(self, proposed: int, accepted: int) -> None:
        """A step verified `proposed` guesses of the last proposal and took `accepted` of them."""
        for counts in (self.counts[self.source], self.seen[self.source]):
            counts[0] += accepted
            counts[1] += accepted < proposed

    def acceptance(self, source: str | None = None) -> float:
        """The chance that a guess from `source` (default: the last proposal's) is right, given the
        one before it was: the geometric model's estimate from this reply's guesses, after
        `PRIOR_WEIGHT` guesses' worth of what earlier replies' scored (one right and one wrong
        assumed before any was checked)."""
        taken, refused = self.counts[source or self.source]
        seen_taken, seen_refused = self.seen[source or self.source]
        earlier = (seen_taken + 1) / (seen_taken + seen_refused + 2)
        return (taken + PRIOR_WEIGHT * earlier) / (taken + refused + PRIOR_WEIGHT)


class _Recent:
    """A cost's recent samples and their median, worked out when one is added: `length` reads it
    for every row of every step, a step adds one."""

    def __init__(self) -> None:
        self.samples: deque[float] = deque(maxlen=_SAMPLES)
        self.median = 0.0

    def add(self, seconds: float) -> None:
        self.samples.append(seconds)
        self.median = median(self.samples)


class DraftPolicy:
    """How many guesses a decoding row feeds this step (see the module's docstring), and, for
    "auto", what steps cost on this machine: a step of decode rows alone (by row count, eager or
    compiled), and what extra tokens add to an eager one (guesses or prompt pieces, by powers of
    two), each the median of its recent steps (a busy neighbour's spike moves a median little).
    A length whose cost was never timed is taken as free, so it is tried, then timed."""

    def __init__(self, mode: str = "auto", max_draft: int = MAX_DRAFT, refusal: Callable[[], str | None] = lambda: None):
        """`refusal`: asked as each reply begins, why it may feed no guess whatever the mode
        (the runner's: a guess there could change the reply; None: it may)."""
        check_draft_mode(mode)
        if max_draft < 1:
            raise ValueError("max_draft must be at least 1")
        self.mode, self.max_draft, self.refusal = mode, max_draft, refusal
        self.seen = {source: [0, 0] for source in SOURCES}  # every reply's guesses by source (`Drafter`)
        self.lengths = sorted({0, *(2 ** i for i in range(max_draft.bit_length()) if 2 ** i <= max_draft), max_draft})
        self._plain: dict[tuple[int, bool], _Recent] = {}  # (rows, compiled) -> seconds of a step of them alone
        self._extra: dict[int, _Recent] = {}  # extra tokens (a power of two, rounded up) -> seconds added

    @property
    def enabled(self) -> bool:
        return self.mode != "off" and self.refusal() is None

    def record_step(self, seconds: float, rows: int, extra_tokens: int, compiled: bool = False) -> None:
        """A packed step ran `rows` decode rows and `extra_tokens` more (guesses, prompt pieces);
        `compiled`: as a compiled graph (decode rows alone)."""
        if self.mode != "auto" or not rows:
            return
        if not extra_tokens:
            self._plain.setdefault((rows, compiled), _Recent()).add(seconds)
        elif (plain := self._plain.get((rows, False))) is not None:
            bucket = 1 << (extra_tokens - 1).bit_length()
            self._extra.setdefault(bucket, _Recent()).add(max(0.0, seconds - plain.median))

    def length(self, acceptance: float, rows: int, compiled: bool, feeds_again: bool = False) -> int:
        """The most guesses worth feeding: `acceptance` the row's (`Drafter.acceptance`), `rows` the
        decode rows of this step, `compiled`: a compiled graph would take this step if it carried
        single tokens (guesses send it to the eager forward: they must beat the graph, as timed).
        `feeds_again`: a refusal makes the row feed again what the step took (recurrent states,
        chat/scheduling/guessing.py), a cost counted with the chance that some guess is refused."""
        if self.mode == "off":
            return 0
        if self.mode == "ngram":
            return self.max_draft
        eager = self._plain.get((rows, False))
        if eager is None:  # an eager step of these rows alone is timed first (where the graph is
            # ready, the eager step's cost is not known: the graph serves)
            return 0 if compiled or not self._plain else FIRST_GUESS
        share = eager.median / rows  # this row's part of the step's fixed cost

        def rate(k: int) -> float:
            tokens = expected_tokens(acceptance, k)
            again = (1 - acceptance ** k) * self.added_s(round(tokens)) if feeds_again and k else 0.0
            return tokens / (share + self.added_s(k) + again)

        best = max(self.lengths, key=rate)
        if compiled:
            graph = self._plain.get((rows, True))
            if graph is None or rate(best) <= rows / graph.median:
                return 0
        return best

    def times_eager_first(self, rows: int, compiled: bool) -> bool:
        """Whether a step of `rows` decode rows that a compiled graph would take runs eagerly
        instead, once, to be timed: "auto" weighs guesses (which send a step to the eager forward)
        against the graph by that eager step's cost. Where the graph serves from the first step
        (loaded from disk at start) no eager step of those rows ever ran, and no guess was ever
        fed: a Retry at Qwen3-0.6B's shape, int8, decoded at the graph's 35 tokens a second where
        the same engine whose graph came later made 130-160 (docs/performance.md)."""
        return self.mode == "auto" and compiled and (rows, False) not in self._plain

    def added_s(self, tokens: int) -> float:
        """What `tokens` extra tokens add to an eager step, as timed (0 where never timed: worth a try)."""
        if tokens <= 0:
            return 0.0
        timed = self._extra.get(1 << (tokens - 1).bit_length())
        return timed.median if timed is not None else 0.0


def expected_tokens(acceptance: float, guesses: int) -> float:
    """Tokens a row emits in a step with `guesses` guesses, each right with chance `acceptance`
    given the ones before it: 1 + a + a^2 + ... + a^k."""
    return sum(acceptance ** i for i in range(guesses + 1))
