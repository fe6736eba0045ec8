"""What goes first when the caches together exceed the budget (the owner asks, on its loop thread,
one release at a time, until they fit or only states in use are left).

The order costs the least re-computation first: the segments idle sessions keep for branches not
shown (the oldest of all), then the least recently used idle session (to the cold tier on disk
when there is one: its next operation reads it back, exact; else released: its conversation keeps
its messages and its next turn rebuilds), then shared prefixes. A session in use (a request of the scheduler's holds it) is never touched.
"""

from __future__ import annotations

from typing import Callable, Collection

from cache_sessions.accounts import Accounts
from cache_sessions.cold import ColdStore
from cache_sessions.prefixes import PrefixStore
from cache_sessions.session import CacheSession


class Eviction:
    def __init__(self, accounts: Accounts, measure: Callable[[CacheSession], int],
                 in_use: Callable[[], Collection[CacheSession]], *, cold_store: ColdStore | None = None,
                 prefix_store: PrefixStore | None = None):
        """`measure`: re-counts a session's bytes after its states changed (the owner's books).
        `in_use`: the sessions live requests hold (the scheduler's record), never freed."""
        self.accounts, self.measure, self.in_use = accounts, measure, in_use
        self.cold_store, self.prefix_store = cold_store, prefix_store
        self.evictions = 0  # idle sessions released (not spilled to the cold tier)
        self.segments_freed = 0  # kept branch states freed

    def free_one(self) -> bool:
        """Free the least needed states of an idle session; False: only ones in use are left."""
        idle = self.accounts.idle(self.in_use())
        keeping = [entry.session for entry in idle if entry.session.segment_count()]
        holding = [entry for entry in idle if entry.nbytes]
        if keeping:
            session = min(keeping, key=lambda kept: kept.oldest_segment_age())
            session.drop_oldest_segment()
            self.segments_freed += 1
        elif holding:
            session = min(holding, key=lambda entry: entry.last_used).session
            if self.cold_store is None or not self.cold_store.spill(session):
                session.release()
                self.evictions += 1
        else:
            return self.prefix_store is not None and self.prefix_store.evict_one()
        self.measure(session)
        return True
