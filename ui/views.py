"""Pure views: what the Chatbot and the stats line show for a conversation. No Gradio events."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from chat import TurnStats
from ui.markup import safe_markdown

THINKING_TITLE = "Thinking"
GENERATING = "generating… (Stop or Esc ends it and keeps what was written)"
READY = "Message (Enter to send)"
LOADING = "Loading your settings and conversations…"  # until the page's load events have run (then READY)
CLEARED = "Cleared: this is a new chat. The one you left stays in the list (Delete there removes it)."
BUSY = "Type your next message: Enter keeps it and sends it when this reply ends"


def chatbot_messages(messages: list[dict], thinking_seconds: dict[int, float], marks: dict[int, str] | None = None,
                     navs: dict[int, Nav] | None = None, continuable: set[int] | None = None
                     ) -> tuple[list[dict], list[int | None]]:
    """Chatbot messages for the history, and for each of them its index in `messages` (None for
    a branch switcher). `marks` (message index -> a note such as "stopped") is shown under that
    reply, with the class `continuable` for the replies in `continuable` (the page enables
    Continue when the last message shown carries it); `navs` (message index -> its controls:
    "‹ 2 / 3 ›", ↻) adds them just above that message, as a message of its own so that editing
    the message never sees them."""
    marks, navs, continuable = marks or {}, navs or {}, continuable or set()
    shown: list[dict] = []
    index_of: list[int | None] = []
    for index, message in enumerate(messages):
        if index in navs:  # above the message: the last message shown stays a real one (Retry, Undo)
            label = "system prompt" if message["role"] == "system" else ""
            role = "assistant" if message["role"] == "assistant" else "user"
            shown.append({"role": role, "content": branch_switcher(index, navs[index], label)})
            index_of.append(None)
        if message["role"] == "system":  # not shown itself
            continue
        if message["role"] == "assistant" and message.get("reasoning_content"):
            metadata: dict[str, Any] = {"title": THINKING_TITLE, "status": "done"}
            if index in thinking_seconds:
                metadata["duration"] = round(thinking_seconds[index], 1)
            shown.append({"role": "assistant", "content": safe_markdown(message["reasoning_content"]),
                          "metadata": metadata})
            index_of.append(index)
        if message["role"] == "user":
            shown.append({"role": "user", "content": as_typed(message["content"])})
            index_of.append(index)
        elif message["content"] or not message.get("reasoning_content") or index in marks:
            # (a reply stopped while it thought: its mark, and Continue's class, under the fold)
            shown.append({"role": message["role"], "content": safe_markdown(message["content"])})
            index_of.append(index)
        else:  # only a Thinking block, folded: say that no answer came
            shown.append({"role": "assistant", "content": f"{MARK_OPEN.strip()}{NO_ANSWER}{MARK_CLOSE}"})
            index_of.append(None)  # nothing to edit there
        if index in marks and shown:
            opening = CONTINUABLE_MARK_OPEN if index in continuable else MARK_OPEN
            shown[-1] = {**shown[-1], "content": f"{shown[-1]['content']}{opening}{marks[index]}{MARK_CLOSE}"}
    return shown, index_of


MARK_OPEN, MARK_CLOSE = "\n\n<sub>", "</sub>"
CONTINUABLE_MARK_OPEN = '\n\n<sub class="continuable">'
TRAILING_MARK = re.compile(r'\n\n<sub(?: class="continuable")?>[^<]*</sub>\Z')
UNFINISHED = "unfinished: Continue goes on"  # a reply that did not end and was not stopped (its length ran out)


# What a person types is shown as typed: the chat renders Markdown, HTML and LaTeX, so a
# message with `<img ...>`, `**bold**` or `[link](javascript:...)` showed neither its characters nor
# (the sanitizer at work) anything that ran. Each character Markdown, HTML or the math delimiters
# act on goes as a numeric character reference, which no parser reads as syntax and the browser
# shows as the character (a backslash escape would not do: `\[` and `\(` open math here); so do
# the marks a line starts a heading or a list with, and leading spaces and tabs (an indented code
# block). Replies stay rendered.
_LITERAL = set("\\`*_[]|~$<>&")  # (an image needs `[`, so `!` may stay; parentheses too)
_LINE_START = re.compile(r"^([ \t]*)([#+\-=]|\d+[.)])", re.M)
_LEADING = re.compile(r"^([ \t]+)", re.M)
_REFERENCE = re.compile(r"&(#\d+|nbsp|Tab);")
_LEADING_AS = {" ": "&nbsp;", "\t": "&Tab;"}  # kept as they were typed (no collapse, no code block)


def as_typed(text: str) -> str:
    """`text` as Markdown that renders to exactly its characters (see above)."""
    escaped = "".join(f"&#{ord(char)};" if char in _LITERAL else char for char in text)
    escaped = _LINE_START.sub(lambda m: m.group(1) + m.group(2)[:-1] + f"&#{ord(m.group(2)[-1])};", escaped)
    return _LEADING.sub(lambda m: "".join(_LEADING_AS[char] for char in m.group(1)), escaped)


def typed_text(shown: str) -> str:
    """What `as_typed` was given, from what it made (an edit starts from the text shown): every
    `&` it wrote opens a reference, and every `&` typed became one."""
    return _REFERENCE.sub(lambda m: {"nbsp": " ", "Tab": "\t"}.get(m.group(1)) or chr(int(m.group(1)[1:])), shown)


def without_mark(text: str) -> str:
    """A reply's text as edited in the chat, less the note shown under it."""
    return TRAILING_MARK.sub("", text)
NO_ANSWER = "no answer after the thinking (Continue goes on if it was cut short; ↻ writes another)"
SWITCHER_CLASS = "branch-nav"


@dataclass(frozen=True)
class Nav:
    """The controls under a message: its branches "‹ 2 / 3 ›" (count > 1) and, for an earlier
    reply, ↻ to make a new one there (Gradio's own Retry is on the last message only)."""

    shown: int = 0
    count: int = 1
    retry: bool = False


def branch_switcher(index: int, nav: Nav, label: str = "") -> str:
    """Buttons the page's script turns into events (ui/page_assets.py), named by their text
    ("Previous branch", "Retry this reply": read by a screen reader, hidden on screen, where
    the page's style draws ‹ › ↻). The chat's sanitizer keeps classes, titles and roles, not data
    or aria attributes: the target is in the class."""
    def button(kind: str, target: str, name: str, usable: bool = True) -> str:
        return (f'<button class="branch-step {kind} {target}" title="{name}"{"" if usable else " disabled"}>'
                f'<span class="sr-only">{name}</span></button>')

    parts = [label] if label else []
    if nav.count > 1:
        before, after = nav.shown - 1, nav.shown + 1
        parts.append(f'{button("prev", f"bs-{index}-{before}", "Previous branch", before >= 0)} '
                     f'<span class="branch-count">{nav.shown + 1} / {nav.count}</span> '
                     f'{button("next", f"bs-{index}-{after}", "Next branch", after < nav.count)}')
    if nav.retry:
        parts.append(button("regen", f"br-{index}", "Retry this reply"))  # as Gradio's own Retry
    return f'<div class="{SWITCHER_CLASS}" role="group">{" ".join(parts)}</div>'


def branch_navs(entries: list[Any]) -> dict[int, Nav]:
    """The controls under each message of the shown path that has siblings, or is an earlier reply."""
    navs = {}
    for index, node in enumerate(entries):
        shown, count = node.parent.branches() if node.parent is not None else (0, 1)
        retry = node.role == "assistant" and index < len(entries) - 1
        if count > 1 or retry:
            navs[index] = Nav(shown, count, retry)
    return navs


def path_messages(path: list[Any]) -> tuple[list[dict], list[int | None]]:
    """`chatbot_messages` for a shown path of the history (its nodes), with its marks and controls."""
    return chatbot_messages([node.message() for node in path], thinking_of(path), reply_marks(path), branch_navs(path),
                            continuable_replies(path))


def thinking_of(path: list[Any]) -> dict[int, float]:
    """How long each reply of a shown path thought, by message index (the history keeps it)."""
    return {index: node.reply.thought_s for index, node in enumerate(path)
            if node.reply is not None and node.reply.thought_s is not None}


def reply_marks(entries: list[Any]) -> dict[int, str]:
    """Whether each reply was stopped, written by hand or left unfinished (its length ran out),
    by message index."""
    marks = {}
    for index, entry in enumerate(entries):
        if entry.role == "assistant" and entry.reply is not None:
            reply = entry.reply
            notes = [note for note, flag in (("stopped", reply.stopped), ("edited", reply.edited),
                                             (UNFINISHED, not (reply.ended or reply.stopped or reply.edited))) if flag]
            if notes:
                marks[index] = " · ".join(notes)
    return marks


def continuable_replies(entries: list[Any]) -> set[int]:
    """The replies Continue can extend, by message index: those the model did not end (5:
    Continue stayed enabled after a finished reply and then said there was nothing to continue)."""
    return {index for index, entry in enumerate(entries)
            if entry.role == "assistant" and entry.reply is not None and not entry.reply.ended}


def reply_messages(reasoning: str, answer: str, thought_for: float | None) -> list[dict]:
    """A reply while it streams: the reasoning (open until it ends), then the answer."""
    shown = []
    if reasoning:
        metadata: dict[str, Any] = {"title": THINKING_TITLE, "status": "done" if thought_for is not None else "pending"}
        if thought_for is not None:
            metadata["duration"] = round(thought_for, 1)
        shown.append({"role": "assistant", "content": safe_markdown(reasoning), "metadata": metadata})
    if answer or not reasoning:
        shown.append({"role": "assistant", "content": safe_markdown(answer)})
    return shown


def stats_line(stats: TurnStats | None) -> str:
    """What the last reply cost, in plain words; the cache details one click away."""
    if stats is None:
        return ""
    first = f"first token after **{stats.ttft_s * 1000:.0f} ms**"
    if stats.waited_s >= 0.05 and stats.waited_s > stats.ttft_s / 3:
        first += f" ({stats.waited_s * 1000:.0f} ms of it waiting for other replies)"
    prompt = (f"**Prompt:** {stats.reused_tokens} of {stats.prompt_tokens} tokens from the cache, "
              f"**{stats.prefilled_tokens} computed**" if stats.cache_reuse_known else
              f"**Prompt:** {stats.prompt_tokens} tokens (the model server did not say how many came from its cache)")
    parts = [
        prompt,
        first,
        f"**{stats.decode_tokens_per_s:.0f} tokens/s**",
        f"{stats.generated_tokens} tokens written",
    ]
    if stats.stopped:
        parts.append("**stopped** (Continue goes on from there)")
    if stats.rebuilt:
        parts.append("**rebuilt**: the server no longer held this conversation's cache (freed, restarted, or "
                     "reopened from this browser), so its history was computed again")
    details = [f"the cache holds {stats.cache_tokens} tokens ({stats.cache_bytes / 2**20:.2f} MiB)",
               f"rolled back by {stats.rollback}" if stats.rollback != "none" else "nothing rolled back"]
    if not stats.cache_tokens and not stats.cache_bytes:
        details = ["the cache lives on the model server"]
    if stats.shared_prefix_tokens:
        details.append(f"{stats.shared_prefix_tokens} tokens copied from the shared system prompt")
    if stats.dropped_turns:
        details.append(f"the {stats.dropped_turns} oldest turn(s) left out of the prompt to fit the context")
    return " · ".join(parts) + f"<details><summary>details</summary>{'; '.join(details)}.</details>"


UNDONE = ("Undone: your message is back in the box, and the turn is kept as a branch (‹ › next to the message "
          "you send instead). Nothing is recomputed now; the next message rolls the cache back to here.")


EDITED_REPLY = ("Reply edited: it is a new version of that reply (‹ › switches back). The next message or "
                "Continue goes on from its text.")


def branch_note(branch: int, count: int, restored: bool) -> str:
    how = ("switched without running the model: its cache was put back" if restored
           else "its cache will be computed on the next turn, from where it parts")
    return f"Branch {branch + 1} / {count}: {how}."


def version_label(active: int, count: int) -> str:
    return f"version **{active + 1} / {count}**" if count > 1 else ""


def version_note(index: int, count: int, restored: bool) -> str:
    how = ("switched without running the model: its cache was restored" if restored
           else "its cache will be rebuilt on the next turn")
    return f"Version {index + 1} / {count}: {how}."
