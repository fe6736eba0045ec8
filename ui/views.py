"""Pure views: what the Chatbot and the stats line show for a conversation. No Gradio events."""

from __future__ import annotations

from typing import Any

from chat import TurnStats

THINKING_TITLE = "Thinking"
GENERATING = "generating… (Stop or Esc ends it and keeps what was written)"
READY = "Message (Enter to send)"
BUSY = "A reply is being written: Stop (or Esc) first, or wait for it to end"


def chatbot_messages(messages: list[dict], thinking_seconds: dict[int, float],
                     marks: dict[int, str] | None = None) -> tuple[list[dict], list[int]]:
    """Chatbot messages for the history, and for each of them its index in `messages`. `marks`
    (message index -> a note such as "version 2 of 3 · stopped") is shown under that reply."""
    marks = marks or {}
    shown: list[dict] = []
    index_of: list[int] = []
    for index, message in enumerate(messages):
        if message["role"] == "system":
            continue
        if message["role"] == "assistant" and message.get("reasoning_content"):
            metadata: dict[str, Any] = {"title": THINKING_TITLE, "status": "done"}
            if index in thinking_seconds:
                metadata["duration"] = round(thinking_seconds[index], 1)
            shown.append({"role": "assistant", "content": message["reasoning_content"], "metadata": metadata})
            index_of.append(index)
        if message["role"] == "user" or message["content"] or not message.get("reasoning_content"):
            shown.append({"role": message["role"], "content": message["content"]})
            index_of.append(index)
        if index in marks and shown:
            shown[-1] = {**shown[-1], "content": f"{shown[-1]['content']}{MARK_OPEN}{marks[index]}{MARK_CLOSE}"}
    return shown, index_of


MARK_OPEN, MARK_CLOSE = "\n\n<sub>", "</sub>"


def reply_marks(entries: list[Any]) -> dict[int, str]:
    """Which version each reply shows, and whether it was stopped, by message index."""
    marks = {}
    for index, entry in enumerate(entries):
        if entry.role == "assistant" and entry.reply is not None:
            siblings = len(entry.parent.children) if entry.parent is not None else 1
            notes = [f"version {(entry.parent.active or 0) + 1} of {siblings}"] if siblings > 1 else []
            if entry.reply.stopped:
                notes.append("stopped")
            if notes:
                marks[index] = " · ".join(notes)
    return marks


def reply_messages(reasoning: str, answer: str, thought_for: float | None) -> list[dict]:
    """A reply while it streams: the reasoning (open until it ends), then the answer."""
    shown = []
    if reasoning:
        metadata: dict[str, Any] = {"title": THINKING_TITLE, "status": "done" if thought_for is not None else "pending"}
        if thought_for is not None:
            metadata["duration"] = round(thought_for, 1)
        shown.append({"role": "assistant", "content": reasoning, "metadata": metadata})
    if answer or not reasoning:
        shown.append({"role": "assistant", "content": answer})
    return shown


def stats_line(stats: TurnStats | None) -> str:
    """What the last reply cost, in plain words; the cache details one click away."""
    if stats is None:
        return ""
    first = f"first token after **{stats.ttft_s * 1000:.0f} ms**"
    if stats.waited_s >= 0.05 and stats.waited_s > stats.ttft_s / 3:
        first += f" ({stats.waited_s * 1000:.0f} ms of it waiting for other replies)"
    parts = [
        f"**Prompt:** {stats.reused_tokens} of {stats.prompt_tokens} tokens from the cache, "
        f"**{stats.prefilled_tokens} computed**",
        first,
        f"**{stats.decode_tokens_per_s:.0f} tokens/s**",
        f"{stats.generated_tokens} tokens written",
    ]
    if stats.stopped:
        parts.append("**stopped** (Continue goes on from there)")
    if stats.rebuilt:
        parts.append("**rebuilt**: this conversation's cache had been freed, so its history was computed again")
    details = [f"the cache holds {stats.cache_tokens} tokens ({stats.cache_bytes / 2**20:.2f} MiB)",
               f"rolled back by {stats.rollback}" if stats.rollback != "none" else "nothing rolled back"]
    if stats.shared_prefix_tokens:
        details.append(f"{stats.shared_prefix_tokens} tokens copied from the shared system prompt")
    if stats.dropped_turns:
        details.append(f"{stats.dropped_turns} oldest turn(s) dropped to fit the context")
    return " · ".join(parts) + f"<details><summary>details</summary>{'; '.join(details)}.</details>"


UNDONE = ("Undone: the message and its reply are gone. Nothing is recomputed now; the next message rolls the "
          "cache back to here.")


def version_label(active: int, count: int) -> str:
    return f"version **{active + 1} / {count}**" if count > 1 else ""


def version_note(index: int, count: int, restored: bool) -> str:
    how = ("switched without running the model: its cache was restored" if restored
           else "its cache will be rebuilt on the next turn")
    return f"Version {index + 1} / {count}: {how}."
