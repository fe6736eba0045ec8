"""Prefill while the person types (issue #45): the steps that feed drafts, the prompts of
messages not sent yet, into their conversations' own caches.

A draft runs only in a step no reply wants (the scheduler asks for one when its table is idle of
replies), a piece of at most `prefill_chunk` tokens a step, so a reply arriving waits at most that
piece. What it fed stays in the cache: the Send's ordinary rollback keeps the common prefix. A
draft ends once only its last token is left, at the first step after its stop (a newer draft, the
Send, a close), or with an error of its own; it is rested like any request (the planner's
`finish`), so its cache is checked against its ledger.
"""
from __future__ import annotations

from cache_sessions.owner import CacheOwner
from chat.requests import GenerationRequest
from chat.runner import ModelRunner
from chat.step_planner import StepPlanner


class AheadSteps:
    """The drafts' side of the loop, beside the planner's table of replies."""

    def __init__(self, planner: StepPlanner, caches: CacheOwner, runner: ModelRunner):
        self.planner, self.caches, self.runner = planner, caches, runner

    def end_stopped(self) -> None:
        """Drafts stopped since the last step leave, before any reply is admitted: a Send may
        follow its own draft, and must find its session free."""
        for draft in [draft for draft in self.planner.requests.drafts if draft.stop.is_set()]:
            self.end(draft)

    def step(self) -> None:
        """With no reply to work on: one piece of the oldest draft, in a step of its own."""
        chosen = self._next_piece()
        if chosen is None:
            return
        draft, piece = chosen
        try:
            self.runner.run([(draft.session, piece)], [])
            self.caches.fed([(draft.session, piece)])
        except BaseException as error:
            self.end(draft, error)
            return
        if self.planner.prefilled(draft, self.end):
            self._prepared(draft)

    def end(self, draft: GenerationRequest, error: BaseException | None = None) -> None:
        with self.planner.requests.lock:
            self.planner.requests.drafts.remove(draft)
        self.planner.finish(draft, error)

    def _next_piece(self) -> tuple[GenerationRequest, list[int]] | None:
        """The oldest draft whose states are at hand, and its next piece. A draft with nothing
        left to feed is prefilled and ends here; one whose rollback fails ends with its error."""
        planner = self.planner
        planner.on_disk = set()
        for draft in list(planner.requests.drafts):
            if draft.prefill is None and not self.caches.ready(draft.session):
                planner.on_disk.add(draft)  # read beside the loop; the loop is woken when it is in
                continue
            work = draft.work
            try:
                planner.begin(draft)
                piece = self.caches.prefill_piece(draft.session, draft.prompt_ids, planner.prefill_chunk,
                                                  work.prefix_store, work.shared_prefix_length)
            except BaseException as error:
                self.end(draft, error)
                return None
            if piece:
                return draft, piece
            self._prepared(draft)
            return None
        return None

    def _prepared(self, draft: GenerationRequest) -> None:
        with self.planner.requests.lock:
            self.planner.counters.prepared += 1
        self.end(draft)  # only its last token is left, for the Send
