"""The one owner of every conversation's cache: each change to a session's states is applied
here, on the engine's loop thread, and nowhere else.

vLLM's split at this scale: the scheduler (chat/scheduler.py) decides what runs each step, this
owner applies it to the sessions (roll back, choose each prompt piece, note what a step fed,
commit, keep and put back branches, move between devices, release), and the runner
(chat/runner.py) runs the model: this owner imports no model code. Other threads never
touch a session's tensors: they ask the loop (`Loop.call` / `Loop.post`) and read only the
numbers kept here under a lock.

"In use" has one meaning, and one record: the scheduler's table of its requests (waiting,
prefilling, decoding, or made elsewhere: a ZeroGPU worker's), read through `in_use`. The budget
never frees, spills or releases a session in use, and a close while in use releases it once its
request has left. Every other change to a session (a switch, an undo) runs on the loop as one
command, so the budget, which runs there too, cannot meet it. A forked ZeroGPU worker has its own
scheduler and so its own record. What goes first when the caches together exceed the budget is
cache_sessions/eviction.py's to say.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Collection, Protocol, Sequence, TypeVar

import torch
from transformers import PreTrainedModel

from cache_sessions.accounts import Accounts
from cache_sessions.branches import BranchKeep, BranchMove, keep_before_reply, move_branch
from cache_sessions.checkpoints import Checkpoint
from cache_sessions.cold import ColdStats, ColdStore
from cache_sessions.eviction import Eviction
from cache_sessions.kv_cache import KVCacheKind
from cache_sessions.prefixes import PrefixStore
from cache_sessions.session import CacheSession, PrefillResult
from cache_sessions.states import DEFAULT_MAX_CHECKPOINTS

T = TypeVar("T")


class Loop(Protocol):
    """The thread that owns the caches (the scheduler's): `post` queues work there, `call`
    waits for its result, `on_loop` says whether the caller is that thread."""

    def post(self, function: Callable[[], Any]) -> None: ...

    def call(self, function: Callable[..., T], *args: Any) -> T: ...

    def on_loop(self) -> bool: ...


@dataclass(frozen=True)
class CacheStats:
    sessions: int
    busy: int  # sessions a request holds (the scheduler's record)
    cache_bytes: int  # sessions and shared prefixes
    budget_bytes: int | None
    shared_prefix_bytes: int
    evictions: int  # idle sessions released for the budget
    segments_freed: int  # kept branch states freed for the budget
    cold: ColdStats | None = None  # the cold tier on disk, when there is one


class CacheOwner:
    def __init__(self, model: PreTrainedModel, loop: Loop, in_use: Callable[[], Collection[CacheSession]], *,
                 budget_bytes: int | None = None,
                 max_checkpoints: int = DEFAULT_MAX_CHECKPOINTS, prefix_store: PrefixStore | None = None,
                 offload: bool = False, cold_store: ColdStore | None = None,
                 kv_cache: KVCacheKind = KVCacheKind(), clock: Callable[[], float] = time.monotonic):
        """`offload`: sessions rest on the CPU and go to the model's device only while a reply
        runs (ZeroGPU, where GPU memory does not survive between calls). `cold_store`: where idle
        sessions go instead of being released when the budget is reached. `kv_cache`: the kind of
        cache every session's states live in (cache_sessions/kv_cache.py)."""
        self.model, self.loop, self.cold_store, self.kv_cache = model, loop, cold_store, kv_cache
        self.in_use = in_use
        self.budget_bytes, self.max_checkpoints = budget_bytes, max_checkpoints
        self.prefix_store, self.offload = prefix_store, offload
        self.accounts = Accounts(clock)
        self.reset()

    def reset(self) -> None:
        """Forget every session (a forked ZeroGPU worker starts with none of the server's)."""
        self.accounts.reset()
        self.eviction = Eviction(self.accounts, self._measure, self.in_use, cold_store=self.cold_store,
                                 prefix_store=self.prefix_store)

    # ---- any thread ------------------------------------------------------------------------------
    def new_session(self) -> CacheSession:
        session = CacheSession(self.model, max_checkpoints=self.max_checkpoints, kv_cache=self.kv_cache)
        self.accounts.register(session)
        return session

    def close(self, session: CacheSession) -> None:
        """Its conversation is gone: free it now if idle, else when its operation ends."""
        self.accounts.close(session)
        self.loop.post(self.settle)

    def stats(self) -> CacheStats:
        shared = self.prefix_store.nbytes() if self.prefix_store is not None else 0
        sessions, held = self.accounts.totals()
        return CacheStats(sessions=sessions, busy=len(self.in_use()), cache_bytes=shared + held,
                          budget_bytes=self.budget_bytes, shared_prefix_bytes=shared,
                          evictions=self.eviction.evictions, segments_freed=self.eviction.segments_freed,
                          cold=self.cold_store.stats() if self.cold_store is not None else None)

    def enforce_budget(self) -> None:
        """Bring the caches within the budget now (after the budget changed, say)."""
        self.loop.call(self.settle)

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
        return session.prepare(prompt_ids, prefix_store=prefix_store, shared_prefix_length=shared_prefix_length,
                               prefill=False, whole=True)

    def next_logits(self, session: CacheSession, prompt_ids: Sequence[int]) -> torch.Tensor | None:
        """The logits kept after its whole prompt, which its cache holds (None: not kept)."""
        self._on_loop(session)
        return session.next_logits(prompt_ids)

    def keep_next_logits(self, session: CacheSession, prompt_ids: Sequence[int], logits: torch.Tensor) -> None:
        """The step that fed its prompt's last token gave `logits` after it: kept for a Retry."""
        self._on_loop(session)
        session.keep_next_logits(prompt_ids, logits)

    def prefill_piece(self, session: CacheSession, prompt_ids: Sequence[int], budget: int,
                      prefix_store: PrefixStore | None, shared_prefix_length: int) -> list[int]:
        """The prompt tokens this session feeds in the next packed step (see `forward_rows`)."""
        self._on_loop(session)
        return session.prefill_piece(prompt_ids, budget, prefix_store, shared_prefix_length)

    def feeds_with_first_step(self, session: CacheSession, prompt_ids: Sequence[int], piece: Sequence[int],
                              prefix_store: PrefixStore | None, shared_prefix_length: int) -> bool:
        """Whether its last prompt piece goes with the first decode step (`CacheSession.feeds_with_first_step`)."""
        self._on_loop(session)
        return session.feeds_with_first_step(prompt_ids, piece, prefix_store, shared_prefix_length)

    def piece_fed(self, session: CacheSession, prompt_ids: Sequence[int], prefix_store: PrefixStore | None,
                  shared_prefix_length: int) -> bool:
        """Its piece went through: what the session keeps at that point; True once prefilled."""
        self._on_loop(session)
        try:
            return session.piece_fed(prompt_ids, prefix_store, shared_prefix_length)
        finally:
            self._measure(session)

    def fed(self, rows: list[tuple[CacheSession, list[int]]]) -> None:
        """A step went through (chat/runner.py ran it): each row's cache now also holds what it
        fed. Every row's session is a live request's (registered and brought back when it began,
        never spilled since), so only the thread is checked here, once a step."""
        self._on_loop()
        for session, tokens in rows:
            session.note_extended(tokens)
            self._measure(session)

    def take_back(self, session: CacheSession, count: int, point: Checkpoint | None = None) -> None:
        """Its last `count` fed tokens out again (guesses a step refused, chat/drafting.py): a
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
    def ready(self, session: CacheSession) -> bool:
        """Whether an operation on `session` can begin without waiting on the disk. If not, its
        states are being read beside the loop, which is woken once they are in."""
        return self.cold_store is None or self.cold_store.ready(session, lambda: self.loop.post(lambda: None))

    def bring_back(self, session: CacheSession) -> None:
        """Its states into memory now, from the cold tier if they went there (every operation on a
        session does this first; this does it ahead, e.g. while its user types)."""
        self._on_loop(session)

    def move(self, session: CacheSession, move: BranchMove) -> bool:
        """Keep the branch left and put back the one arriving (see cache_sessions/branches.py)."""
        self._on_loop(session, used=True)
        moved = move_branch(session, move)
        self._measure(session)
        return moved

    def start_from(self, session: CacheSession, source: CacheSession) -> bool:
        """A new, empty `session` starts from a copy of `source`'s states (a conversation branched
        off into a new chat: its first turn rolls the copy back to what it shares, as any turn
        does). False (nothing copied; its first turn computes everything) when `source` holds
        nothing, `session` already does, or `source` has layers that keep earlier states only at
        checkpoints (sliding windows, recurrent states), which a copy does not carry: cut back,
        it would start from nothing, where a new session starts from the shared prefix."""
        self._on_loop(source)
        self._on_loop(session)
        if session.token_ids or not source.token_ids or not source.crops_anywhere():
            return False
        copied = session.append_segment(source.cut_segment(0))
        self._measure(session)
        return copied

    def adopt_state(self, session: CacheSession, returned: CacheSession) -> None:
        """`session` becomes `returned`: the same session, updated in a worker process."""
        self._on_loop(session, used=True)
        session.take_state_of(returned)
        self._measure(session)

    def settle(self) -> None:
        """After each step and command: free closed sessions, keep the budget."""
        self._on_loop()
        for session in self.accounts.take_closed(self.in_use()):
            if self.cold_store is not None:
                self.cold_store.discard(session)
            session.release()
        if self.budget_bytes is not None:
            while self.stats().cache_bytes > self.budget_bytes and self.eviction.free_one():
                pass

    def _measure(self, session: CacheSession) -> int:
        """Its bytes, as `stats` and the budget count them (each storage once)."""
        nbytes = session.nbytes()
        self.accounts.measured(session, nbytes)
        return nbytes

    def _on_loop(self, session: CacheSession | None = None, used: bool = False) -> None:
        """Refuse any thread but the loop's; `session` known to the books (`used`: an operation of
        its conversation begins or ends now) and back from the cold tier if it went there."""
        if not self.loop.on_loop():
            raise RuntimeError("a cache is changed only on the engine's loop thread")
        if session is not None:
            (self.accounts.used if used else self.accounts.register)(session)
            if self.cold_store is not None and self.cold_store.resume(session):
                self._measure(session)  # its states are back: the budget counts them again
