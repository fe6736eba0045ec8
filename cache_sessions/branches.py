"""Branches: keeping the states of the branch a conversation leaves, and putting back those of
the one it arrives at, with no forward pass.

A session records, beside its token ledger, the labels of the messages its tokens render
(`CacheSession.labels`, names its owner chooses), and each kept segment the labels of the
messages it covers. Labels only decide what to keep and what to put back. Whether states are
right is decided by the token ledger alone: a segment goes back with its token ids, and a
rollback below a segment's start drops it, so a wrong label can cost a prefill, never exactness.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Sequence

from cache_sessions.session import CacheSession, common_prefix_length


@dataclass(frozen=True)
class BranchMove:
    """The shown path (`shown`, labels) is about to become `target`, which differs from message
    `index` on; `target_ids` renders the target path (no generation prompt). Plain data: made
    by the conversation, applied by the cache owner."""

    shown: list[Hashable]
    target: list[Hashable]
    index: int
    target_ids: list[int]


@dataclass(frozen=True)
class BranchKeep:
    """Before a reply replaces the shown path from message `index` on: keep what the cache holds
    of it, to switch back to."""

    shown: list[Hashable]
    index: int


def move_branch(session: CacheSession, move: BranchMove) -> bool:
    """Keep the shown branch's states at `index` and put back the target's, where kept. True
    when the cache then holds the target's branch at `index` (no prefill up to there)."""
    if move.shown == move.target:
        return holds(session, move.target[: move.index + 1])
    arriving = move.target[move.index] if move.index < len(move.target) else None
    start = common_prefix_length(session.token_ids, move.target_ids)
    if arriving is not None and (kept := session.segment_start(arriving)) is not None:
        start = min(start, kept)  # restoring rolls back there: what is kept now must survive it
    _keep(session, move.shown, move.index, session.reachable(start))
    if arriving is None:
        return True
    if session.restore_segment(arriving, move.target[: move.index]):
        return True
    return holds(session, move.target[: move.index + 1])


def keep_before_reply(session: CacheSession, keep: BranchKeep, prompt_ids: Sequence[int], whole: bool = False
                      ) -> None:
    """What `rewind_to(prompt_ids, whole=whole)` is about to roll back of the shown branch, kept
    under its label."""
    _keep(session, keep.shown, keep.index, session.reachable(session.rollback_target(prompt_ids, whole)))


def holds(session: CacheSession, labels: Sequence[Hashable]) -> bool:
    """Whether the cache holds the messages `labels` (a path from the start)."""
    return bool(session.token_ids) and session.labels[: len(labels)] == list(labels)


def _keep(session: CacheSession, shown: list[Hashable], index: int, start: int) -> None:
    if index < len(shown) and holds(session, shown[: index + 1]):
        session.stash_segment(shown[index], start, session.labels[index:])
