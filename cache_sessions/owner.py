"""The one owner of every conversation's cache: each change to a session's states is applied
here, on the engine's loop thread, and nowhere else.

vLLM's split at this scale: the scheduler (chat/scheduling/scheduler.py) decides what runs each step, this
owner applies it to the sessions (roll back, choose each prompt piece, note what a step fed,
commit, keep and put back branches, move between devices, release), and the runner
(chat/model_step/runner.py) runs the model: this owner imports no model code. Other threads never
touch a session's tensors: they ask the loop (`Loop.call` / `Loop.post`) and read only the
numbers kept here under a lock.

"In use" has one meaning, and one record: the scheduler's table of its requests (waiting,
prefilling, decoding, or made elsewhere: a ZeroGPU worker's), read through `in_use`. The budget
never frees, spills or releases a session in use, and a close while in use releases it once its
request has left. Every other change to a session (a switch, an undo) runs on the loop as one
command, so the budget, which runs there too, cannot meet it. A forked ZeroGPU worker has its own
scheduler and so its own record. What goes first when the caches together exceed the budget is
cache_sessions/eviction.py's to say. The books themselves (sessions, bytes, the budget, the
loop's check) are cache_sessions/books.py; this adds the changes.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from cache_sessions.books import CacheBooks, CacheStats, Loop
from cache_sessions.branches import BranchKeep, BranchMove, keep_before_reply, move_branch
from cache_sessions.checkpoints import Checkpoint
from cache_sessions.prefixes import PrefixStore
from cache_sessions.session import CacheSession, Landing, PrefillResult

__all__ = ["CacheOwner", "CacheStats", "Loop"]


class CacheOwner(CacheBooks):
    """Applies every change to a session (its books, the budget and the loop's check:
    `CacheBooks`)."""

    # ---- the loop: a reply ---------------------------------------------------------------------
    def begin(self, session: CacheSession, prompt_ids: Sequence[int], keep: BranchKeep | None,
              prefix_store: PrefixStore | None, shared_prefix_length: int) -> PrefillResult:
        """A reply is admitted: its session to the model's device, the branch it replaces kept,
        the cache rolled back to where the prompt parts from it; to its end where the logits
        after it were kept (`next_logits`: its first token then needs no step)."""
        self._on_loop(session, used=True)
        if self.offload:
            session.to(self.model.device)
        if keep is not None:
            keep_before_reply(session, keep, prompt_ids, whole=True)
        return session.rewind_to(prompt_ids, prefix_store=prefix_store, shared_prefix_length=shared_prefix_length,
                                 whole=True)

    def landing(self, session: CacheSession, prompt_ids: Sequence[int], prefix_store: PrefixStore | None
                ) -> Landing:
        """Where `begin` would leave `session` for this prompt, found without moving anything (a
        step's plan reads it before the rollback is applied)."""
        self._on_loop(session)
        return session.landing(prompt_ids, prefix_store, whole=True)

    def next_logits(self, session: CacheSession, prompt_ids: Sequence[int]) -> torch.Tensor | None:
        """The logits kept after its whole prompt, which its cache holds (None: not kept)."""
        self._on_loop(session)
        return session.next_logits(prompt_ids)

    def keep_next_logits(self, session: CacheSession, prompt_ids: Sequence[int], logits: torch.Tensor) -> None:
        """The step that fed its prompt's last token gave `logits` after it: kept for a Retry."""
        self._on_loop(session)
        session.keep_next_logits(prompt_ids, logits)

    def prefill_piece(self, session: CacheSession, prompt_ids: Sequence[int], budget: int,
                      prefix_store: PrefixStore | None, shared_prefix_length: int, at: Landing) -> list[int]:
        """The prompt tokens this session feeds in the next step, from `at` (`CacheSession.prefill_piece`)."""
        self._on_loop(session)
        return session.prefill_piece(prompt_ids, budget, prefix_store, shared_prefix_length, at)

    def feeds_with_first_step(self, session: CacheSession, prompt_ids: Sequence[int], piece: Sequence[int],
                              prefix_store: PrefixStore | None, shared_prefix_length: int, at: Landing) -> bool:
        """Whether its last prompt piece goes with the first decode step (`CacheSession.feeds_with_first_step`)."""
        self._on_loop(session)
        return session.feeds_with_first_step(prompt_ids, piece, prefix_store, shared_prefix_length, at)

    def piece_fed(self, session: CacheSession, prompt_ids: Sequence[int], prefix_store: PrefixStore | None,
                  shared_prefix_length: int) -> bool:
        """Its piece went through: what the session keeps at that point; True once prefilled."""
        self._on_loop(session)
        try:
            return session.piece_fed(prompt_ids, prefix_store, shared_prefix_length)
        finally:
            self._measure(session)

    def fed(self, rows: list[tuple[CacheSession, list[int]]]) -> None:
        """A step went through (chat/model_step/runner.py ran it): each row's cache now also holds what it
        fed. Every row's session is a live request's (registered and brought back when it began,
        never spilled since), so only the thread is checked here, once a step."""
        self._on_loop()
        for session, tokens in rows:
            session.note_extended(tokens)
            self._measure(session)

    def take_back(self, session: CacheSession, count: int, point: Checkpoint | None = None) -> None:
        """Its last `count` fed tokens out again (guesses a step refused, chat/scheduling/drafting.py): a
        crop, or, for recurrent states, back to the step's start `point` (the tokens it took are
        fed again next step); if it cannot be exact the session is released and this raises."""
        self._on_loop()
        try:
            session.take_back(count, point)
        finally:
            self._measure(session)

    def end(self, session: CacheSession, sequence: Sequence[int] | None, labels: Sequence[Any],
            failed: bool) -> int:
        """A reply left the batch: check what was fed (`sequence`: prompt and chosen tokens; None:
        it never began), name the messages the cache now holds, rest the session. Returns its bytes."""
        self._on_loop(session, used=True)
        try:
            if sequence is not None:
                if failed:
                    session.release()  # states from a failed update cannot be trusted
                else:
                    session.commit(sequence)  # releases and raises if the ledger does not match
                    session.labels = list(labels)
            if self.offload:
                session.to("cpu")
        finally:
            nbytes = self._measure(session)
        return nbytes

    # ---- the loop: other changes ---------------------------------------------------------------
    def move(self, session: CacheSession, move: BranchMove) -> bool:
        """Keep the branch left and put back the one arriving (see cache_sessions/branches.py)."""
        self._on_loop(session, used=True)
        moved = move_branch(session, move)
        self._measure(session)
        return moved

    def start_from(self, session: CacheSession, source: CacheSession, length: int | None = None) -> bool:
        """A new, empty `session` starts from a copy of `source`'s states, its first `length`
        positions (None: all it holds; more than it holds: all) (a conversation branched off into
        a new chat: its first turn rolls the copy back to what it shares, as any turn does; an API
        request sharing a prefix with another's conversation). False (nothing copied; its first
        turn computes everything) when `source` holds nothing, `session` already does, or `source`
        has layers that keep earlier states only at checkpoints (sliding windows, recurrent
        states), which a copy does not carry: cut back, it would start from nothing, where a new
        session starts from the shared prefix."""
        self._on_loop(source)
        self._on_loop(session)
        if session.token_ids or not source.token_ids or not source.crops_anywhere() or length == 0:
            return False
        end = len(source.token_ids) if length is None else min(length, len(source.token_ids))
        copied = session.append_segment(source.cut_segment(0, end))
        self._measure(session)
        return copied

    def adopt_state(self, session: CacheSession, returned: CacheSession) -> None:
        """`session` becomes `returned`: the same session, updated in a worker process."""
        self._on_loop(session, used=True)
        session.take_state_of(returned)
        self._measure(session)
