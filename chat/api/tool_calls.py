"""Tool calls read out of a reply's answer: the `<tool_call>{"name": ..., "arguments": ...}</tool_call>`
blocks that Qwen's and Hermes' templates tell the model to write (the form vLLM's `hermes` parser
reads). The answer streams as content until a block opens; from there it is held, and at the end
read as calls, or, where a block is not a call, given as content after all (nothing is dropped).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as the API gives it
    id: str

    def as_dict(self, index: int | None = None) -> dict[str, Any]:
        call: dict[str, Any] = {"id": self.id, "type": "function",
                                "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


class ToolCallText:
    """Answer text in, the content to stream out; `finish` gives the calls and what is left."""

    def __init__(self) -> None:
        self.held = ""
        self.calling = False

    def feed(self, text: str) -> str:
        if self.calling:
            self.held += text
            return ""
        pending = self.held + text
        start = pending.find(OPEN)
        if start >= 0:
            self.calling, self.held = True, pending[start:]
            return pending[:start]
        keep = next((size for size in range(min(len(OPEN) - 1, len(pending)), 0, -1)
                     if OPEN.startswith(pending[-size:])), 0)
        self.held = pending[len(pending) - keep:] if keep else ""
        return pending[: len(pending) - keep]

    def finish(self) -> tuple[list[ToolCall], str]:
        """The calls, and content not yet given (the held text where it is not all calls)."""
        held, self.held = self.held, ""
        if not self.calling:
            return [], held
        calls, rest = [], _BLOCK.sub("", held).strip()
        for block in _BLOCK.findall(held):
            call = _read(block)
            if call is None:
                return [], held
            calls.append(call)
        return (calls, rest) if calls else ([], held)


def _read(block: str) -> ToolCall | None:
    try:
        value = json.loads(block)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", {})
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ToolCall(value["name"], text, "call_" + uuid.uuid4().hex[:24])
