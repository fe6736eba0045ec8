"""Prefill while the person types: the steps that feed prepared texts, the prompts of
messages not sent yet, into their conversations' own caches.

A prepared text runs only in a step no reply wants (the scheduler asks for one when its table is
idle of replies), a piece of at most `prefill_chunk` tokens a step, so a reply arriving waits at most that
piece. What it fed stays in the cache: the Send's ordinary rollback keeps the common prefix. Where
the cache crops anywhere, the last piece takes the prompt's last token too and the logits after it
are kept with the cache, so the Send's first token needs no step (`CacheSession.next_logits`). A
text ends once its prompt is fed (all of it, or all but the last token where nothing is kept), at
the first step after its stop (a newer text, the Send, a close), or with an error of its own; it
is rested like any request (the planner's `finish`), so its cache is checked against its ledger.
"""
from __future__ import annotations

from cache_sessions.owner import CacheOwner
from chat.requests import GenerationRequest
from chat.model_step.runner import ModelRunner
from chat.step_planner import StepPlanner


class AheadSteps:
    """The loop's side of texts prepared ahead of their Send, beside the planner's table of replies."""

    def __init__(self, planner: StepPlanner, caches: CacheOwner, runner: ModelRunner):
        self.planner, self.caches, self.runner = planner, caches, runner

    def end_stopped(self) -> None:
        """Texts stopped since the last step leave, before any reply is admitted: a Send may
        follow its own text, and must find its session free."""
        for text in [text for text in self.planner.requests.ahead if text.stop.is_set()]:
            self.end(text)

    def step(self) -> None:
        """With no reply to work on: one piece of the oldest text, in a step of its own. Its last
        piece goes with the prompt's last token where the cache crops anywhere (as a reply's
        does: `CacheSession.feeds_with_first_step`; with int8 weights only within the rows their
        products keep apart, else in a step of its own), and the logits after it are kept: the
        Send then chooses its first token from them with no step."""
        chosen = self._next_piece()
        if chosen is None:
            return
        text, piece, whole = chosen
        rows = [(text.session, piece)]
        try:
            logits = self.runner.run(rows, [0] if whole else [], [1] if whole else None)
            self.caches.fed(rows)
        except BaseException as error:
            self.end(text, error)
            return
        if whole:
            self.caches.keep_next_logits(text.session, text.prompt_ids, logits[-1])
            self._prepared(text)
        else:  # noted (a checkpoint, a shared prefix); its last token, if it takes one, next step
            self.planner.stages.prefilled(text, self.end)

    def end(self, text: GenerationRequest, error: BaseException | None = None) -> None:
        with self.planner.requests.lock:
            self.planner.requests.ahead.remove(text)
        self.planner.stages.finish(text, error)

    def _next_piece(self) -> tuple[GenerationRequest, list[int], bool] | None:
        """The oldest text whose states are at hand, its next piece, and whether that piece ends
        with the prompt's last token. A text with nothing left to feed is prepared and ends here;
        one whose rollback fails ends with its error."""
        planner = self.planner
        planner.on_disk = set()
        for text in list(planner.requests.ahead):
            if text.prefill is None and not self.caches.ready(text.session):
                planner.on_disk.add(text)  # read beside the loop; the loop is woken when it is in
                continue
            work = text.work
            try:
                planner.stages.begin(text)
                piece = self.caches.prefill_piece(text.session, text.prompt_ids, planner.prefill_chunk,
                                                  work.prefix_store, work.shared_prefix_length)
                whole = planner.ends_prompt(text, piece)  # never where the prompt is held whole already
            except BaseException as error:
                self.end(text, error)
                return None
            if whole:
                return text, piece + text.prompt_ids[-1:], True
            if piece:
                return text, piece, False
            self._prepared(text)
            return None
        return None

    def _prepared(self, text: GenerationRequest) -> None:
        with self.planner.requests.lock:
            self.planner.counters.prepared += 1
        self.end(text)  # its prompt fed (whole, or all but the last token)
