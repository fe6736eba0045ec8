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
"""

from __future__ import annotations

DEFAULT_GAP_FACTOR = 3.0  # a step with prefill takes at most ~3 decode steps (target: worst gap <= 4x)
DEFAULT_ALONE_STEP_S = 2.0  # a prefill step with no row decoding: what a message arriving meanwhile waits
# (at Qwen3-0.6B's shape here, 0.5 s made a long prompt alone 2x slower to prefill, 2 s 1.2x:
# benchmarks/results/fairness-qwen3-0.6b-alone*.json)
MIN_ALONE_TOKENS = 32  # (below that a step's fixed cost, reading the weights, outweighs its tokens)
_WEIGHT = 0.25  # of the newest sample in each moving average


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
        self.decode_s: float | None = None  # a step with decode rows only
        self.token_s: float | None = None  # what one prompt token adds to a step with decode rows
        self.alone_token_s: float | None = None  # a prompt token in a step with no decode rows

    def record(self, seconds: float, decode_rows: int, prompt_tokens: int) -> None:
        """One packed step ran: `decode_rows` rows decoded beside `prompt_tokens` prompt tokens."""
        if not decode_rows:
            if prompt_tokens:  # sizes the steps alone, and is a first guess beside decode rows
                self.alone_token_s = _average(self.alone_token_s, seconds / prompt_tokens)
            return
        if not prompt_tokens:
            self.decode_s = _average(self.decode_s, seconds)
        elif self.decode_s is not None:
            self.token_s = _average(self.token_s, max(0.0, seconds - self.decode_s) / prompt_tokens)

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
        if self.token_s and self.decode_s is not None:
            fitting = (step_s - self.decode_s) / self.token_s
        elif self.alone_token_s:
            fitting = step_s / self.alone_token_s
        else:
            fitting = MIN_ALONE_TOKENS  # a small first step, timed, then sized
        return max(min(cap, MIN_ALONE_TOKENS), min(cap, int(fitting)))

    def tokens(self, cap: int) -> int:
        """This step's prompt tokens while others decode."""
        token_s = self.token_s or self.alone_token_s
        if self.gap_factor is None or self.decode_s is None or not token_s:
            return cap
        return max(1, min(cap, int((self.gap_factor - 1) * self.decode_s / token_s)))


def _average(old: float | None, new: float) -> float:
    return new if old is None else (1 - _WEIGHT) * old + _WEIGHT * new
