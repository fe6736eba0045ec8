"""Where a conversation's replies come from: a small protocol, three implementations.

A `Conversation` plans (chat/dialogue/plans.py) and records (chat/dialogue/history.py); a `ReplySource` makes the
reply and keeps whatever states it has: the embedded engine (chat/backends/local.py: the scheduler and
the cache owner), an OpenAI-compatible server (chat/backends/served.py: no states here), or a ZeroGPU
worker process (chat/backends/remote.py: the engine's, in another process). What crosses between them is
plain data: a `ReplyRequest` in, text deltas and a `Reply` out.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Iterator, Literal, Protocol

from cache_sessions.branches import BranchKeep, BranchMove
from cache_sessions.rollback import RollbackHow
from cache_sessions.session import CacheSession
from chat.dialogue.history import Message, ReplyVersion
from chat.dialogue.options import GenerationOptions
from chat.dialogue.reasoning import Delta

ReplyKind = Literal["reply", "continue"]


@dataclass(frozen=True)
class ReplyRequest:
    """One reply to make: plain data (it crosses to a ZeroGPU worker)."""

    kind: ReplyKind  # "reply": a new reply (send, regenerate, edit); "continue": extend the last one
    messages: list[Message]  # the path answered, as the template takes it ("continue": ends with the reply)
    prompt_ids: list[int]
    opens_reasoning: bool  # the prompt leaves a <think> block open
    options: GenerationOptions
    labels: tuple[int, ...]  # the message ids the cache holds once the reply exists (the reply's included)
    earlier_ids: list[int] = field(default_factory=list)  # "continue": the reply's tokens so far
    keep: BranchKeep | None = None  # the shown branch this reply replaces: its states are kept
    # the tokens of earlier versions of this reply (a Retry's, an edited message's old answer):
    # the best guesses there are for draft-and-verify decoding (chat/scheduling/drafting.py)
    references: tuple[tuple[int, ...], ...] = ()


@dataclass(frozen=True)
class TurnStats:
    """What the last generating operation cost and reused."""

    reused_tokens: int
    prefilled_tokens: int
    generated_tokens: int
    rebuilt: bool
    ttft_s: float
    decode_tokens_per_s: float
    cache_tokens: int
    cache_bytes: int
    prompt_tokens: int = 0
    rollback: RollbackHow = "none"
    stopped: bool = False
    shared_prefix_tokens: int = 0
    dropped_turns: int = 0
    waited_s: float = 0.0  # from the request until its prefill began: waiting for other replies
    cache_reuse_known: bool = True  # False: a model server that did not say how much of its cache it used


@dataclass(frozen=True)
class Reply:
    version: ReplyVersion
    stats: TurnStats


class ReplyRun(Protocol):
    """One reply being made: iterate its deltas (closing early stops it), then `result()`."""

    def __iter__(self) -> Iterator[Delta]: ...

    def result(self) -> Reply | None:
        """The reply as far as it went (stopped or not); None when nothing began, so nothing is to
        be recorded. Raises what generation raised."""


class ReplySource(Protocol):
    session: CacheSession | None  # the states kept here for the conversation, if any

    def check(self, request: ReplyRequest) -> None:
        """Refuse (a `ConversationError`), before anything runs, what this source cannot do."""

    def reply(self, request: ReplyRequest, stop: threading.Event) -> ReplyRun: ...

    def move(self, move: BranchMove) -> bool:
        """The shown path changes: keep the branch left, put back the one arriving. True when the
        states of the one arriving are held (no forward pass needed up to the change)."""

    def close(self) -> None:
        """The conversation is gone: free its states (once its operation, if any, ended)."""


class ReplyStream:
    """The deltas of one reply; iterate it. `dropped_turns` (the oldest turns its prompt leaves
    out) is known before the first delta; `newly_dropped`: more than the reply before it left out
    (what is worth telling the person once, not at every turn past the context)."""

    def __init__(self, deltas: Iterator[Delta], dropped_turns: int, newly_dropped: bool = False):
        self._deltas = deltas
        self.dropped_turns = dropped_turns
        self.newly_dropped = newly_dropped

    def __iter__(self) -> "ReplyStream":
        return self

    def __next__(self) -> Delta:
        return next(self._deltas)

    def close(self) -> None:
        self._deltas.close()
