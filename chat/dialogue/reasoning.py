"""Splitting a streamed reply into reasoning (`<think>…</think>`) and answer text."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from chat.dialogue.templates import THINK_CLOSE, THINK_OPEN

DeltaKind = Literal["reasoning", "answer"]


@dataclass(frozen=True)
class Delta:
    """A piece of streamed text and whether it belongs to the reasoning or to the answer."""

    kind: DeltaKind
    text: str


def _partial_tag_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that could be the start of `tag`."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0


class ReasoningSplitter:
    """Feeds on text deltas, emits typed deltas; a tag split across deltas is held back.

    A `<think>` block is recognised only at the start of the reply (after whitespace); when the
    generation prompt already opened it, the reply starts inside the reasoning.
    """

    def __init__(self, starts_in_reasoning: bool = False):
        self.in_reasoning = starts_in_reasoning
        self.saw_block = starts_in_reasoning
        self.reasoning = ""
        self.answer = ""
        self._pending = ""

    def feed(self, text: str) -> list[Delta]:
        self._pending += text
        deltas: list[Delta] = []
        while self._pending:
            if self.in_reasoning:
                end = self._pending.find(THINK_CLOSE)
                if end >= 0:
                    self._emit(deltas, "reasoning", self._pending[:end])
                    self._pending = self._pending[end + len(THINK_CLOSE):]
                    self.in_reasoning = False
                    continue
                hold = _partial_tag_suffix(self._pending, THINK_CLOSE)
                self._emit(deltas, "reasoning", self._pending[: len(self._pending) - hold])
                self._pending = self._pending[len(self._pending) - hold:]
                break
            if not self.saw_block and not self.answer.strip():
                stripped = self._pending.lstrip()
                if stripped.startswith(THINK_OPEN):
                    self._emit(deltas, "answer", self._pending[: len(self._pending) - len(stripped)])
                    self._pending = stripped[len(THINK_OPEN):]
                    self.in_reasoning = self.saw_block = True
                    continue
                if THINK_OPEN.startswith(stripped):  # could still become "<think>"
                    break
            self._emit(deltas, "answer", self._pending)
            self._pending = ""
        return deltas

    def finish(self) -> list[Delta]:
        """Flush what was held back (the reply ended inside a partial tag)."""
        deltas: list[Delta] = []
        self._emit(deltas, "reasoning" if self.in_reasoning else "answer", self._pending)
        self._pending = ""
        return deltas

    def _emit(self, deltas: list[Delta], kind: DeltaKind, text: str) -> None:
        if not text:
            return
        if kind == "reasoning":
            self.reasoning += text
        else:
            self.answer += text
        deltas.append(Delta(kind, text))

    def message_fields(self) -> tuple[str, str]:
        """(content, reasoning_content) as stored in the history, cleaned as templates expect."""
        if not self.saw_block:
            return self.answer, ""
        return self.answer.lstrip(), self.reasoning.strip("\n")
