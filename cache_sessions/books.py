"""The books of the caches: which sessions there are, what each holds, the byte budget, and
the thread every change runs on. `CacheOwner` (cache_sessions/owner.py) applies the changes;
this keeps the account of them: a session is registered when first seen, measured after each
change, freed once closed and idle, and spilled or released when the caches together exceed
the budget (cache_sessions/eviction.py says what goes first). Its counts are read from any
thread under a lock (cache_sessions/accounts.py); its changes only on the loop.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Collection, Protocol, TypeVar

from transformers import PreTrainedModel

from cache_sessions.accounts import Accounts
from cache_sessions.cold import ColdStats, ColdStore
from cache_sessions.eviction import Eviction
from cache_sessions.kv_cache import KVCacheKind
from cache_sessions.prefixes import PrefixStore
from cache_sessions.session import CacheSession
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


class CacheBooks:
    """Every session's account and the budget over them; the base of `CacheOwner`, which adds
    the changes themselves."""

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

    # ---- the loop ------------------------------------------------------------------------------
    def ready(self, session: CacheSession) -> bool:
        """Whether an operation on `session` can begin without waiting on the disk. If not, its
        states are being read beside the loop, which is woken once they are in."""
        return self.cold_store is None or self.cold_store.ready(session, lambda: self.loop.post(lambda: None))

    def bring_back(self, session: CacheSession) -> None:
        """Its states into memory now, from the cold tier if they went there (every operation on a
        session does this first; this does it ahead, e.g. while its user types)."""
        self._on_loop(session)

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
