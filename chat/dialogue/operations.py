"""The operations that make a reply, as values: the app, the ZeroGPU path and the engine all
pass these, checked once when made. `Conversation.start(operation, options)` runs one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

from chat.errors import ConversationError, EmptyMessageError, NotAUserMessageError, NothingToRegenerateError


def checked_text(text: Any) -> str:
    if not isinstance(text, str):
        raise ConversationError(f"a message must be text, not {type(text).__name__}")
    if not text.strip():
        raise EmptyMessageError("the message is empty")
    return text


@dataclass(frozen=True)
class Send:
    """A new user message. With `fit_context`, the oldest turns are dropped (the system prompt
    stays) when the history would not fit the model's context."""

    text: str
    fit_context: bool = False

    def __post_init__(self) -> None:
        checked_text(self.text)


@dataclass(frozen=True)
class Regenerate:
    """A new sibling of the reply at `index` of `messages` (default: the last reply, or the
    missing reply to a trailing user message); what followed it stays on the old branch."""

    index: int | None = None
    fit_context: bool = False  # as `Send`'s (a reply whose prompt left turns out keeps its cut anyway)

    def __post_init__(self) -> None:
        if self.index is not None and (isinstance(self.index, bool) or not isinstance(self.index, int)):
            raise NothingToRegenerateError(f"no message at index {self.index!r}")


@dataclass(frozen=True)
class Edit:
    """A new sibling of the user message at `index` of `messages`, answered; the old one and
    what followed it stay on their branch."""

    index: int
    text: str
    fit_context: bool = False  # as `Send`'s

    def __post_init__(self) -> None:
        if isinstance(self.index, bool) or not isinstance(self.index, int):
            raise NotAUserMessageError(f"no message at index {self.index!r}")
        checked_text(self.text)


@dataclass(frozen=True)
class Continue:
    """Extend the last reply in the same turn: the cache goes on from where it stopped."""

    fit_context = False  # it continues the prompt its reply answered, turns left out as they were


Operation = Union[Send, Regenerate, Edit, Continue]
