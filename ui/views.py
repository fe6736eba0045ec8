"""Pure views: what the Chatbot and the stats line show for a conversation. No Gradio events."""

from __future__ import annotations

from typing import Any

from chat import TurnStats

THINKING_TITLE = "Thinking"
GENERATING = "generating… (Stop ends it and keeps what was written)"


def chatbot_messages(messages: list[dict], thinking_seconds: dict[int, float]) -> tuple[list[dict], list[int]]:
    """Chatbot messages for the history, and for each of them its index in `messages`."""
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
    return shown, index_of


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
    if stats is None:
        return ""
    parts = [
        f"reused **{stats.reused_tokens}** tokens",
        f"prefilled **{stats.prefilled_tokens}**",
        f"time to first token **{stats.ttft_s * 1000:.0f} ms**",
        f"**{stats.decode_tokens_per_s:.1f}** tokens/s",
        f"cache {stats.cache_tokens} tokens, {stats.cache_bytes / 2**20:.2f} MiB",
    ]
    if stats.shared_prefix_tokens:
        parts.append(f"{stats.shared_prefix_tokens} from the shared system prompt")
    if stats.rebuilt:
        parts.append("**rebuilt**: this conversation's cache had been freed")
    if stats.stopped:
        parts.append("stopped")
    return " · ".join(parts)


def version_label(active: int, count: int) -> str:
    return f"version **{active + 1} / {count}**" if count > 1 else ""


def version_note(index: int, count: int, restored: bool) -> str:
    how = ("switched without running the model: its cache was restored" if restored
           else "its cache will be rebuilt on the next turn")
    return f"Version {index + 1} / {count}: {how}."
