"""How many prompt tokens a step may carry while others decode, measured on this machine.

A fixed chunk is the wrong size almost everywhere. On these 2 CPU cores, 64 prompt tokens
beside a decode step held a streaming user 6.2x its median gap at 33.6 M parameters and 20.8x
at Qwen3-0.6B's shape (benchmarks/fairness.py); on a GPU, where a step is bound by reading the
weights, hundreds of tokens cost little more than one. So the scheduler times its packed steps:
steps with no prefill give a decode step's time, steps with prefill give what each prompt token
added (both as moving averages), and the budget is the most tokens that keep a step within
`gap_factor` decode steps, between 1 and the configured cap (`prefill_chunk`). With no row
decoding, a step carries as many as fit in `alone_step_s` (at most `prefill_chunk_alone`): what
a newcomer waits behind. Before any step with both was timed, a token's cost is taken
from prefills that ran alone (dearer per token than beside a decode step, at small chunks: a
safe first guess; at Qwen3-0.6B's shape the cap's 64 tokens held the first mixed step ~2 s);
with neither, the cap.

A step that carries prompt tokens costs more than their share even when they are few: it runs
eagerly where a step of decode rows alone runs a compiled graph, and at int8 a few more rows
re-read the weights. Charging that fixed part to the tokens, as a cost per token measured from
small pieces did, shrank the next piece, which made the charge per token larger again: at
Qwen3-0.6B's shape with int8 weights, four rows decoding beside four waiting prompts, the pieces
fell 12, 8, 6, 4, 3, 2 to 1 token a step (a token "cost" 48 ms against the 14.5 ms one-row
decode step it was compared with) and the four prompts waited until the rows beside them had
finished (docs/performance.md, "Prompt pieces that do not starve"). While the fixed part is within the
allowance, the budget that keeps a step within it converges to where a line's would (a few
tokens fewer each step until it does); past it, there is no such point. So the budget watches for
that: steps with prefill are also fitted as a line (least squares over recent steps,
exponentially weighted) over the decode step of as many rows as they carry (each row count timed
on its own), and once a piece of `SMALL_PIECE` tokens or fewer has added more than the allowance
(the bound cannot be kept at any size), a piece is as large as makes that fixed part at most half
of what the step adds: a step that breaks the bound anyway should move the prompt, not feed it a
token at a time. (The fitted fixed part alone would decide too soon: with pieces of a few dozen
tokens its noise put a streaming user's worst gap at 5.7x its median, against 3.9x.)

Timings are noisy: a step timed while the machine was busy elsewhere counts as at most `OUTLIER`
times what it was expected to cost, so one slow step moves every size for a few steps only, and
a small piece's evidence lapses after `SMALL_PIECE_MEMORY` steps with prefill unless a small
piece renews it (the mode it sets rarely makes small pieces again).
"""

from __future__ import annotations

DEFAULT_GAP_FACTOR = 3.0  # a step with prefill takes at most ~3 decode steps (target: worst gap <= 4x)
DEFAULT_ALONE_STEP_S = 2.0  # a prefill step with no row decoding: what a message arriving meanwhile waits
# (at Qwen3-0.6B's shape here, 0.5 s made a long prompt alone 2x slower to prefill, 2 s 1.2x:
# benchmarks/results/fairness-qwen3-0.6b-alone*.json)
WHOLE_EXTRA_STEPS = 0.5  # a message given whole may take this many decode steps past `gap_factor`: half
# the margin to the gap target (4x), once a message (splitting it costs a second step's fixed part)
MIN_ALONE_TOKENS = 32  # (below that a step's fixed cost, reading the weights, outweighs its tokens)
_WEIGHT = 0.25  # of the newest sample in each moving average
_FIT_WEIGHT = 0.1  # of the newest step in the fit of steps with prefill (slower: it needs pieces of several sizes)
SMALL_PIECE = 2  # a piece this small that still breaks the allowance: the fixed part is past it
SMALL_PIECE_MEMORY = 32  # steps with prefill after which a small piece's evidence lapses unless renewed
OUTLIER = 3.0  # a step timed at more than this many times its expected cost counts as this many
_FIT_SPREAD = 1.0  # the least variance of the fitted steps' token counts (tokens squared) for a slope of its own


class _LineFit:
    """Exponentially weighted least squares of a step's added seconds against its prompt tokens:
    a fixed part and a cost per token. With pieces all of one size there is no slope to fit, and
    the last line fitted stands."""

    def __init__(self) -> None:
        self.weight = self.tokens = self.seconds = self.tokens_sq = self.cross = 0.0
        self.last: tuple[float, float] | None = None

    def add(self, tokens: int, seconds: float) -> None:
        keep = 1 - _FIT_WEIGHT if self.weight else 0.0
        self.weight = keep * self.weight + 1
        self.tokens = keep * self.tokens + tokens
        self.seconds = keep * self.seconds + seconds
        self.tokens_sq = keep * self.tokens_sq + tokens * tokens
        self.cross = keep * self.cross + tokens * seconds

    def fit(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds a token): fitted now, else the last line fitted, else None."""
        if self.weight:
            mean_tokens, mean_seconds = self.tokens / self.weight, self.seconds / self.weight
            spread = self.tokens_sq / self.weight - mean_tokens ** 2
            if spread >= _FIT_SPREAD:
                slope = (self.cross / self.weight - mean_tokens * mean_seconds) / spread
                fixed = mean_seconds - slope * mean_tokens
                if slope > 0 and fixed >= 0:
                    self.last = (fixed, slope)
        return self.last


class StepBudget:
    def __init__(self, gap_factor: float | None = DEFAULT_GAP_FACTOR, alone_step_s: float | None = DEFAULT_ALONE_STEP_S):
        """`gap_factor`: how many decode steps' time a step carrying prefill may take; None: no
        measuring, the caps always. `alone_step_s`: the seconds a step may take while none
        decodes; None: `prefill_chunk_alone` always."""
        if gap_factor is not None and gap_factor <= 1:
            raise ValueError("the gap factor must be above 1 (a step with prefill is longer than one without)")
        if alone_step_s is not None and not alone_step_s > 0:
            raise ValueError("alone_step_s must be above 0 seconds (or None)")
        self.gap_factor, self.alone_step_s = gap_factor, alone_step_s
        self.decode_steps: dict[int, float] = {}  # a step of decode rows only, by its rows
        self.token_s: float | None = None  # what one prompt token adds to a step with decode rows (through zero)
        self.mixed = _LineFit()  # the same steps as a line: a fixed part and a cost per token
        self.small_piece_s: float | None = None  # what a piece of at most SMALL_PIECE tokens added
        self.since_small_piece = 0  # steps with prefill since that was last timed
        self.alone_token_s: float | None = None  # a prompt token in a step with no decode rows

    def record(self, seconds: float, decode_rows: int, prompt_tokens: int) -> None:
        """One packed step ran: `decode_rows` rows decoded beside `prompt_tokens` prompt tokens."""
        if not decode_rows:
            if prompt_tokens:  # sizes the steps alone, and is a first guess beside decode rows
                self.alone_token_s = _average(self.alone_token_s, seconds / prompt_tokens)
            return
        if not prompt_tokens:
            self.decode_steps[decode_rows] = _average(self.decode_steps.get(decode_rows), seconds)
            return
        decode_s = self.decode_s(decode_rows)
        if decode_s is not None:
            line = self._added_line()
            added = max(0.0, seconds - decode_s)
            if line is not None:  # one slow step (the machine busy elsewhere) moves the sizes a little
                added = min(added, OUTLIER * max(line[0] + line[1] * prompt_tokens, decode_s / 2))
            self.token_s = _average(self.token_s, added / prompt_tokens)
            self.mixed.add(prompt_tokens, added)
            self.since_small_piece += 1
            if prompt_tokens <= SMALL_PIECE:
                self.small_piece_s = _average(self.small_piece_s, added)
                self.since_small_piece = 0
            elif self.since_small_piece > SMALL_PIECE_MEMORY:  # not renewed: sized by the allowance again
                self.small_piece_s = None

    def decode_s(self, rows: int = 1) -> float | None:
        """A step of `rows` decode rows alone: as timed, else the nearest row count timed (fewer
        first), else None."""
        if not self.decode_steps:
            return None
        return self.decode_steps[min(self.decode_steps, key=lambda timed: (abs(timed - rows), timed))]

    def alone_tokens(self, cap: int) -> int:
        """This step's prompt tokens when no row decodes: as many as fit in `alone_step_s`, the longest a
        message arriving meanwhile waits before its own prefill begins (at Qwen3-0.6B's shape
        on these cores, 512 tokens alone took 10-20 s), at least `MIN_ALONE_TOKENS`, at most
        `cap`. A step's time is its fixed cost (a decode step's) and what each token adds, when
        both were timed; else the tokens of prefills alone; else a first step of `MIN_ALONE_TOKENS`.
        None: `cap`."""
        step_s = self.alone_step_s
        if step_s is None or self.gap_factor is None:
            return cap
        decode_s = self.decode_s(1)
        if self.token_s and decode_s is not None:
            fitting = (step_s - decode_s) / self.token_s
        elif self.alone_token_s:
            fitting = step_s / self.alone_token_s
        else:
            fitting = MIN_ALONE_TOKENS  # a small first step, timed, then sized
        return max(min(cap, MIN_ALONE_TOKENS), min(cap, int(fitting)))

    def tokens(self, cap: int, decode_rows: int = 1) -> int:
        """This step's prompt tokens beside `decode_rows` decoding, between 1 and `cap`: as many
        as keep the step within `gap_factor` decode steps of those rows; or, where a small piece
        already added more than that allows, as many as make that fixed part at most half of
        what the step adds (at the fitted cost of a token)."""
        decode_s, token_s = self.decode_s(decode_rows), self.token_s or self.alone_token_s
        if self.gap_factor is None or decode_s is None or not token_s:
            return cap
        allowed = (self.gap_factor - 1) * decode_s
        if self.small_piece_s is not None and self.small_piece_s > allowed:
            line = self.mixed.fit()
            per_token = line[1] if line else self.alone_token_s or token_s
            return max(1, min(cap, int(self.small_piece_s / per_token)))
        return max(1, min(cap, int(allowed / token_s)))

    def whole_tokens(self, cap: int, decode_rows: int) -> int:
        """The most tokens of a message given whole in one step beside `decode_rows` rows (its
        first token then comes from it), at most `cap`: as many as keep that step within
        `gap_factor + WHOLE_EXTRA_STEPS` of their decode steps (the fitted fixed part and cost a
        token of steps with prefill, else the cost a token). Cut to the budget instead, a short
        message took two steps beside the rows, each carrying the fixed part of a step with
        prefill: at Qwen3-0.6B's shape, int8, eight rows decoding, 85 tokens went as 54 + 31 in
        260 + 234 ms against 325 ms whole (docs/performance.md). 0 until both were timed."""
        decode_s, line = self.decode_s(decode_rows), self._added_line()
        if self.gap_factor is None or decode_s is None or line is None:
            return 0
        fixed, per_token = line
        return max(0, min(cap, int(((self.gap_factor - 1 + WHOLE_EXTRA_STEPS) * decode_s - fixed) / per_token)))

    def apart_tokens(self, decode_rows: int) -> int:
        """The most tokens of newcomers' prompt ends that may run in a step of their own (their
        first tokens chosen from it) between two steps of `decode_rows` rows, keeping those rows'
        gap within `gap_factor` of their decode step: a one-row step plus what the tokens add (the
        fitted line of steps with prefill, else the cost of a token) within `gap_factor - 1` of
        their steps. 0 until both were timed."""
        rows_s, one_s, line = self.decode_s(decode_rows), self.decode_s(1), self._added_line()
        if self.gap_factor is None or rows_s is None or one_s is None or line is None:
            return 0
        fixed, per_token = line
        return max(0, int(((self.gap_factor - 1) * rows_s - one_s - fixed) / per_token))

    def _added_line(self) -> tuple[float, float] | None:
        """What prompt tokens add to a step beside decode rows, as (fixed seconds, seconds a
        token): the fitted line of steps with prefill, else the cost a token through zero (from
        prefills alone before any such step); None before a prompt token was timed."""
        token_s = self.token_s or self.alone_token_s
        return (self.mixed.fit() or (0.0, token_s)) if token_s else None


def _average(old: float | None, new: float) -> float:
    """The moving average with `new`, which counts at most `OUTLIER` times `old`."""
    if old is None:
        return new
    return (1 - _WEIGHT) * old + _WEIGHT * min(new, OUTLIER * old)
