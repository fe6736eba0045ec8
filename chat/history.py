"""The canonical history: messages, and the versions of the last reply.

This is what the chat template renders; the cache follows it. Operations build a new list of
entries (the history a reply answers) and `record_*` installs it once the reply exists, so a
refused or failed operation leaves the history as it was.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Literal

from chat.errors import ConversationError, NotAUserMessageError, NothingToRegenerateError, NothingToUndoError

Message = dict[str, Any]
Role = Literal["system", "user", "assistant"]
MAX_VERSIONS = 8
_version_ids = itertools.count()


@dataclass
class ReplyVersion:
    """One reply to a user message: its text, its tokens and the prompt they continued."""

    content: str
    reasoning_content: str
    reply_ids: list[int]
    prompt_ids: list[int]
    opens_reasoning: bool
    stopped: bool
    uid: int = field(default_factory=lambda: next(_version_ids))


@dataclass
class Entry:
    """A history entry; an assistant entry holds its reply versions and which one is shown."""

    role: Role
    content: str = ""
    versions: list[ReplyVersion] = field(default_factory=list)
    active: int = 0

    @property
    def reply(self) -> ReplyVersion:
        return self.versions[self.active]

    def message(self) -> Message:
        if self.role != "assistant":
            return {"role": self.role, "content": self.content}
        return {"role": "assistant", "content": self.reply.content, "reasoning_content": self.reply.reasoning_content}


class History:
    def __init__(self, system_prompt: str | None = None):
        self.entries: list[Entry] = []
        if system_prompt is not None and system_prompt.strip():
            self.entries.append(Entry("system", system_prompt))

    # ---- views -------------------------------------------------------------------------------
    @property
    def messages(self) -> list[Message]:
        return [entry.message() for entry in self.entries]

    @property
    def system_prompt(self) -> str | None:
        return self.entries[0].content if self.entries and self.entries[0].role == "system" else None

    def last_reply(self) -> Entry | None:
        if self.entries and self.entries[-1].role == "assistant" and self.entries[-1].versions:
            return self.entries[-1]
        return None

    # ---- the history an operation answers (nothing changes until it is recorded) -------------
    def with_user_message(self, text: str) -> list[Entry]:
        return self.entries + [Entry("user", text)]

    def for_regeneration(self) -> list[Entry]:
        if self.entries and self.entries[-1].role == "assistant":
            return self.entries[:-1]
        if self.entries and self.entries[-1].role == "user":
            return list(self.entries)  # a user message left without a reply (failure)
        raise NothingToRegenerateError("there is no reply to regenerate")

    def with_edit(self, index: int, text: str) -> list[Entry]:
        if not 0 <= index < len(self.entries):
            raise NotAUserMessageError(f"no message at index {index!r}")
        if self.entries[index].role != "user":
            raise NotAUserMessageError(f"message {index} is a {self.entries[index].role} message, not a user one")
        return self.entries[:index] + [Entry("user", text)]

    def regenerates(self, history: list[Entry]) -> bool:
        """`history` answers the same messages as the current last reply (a new version of it)."""
        n = len(history)
        return (n == len(self.entries) - 1 and self.entries[n].role == "assistant"
                and all(a is b for a, b in zip(history, self.entries)))

    # ---- changes -----------------------------------------------------------------------------
    def record_reply(self, history: list[Entry], version: ReplyVersion, regenerates: bool) -> set[int]:
        """Install `history` + the new reply; returns the uids of the versions still kept."""
        old = self.entries[len(history)] if regenerates else None
        versions = ((old.versions if old else []) + [version])[-MAX_VERSIONS:]
        for entry in history:  # only the last reply keeps versions
            if entry.role == "assistant" and len(entry.versions) > 1:
                entry.versions, entry.active = [entry.reply], 0
        self.entries = history + [Entry("assistant", versions=versions, active=len(versions) - 1)]
        return {v.uid for v in versions}

    def record_continuation(self, history: list[Entry], version: ReplyVersion) -> None:
        """The last reply of `history`, extended: it keeps its place (and uid) among the versions."""
        entry = history[-1]
        version.uid = entry.reply.uid
        entry.versions[entry.active] = version
        self.entries = history

    def undo(self) -> None:
        users = [i for i, entry in enumerate(self.entries) if entry.role == "user"]
        if not users:
            raise NothingToUndoError("there is no user message to undo")
        del self.entries[users[-1]:]

    def version_entry(self, index: Any) -> Entry:
        """The last reply, checked to have a version `index`."""
        last = self.last_reply()
        if last is None or isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(last.versions):
            raise ConversationError(f"there is no reply version {index!r}")
        return last


def oldest_turn(history: list[Entry]) -> tuple[int, int] | None:
    """[start, end) of the oldest user turn and its replies, never the last user message."""
    users = [i for i, entry in enumerate(history) if entry.role == "user"]
    if len(users) < 2:
        return None
    return users[0], users[1]
