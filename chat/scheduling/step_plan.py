"""What one step does, as plain data: made by the planner (chat/scheduling/step_planner.py) from the table
of requests without changing anything, applied by the request stages (chat/scheduling/request_stages.py)
over the cache owner, run by the runner (chat/model_step/runner.py), its tokens chosen by the
sampling (chat/scheduling/guessing.py). Also what the batch has done so far, for `/status`.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, replace
from typing import Collection, Hashable

from cache_sessions.session import Landing
from chat.model_step.runner import Row
from chat.scheduling.request_table import Admission
from chat.scheduling.requests import GenerationRequest


@dataclass(frozen=True)
class Piece:
    """A prompt's part in a step: `tokens` of its prompt fed from `at`, where its cache stands once
    the step's rollback is applied (`begins`: its first turn, rolled back there first).
    `ends_prompt`: the prompt's last token goes with them (a reply: in its first decode row, its
    first token chosen after it; a text prepared ahead: the logits after it kept for its Send).
    A reply's piece that ends its prompt with no tokens decodes from its last token; held whole
    (`at` is the prompt's end), its first token comes from the logits its cache kept."""

    request: GenerationRequest
    at: Landing
    tokens: tuple[int, ...]
    ends_prompt: bool = False
    begins: bool = False

    @property
    def held_whole(self) -> bool:
        return self.at.position == len(self.request.prompt_ids)

    def fed(self) -> list[int]:
        """What its row feeds this step: its tokens, and the prompt's last one where it ends it."""
        return list(self.tokens) + (self.request.prompt_ids[-1:] if self.ends_prompt else [])


@dataclass(frozen=True)
class Owed:
    """A step's prompt budget as fairness settles it (chat/scheduling/prompt_fairness.py): the flows that
    wanted some of `budget`, and what each was given."""

    wanting: tuple[Hashable, ...]
    given: tuple[tuple[Hashable, int], ...]
    budget: int


@dataclass(frozen=True)
class StepPlan:
    """One step, decided before anything changes (vLLM v1's `SchedulerOutput`, at this scale).

    Applied in this order: `admission` moves requests between the table's lists; `leaving` end
    (stopped wherever they wait, or failed while planned: their caches as they are); each
    request of `prefill` is rolled back where it `begins`, and those that end their prompt
    decode from this step; a text prepared ahead (`ahead`, only in a step no reply wants) is
    rolled back likewise. Then the runner runs `decoding` (each row its next input and its
    `guesses`), the prompt rows of `prefill` and `ahead`, and every token is chosen."""

    admission: Admission
    leaving: tuple[tuple[GenerationRequest, BaseException | None], ...] = ()
    prefill: tuple[Piece, ...] = ()  # in the order the budget went to them
    decoding: tuple[GenerationRequest, ...] = ()  # this step's decode rows, the runner's first rows
    guesses: tuple[tuple[int, ...], ...] = ()
    ahead: Piece | None = None  # with no tokens and not ending its prompt: fed to its end, it ends
    on_disk: frozenset[GenerationRequest] = frozenset()  # their states being read beside the loop
    apart: bool = False  # only newcomers whose prompt ends here decode (the other rows wait a step)
    eager: bool = False  # run eagerly though a graph would take it: timed once for guesses (chat/scheduling/drafting.py)
    owed: Owed | None = None
    started: float = 0.0  # when the step's own work began: what a guess costs counts from here

    @property
    def pieces(self) -> tuple[Piece, ...]:
        """The prompt rows: pieces of replies that do not end their prompt this step."""
        return tuple(piece for piece in self.prefill if not piece.ends_prompt)

    @property
    def joining(self) -> tuple[Piece, ...]:
        """Replies that decode from this step."""
        return tuple(piece for piece in self.prefill if piece.ends_prompt)

    def first_from_kept(self) -> list[GenerationRequest]:
        """Replies joining the decode rows whose first token comes from the logits their cache
        kept: chosen before the run, and fed in this step's row (or the next step's, where
        newcomers run apart)."""
        return [piece.request for piece in self.joining if piece.held_whole]

    def without(self, gone: Collection[GenerationRequest]) -> StepPlan:
        """This plan less the requests in `gone` (ended while it was applied)."""
        if not gone:
            return self
        kept = [index for index, request in enumerate(self.decoding) if request not in gone]
        return replace(self, decoding=tuple(self.decoding[index] for index in kept),
                       guesses=tuple(self.guesses[index] for index in kept),
                       prefill=tuple(piece for piece in self.prefill if piece.request not in gone),
                       ahead=None if self.ahead is None or self.ahead.request in gone else self.ahead)

    # ---- the run: read once the plan is applied ---------------------------------------------
    def rows(self) -> list[Row]:
        """The runner's rows: each decode row's next inputs and guesses, then the prompt rows
        (read before the run: a row's inputs are what its cache does not hold yet)."""
        prompt_rows = [*self.pieces, *([self.ahead] if self.ahead_runs() else [])]
        return ([(request.session, request.unfed + list(guess)) for request, guess in zip(self.decoding, self.guesses)]
                + [(piece.request.session, piece.fed()) for piece in prompt_rows])

    def ahead_runs(self) -> bool:
        """Whether a text prepared ahead feeds tokens this step (one fed to its end ends instead)."""
        return self.ahead is not None and bool(self.ahead.fed())

    def logits_wanted(self) -> tuple[list[int], list[int]]:
        """(rows whose logits the step returns, how many of each row's last tokens): after each
        decode row's last input and each guess; after a prepared text's last token where it ends
        its prompt."""
        rows, tails = list(range(len(self.decoding))), [len(guess) + 1 for guess in self.guesses]
        if self.ahead is not None and self.ahead.ends_prompt:
            rows.append(len(self.decoding) + len(self.pieces))
            tails.append(1)
        return rows, tails


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
    prompt_tokens_per_step: int = 0  # the measured budget while rows decode (chat/scheduling/step_budget.py)
    paused: int = 0  # decode rows given up for another client's share of the rows (chat/scheduling/request_table.py)
    preparing: int = 0  # texts being prepared ahead of their Send (`prepare`)
    prepared: int = 0  # texts prepared to their end so far
    guessed: int = 0  # tokens guessed and verified in decode steps (chat/scheduling/drafting.py)
    guesses_taken: int = 0  # of them, taken into replies
    first_tokens_kept: int = 0  # first tokens chosen from logits a cache kept, with no step (a Retry, a prepared Send)
    newcomers_apart: int = 0  # steps that ran newcomers' prompt ends without the other decode rows


class Counters:
    """What the batch has done so far, for `stats` (read by other threads under the table's lock)."""

    def __init__(self) -> None:
        self.steps = self.joined = self.largest_batch = self.prepared = self.guessed = self.guesses_taken = 0
        self.first_tokens_kept = self.newcomers_apart = 0
        self.join_waits: deque[float] = deque(maxlen=32)  # from submit to the first decode step

    def step(self, rows: tuple[GenerationRequest, ...], guesses: tuple[tuple[int, ...], ...], taken: int) -> None:
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
