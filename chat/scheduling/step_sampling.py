"""Sampling, the step's last phase: every token is chosen here, by each reply's own sampler
(chat/scheduling/sampling.py, through `choose_tokens`): a first token from the logits a cache kept (before
the run, so the row feeds it in the same step), then each decode row's tokens from the step's
logits, its guesses taken while they match; the caches give back guesses not taken, and rows
that ended leave.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from cache_sessions.owner import CacheOwner
from chat.scheduling.guessing import StepGuesses, choose_tokens
from chat.scheduling.step_plan import StepPlan
from chat.scheduling.step_planner import StepPlanner


class StepSampler:
    def __init__(self, caches: CacheOwner, guesses: StepGuesses, planner: StepPlanner):
        self.caches, self.guesses, self.planner = caches, guesses, planner

    def first_tokens_kept(self, plan: StepPlan) -> StepPlan:
        """Rows that hold their whole prompt, the logits after it kept (a Retry, the Send of a
        prepared message: `CacheSession.next_logits`), choose their first token from those now,
        before the run, and feed it in this step as any decode row feeds its last token. Returns
        the plan less the rows that ended with it."""
        ready = plan.first_from_kept()
        if not ready:
            return plan
        logits = torch.cat([self.caches.next_logits(request.session, request.prompt_ids) for request in ready])
        ended, _ = choose_tokens(ready, logits, [[] for _ in ready])
        with self.planner.requests.lock:
            self.planner.counters.first_tokens_kept += len(ready)
        self.planner.stages.leave(ended)
        guesses = tuple(self.guesses.after_first(guess, request.sequence[-1]) if request in ready else guess
                        for request, guess in zip(plan.decoding, plan.guesses))
        return replace(plan, guesses=guesses).without(ended)

    def sample(self, plan: StepPlan, logits: torch.Tensor) -> None:
        """Each decode row's tokens by its own sampler (its guesses taken while they match); the
        caches give back guesses not taken; rows that ended leave. A row's first logits, after its
        prompt's last token, are kept with its cache for a Retry (`CacheSession.keep_next_logits`)."""
        offset = 0
        for request, guess in zip(plan.decoding, plan.guesses):
            if request.token_count == 0:
                self.caches.keep_next_logits(request.session, request.prompt_ids, logits[offset])
            offset += len(guess) + 1
        ended, taken = choose_tokens(plan.decoding, logits, plan.guesses)
        with self.planner.requests.lock:
            self.planner.counters.step(plan.decoding, plan.guesses, taken)
        ended += self.guesses.give_back(plan.decoding, plan.guesses, ended)
        if ended:
            self.planner.stages.leave(ended)
