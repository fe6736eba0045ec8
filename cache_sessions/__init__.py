"""Rollback-capable KV cache sessions. Knows nothing of chat, templates or UI, and runs no model
step (chat/model_step does).

Module map:
  session.py      CacheSession: the prompt-driven path (rewind_to / prefill / commit / extend), segments
  states.py       CacheStates: a DynamicCache, its layer kinds, checkpoints, segments; memory
  segmented.py    SegmentedStates: spans of states cut out and put back (versions, branches)
  rollback.py     how each kind of cache layer rolls back (the only file that does)
  checkpoints.py  bounded-size snapshots at token positions, and the store that keeps them
  segments.py     the states a span of tokens added, cut out to be put back (reply versions)
  tensors.py      walking nested states: find, move and measure their tensors
  branches.py     which messages a cache holds; keeping and putting back a branch's states
  prefixes.py     shared prefilled prefixes (system prompts) for new sessions
  owner.py        the one owner of every session's states: applies each change on the loop
  books.py        the owner's books: the sessions, their bytes, the budget, the loop's check
  eviction.py     what the budget frees first: kept branches, then idle sessions (cold tier), then prefixes
"""

from cache_sessions.checkpoints import Checkpoint, CheckpointStore
from cache_sessions.rollback import UnsupportedCacheLayer, layer_kinds, roll_back
from cache_sessions.session import CacheSession, PrefillResult, common_prefix_length
from cache_sessions.states import DEFAULT_MAX_CHECKPOINTS

__all__ = [
    "CacheSession",
    "DEFAULT_MAX_CHECKPOINTS",
    "Checkpoint",
    "CheckpointStore",
    "PrefillResult",
    "UnsupportedCacheLayer",
    "common_prefix_length",
    "layer_kinds",
    "roll_back",
]
