"""What a control asks of the page's conversation, as plain data.

Every control of the page and every API endpoint makes one action from its checked inputs (the
event methods of `ChatHandlers`), and `ChatHandlers.act` is the one way from an action to the
conversation: UI event → action → conversation operation → cache session → model. Indices are
the history's (the shown path's message index), never the Chatbot's: `PageEvents` translates
the Chatbot's own events once. The reply-making actions are `chat.dialogue.operations`' own values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Union

from chat import ChatError, Continue, Edit, Operation, Regenerate, Send
from ui import inputs


@dataclass(frozen=True)
class Undo:
    """Step back before the last user message (it goes back into the box); the undone turn stays a branch."""


@dataclass(frozen=True)
class SelectVersion:
    """Show the last reply's previous (-1) or next (+1) version."""

    step: int


@dataclass(frozen=True)
class EditReply:
    """A reply's text written by hand: a new sibling of the reply at `index`."""

    index: int
    text: str


@dataclass(frozen=True)
class SwitchBranch:
    """Show sibling `branch` at message `index` and the path below it."""

    index: int
    branch: int


@dataclass(frozen=True)
class Clear:
    """New chat (the API's): the conversation is freed; the next message starts one."""


Instant = Union[Undo, SelectVersion, EditReply, SwitchBranch, Clear]
Action = Union[Operation, Instant]
REPLIES = (Send, Regenerate, Edit, Continue)  # the actions that stream a reply


def made(make: Callable[..., Action], *args: Any, **kwargs: Any) -> Action:
    """An action, checked as it is made (an empty message...): a refusal if it is not one."""
    try:
        return make(*args, **kwargs)
    except ChatError as error:
        raise inputs.refused(error) from None
