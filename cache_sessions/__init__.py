"""Rollback-capable KV cache sessions. Knows nothing of chat, templates or UI.

Module map:
  session.py      CacheSession: the prompt-driven path (prepare / prefill / commit / extend), segments
  states.py       CacheStates: a DynamicCache, its layer kinds, checkpoints, segments; memory
  rollback.py     how each kind of cache layer rolls back (the only file that does)
  checkpoints.py  bounded-size snapshots at token positions, and the store that keeps them
  segments.py     the states a span of tokens added, cut out to be put back (reply versions)
  tensors.py      walking nested states: find, move and measure their tensors
  batch.py        several sessions' caches as one batched cache for decode steps, and back (one row: its own)
  prefixes.py     shared prefilled prefixes (system prompts) for new sessions
  manager.py      many sessions under one byte budget: LRU eviction of idle ones, limits, expiry
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
