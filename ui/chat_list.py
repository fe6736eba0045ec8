"""The browser's list of conversations, kept in its own storage (`gr.BrowserState`).

The server holds caches only; each browser holds its conversations as `Conversation.to_dict()`
data, so a reload, Back or a reopened tab shows them again, and a server that no longer has a
conversation (restarted, expired, evicted) rebuilds it from what the browser sends. Nothing the
browser stores is trusted: the list is checked here, a conversation through `engine.restore`.

Per page, `parked` (a `gr.State`, on the server) maps list ids to the server keys of the
conversations not shown, so switching back to one whose cache the server still holds costs no
prefill. Ids in the list are the browser's names for its entries, never server keys.
"""

from __future__ import annotations

import atexit
import json
import re
import secrets
import shutil
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import gradio as gr

from chat import ChatError
from chat import saved
from ui import views
from ui.directory import BrowserChat, ChatDirectory
from ui.handlers import ChatHandlers
from ui.shared import client_of, page_of
from ui.outputs import ChatOutputs

MAX_CHATS = 50
MAX_TITLE_CHARS = 80
_ID = re.compile(r"[A-Za-z0-9_-]{8,40}")
STOP_WAIT_S = 5.0  # how long leaving a conversation waits for its stopped reply to end
SWEEP_AFTER_S = 60.0  # an export older than this was served (Gradio copies it as the event ends)


def empty_store() -> dict[str, Any]:
    return {"current": None, "chats": []}


def checked_store(value: Any) -> dict[str, Any]:
    """The browser's list with anything malformed left out (its conversations are checked when opened)."""
    if not isinstance(value, dict) or not isinstance(value.get("chats"), list):
        return empty_store()
    chats = []
    for entry in value["chats"][:MAX_CHATS]:
        if (isinstance(entry, dict) and isinstance(entry.get("id"), str) and _ID.fullmatch(entry["id"])
                and isinstance(entry.get("title"), str) and isinstance(entry.get("data"), dict)
                and not saved.nests_deeper(entry["data"], saved.MAX_NESTING)
                and all(entry["id"] != c["id"] for c in chats)):
            chats.append({"id": entry["id"], "title": entry["title"][:MAX_TITLE_CHARS],
                          "renamed": entry.get("renamed") is True, "data": entry["data"]})
    current = value.get("current")
    return {"current": current if any(c["id"] == current for c in chats) else None, "chats": chats}


def save_into(store: dict[str, Any], chat: BrowserChat) -> None:
    """The browser's copy of `chat`, first in the list (a new entry if the shown one has none)."""
    data = chat.conversation.to_dict()
    if not any(m["role"] == "user" for m in data["messages"]):
        return  # nothing said yet: not worth a place in the list
    entry = _entry(store, store["current"])
    if entry is None:
        entry = {"id": secrets.token_urlsafe(12), "title": "", "renamed": False}
        store["current"] = entry["id"]
        if len(store["chats"]) >= MAX_CHATS:
            dropped = store["chats"].pop()
            gr.Warning(f"This browser keeps {MAX_CHATS} conversations: the oldest, “{dropped['title']}”, "
                       "was removed from the list.")
    else:
        store["chats"].remove(entry)
    entry["data"] = data
    if not entry["renamed"]:
        entry["title"] = title_of(data)
    store["chats"].insert(0, entry)  # most recent first


def choices_of(store: dict[str, Any]) -> Any:
    return gr.update(choices=[(c["title"], c["id"]) for c in store["chats"]], value=store["current"])


def title_of(data: dict[str, Any]) -> str:
    first = next((m["content"] for m in data.get("messages", []) if m.get("role") == "user"), "New chat")
    first = " ".join(first.split())
    return first if len(first) <= MAX_TITLE_CHARS else first[: MAX_TITLE_CHARS - 1] + "…"


def markdown_of(data: dict[str, Any], title: str | None = None) -> str:
    """The shown path as Markdown (branches not shown are left out; the JSON export keeps them)."""
    history = saved.from_dict(data)
    lines = [f"# {title or title_of(data)}", ""]
    for message in history.messages:
        role = {"system": "System", "user": "User", "assistant": "Assistant"}[message["role"]]
        lines += [f"## {role}", ""]
        if message.get("reasoning_content"):
            lines += ["<details><summary>Thinking</summary>", "", message["reasoning_content"], "", "</details>", ""]
        lines += [message["content"], ""]
    return "\n".join(lines)


@dataclass
class ListOutputs:
    """What the list's own events change besides the chat: the stored list, the parked keys,
    the list shown, the delete confirmation, a file to download and the shown one's name."""

    store: Any = None
    parked: Any = None
    chats: Any = None
    confirm_delete: Any = None
    download: Any = None
    title: Any = None

    def to_gradio(self) -> tuple:
        return tuple(gr.skip() if value is None else value for value in
                     (self.store, self.parked, self.chats, self.confirm_delete, self.download, self.title))

    @classmethod
    def of(cls, store: dict[str, Any], parked: dict[str, str] | None = None, **changes: Any) -> "ListOutputs":
        """The list as it now stands, with the shown conversation's name in the rename box."""
        entry = _entry(store, store["current"])
        return cls(store=store, parked=parked, chats=choices_of(store),
                   title=entry["title"] if entry is not None else "", **changes)


class ChatList:
    def __init__(self, handlers: ChatHandlers):
        self.handlers = handlers
        self.directory = handlers.directory
        self.engine = handlers.engine
        self.files = ChatFiles(handlers.directory)

    # ---- around every conversation event -----------------------------------------------------
    def ensure(self, request: gr.Request, key: Any, store: Any) -> Any:
        """Before an event: the server rebuilds the shown conversation from the browser's copy
        when it no longer has it (a reload, a restart, an expiry). Returns the key to use."""
        recovered = self.recover(request, key, store)
        return gr.skip() if recovered is key else recovered

    def recover(self, request: gr.Request | None, key: Any, store: Any) -> Any:
        if self.directory.find(key) is not None:
            return key
        store = checked_store(store)
        entry = _entry(store, store["current"])
        if entry is None:
            return key
        try:
            new_key, _ = self.directory.restore(entry["data"], page=page_of(request), client=client_of(request))
        except ChatError as error:
            gr.Warning(f"This conversation could not be opened again: {error}")
            return key
        return new_key

    def sync(self, key: Any, store: Any) -> tuple:
        """After an event: the browser's copy of the shown conversation, brought up to date."""
        chat = self.directory.find(key)
        if chat is None or not chat.shown:
            return gr.skip(), gr.skip()
        store = checked_store(store)
        save_into(store, chat)
        return store, choices_of(store)

    # ---- the page and the list's own events -------------------------------------------------------
    def load(self, store: Any) -> tuple:
        """Page load: the conversation shown last, from the browser's copy (nothing made on the server)."""
        store = checked_store(store)
        return (*self._show_stored(store).to_gradio(), *ListOutputs.of(store).to_gradio())

    def open(self, chosen: Any, key: Any, store: Any, parked: Any) -> tuple:
        """Show another conversation of the list; the one left is kept (its reply, if one runs, stopped)."""
        store, parked = checked_store(store), dict(parked or {})
        if not isinstance(chosen, str) or _entry(store, chosen) is None or chosen == store["current"]:
            return (*ChatOutputs().to_gradio(), *ListOutputs().to_gradio())
        self._leave(key, store, parked)
        store["current"] = chosen
        return self._show(store, parked)

    def new_chat(self, key: Any, store: Any, parked: Any) -> tuple:
        """New chat: the current conversation stays in the list (a running reply is stopped and kept)."""
        store, parked = checked_store(store), dict(parked or {})
        self._leave(key, store, parked)
        store["current"] = None
        outputs = replace(self.handlers.empty(), textbox=gr.update(value="", placeholder=views.READY))
        return (*outputs.to_gradio(), *ListOutputs.of(store, parked).to_gradio())

    def rename(self, title: Any, store: Any) -> tuple:
        store = checked_store(store)
        entry = _entry(store, store["current"])
        text = " ".join(title.split())[:MAX_TITLE_CHARS] if isinstance(title, str) else ""
        if entry is None or not text:
            gr.Warning("Open a conversation and type its new name first.")
            return gr.skip(), gr.skip()
        entry["title"], entry["renamed"] = text, True
        return store, choices_of(store)

    def ask_delete(self) -> Any:
        return gr.update(visible=True)

    def delete(self, key: Any, store: Any, parked: Any) -> tuple:
        """Confirmed: the shown conversation leaves the list and the server."""
        store, parked = checked_store(store), dict(parked or {})
        entry = _entry(store, store["current"])
        self.directory.close(key)
        if entry is not None:
            store["chats"].remove(entry)
        store["current"] = None
        outputs = self.handlers.empty()
        outputs.stats = "Deleted." if entry is not None else ""
        listed = ListOutputs.of(store, parked, confirm_delete=gr.update(visible=False))
        return (*outputs.to_gradio(), *listed.to_gradio())

    def import_file(self, request: gr.Request, file: Any, key: Any, store: Any, parked: Any) -> tuple:
        """A JSON export, checked whole (`engine.restore`), opened as a new entry of the list."""
        store, parked = checked_store(store), dict(parked or {})
        path = getattr(file, "name", file)
        try:
            raw = read_once(path, saved.MAX_JSON_BYTES + 1) if isinstance(path, str) else b""
            data = saved.loads(raw)
            new_key, chat = self.directory.restore(data, page=page_of(request), client=client_of(request))
        except (ChatError, OSError) as error:
            gr.Warning(f"That file cannot be imported: {error}")
            return (*ChatOutputs().to_gradio(), *ListOutputs().to_gradio())
        self._leave(key, store, parked)
        store["current"] = None
        save_into(store, chat)
        outputs = self.handlers.view(new_key, chat, stats="Imported: its cache is computed at the next message.")
        return (*outputs.to_gradio(), *ListOutputs.of(store, parked).to_gradio())

    # ---- moving between conversations --------------------------------------------------------------
    def _leave(self, key: Any, store: dict[str, Any], parked: dict[str, str]) -> None:
        """The shown conversation goes to the list: a running reply is stopped (and kept), its
        latest state saved, its server key parked for a cheap return."""
        chat = self.directory.find(key)
        if chat is None:
            return
        chat.shown = False
        chat.conversation.stop()
        deadline = time.monotonic() + STOP_WAIT_S
        while chat.conversation.is_busy and time.monotonic() < deadline:
            time.sleep(0.02)
        save_into(store, chat)
        if store["current"] is not None:
            parked[store["current"]] = key
        for old in [name for name in parked if _entry(store, name) is None]:  # deleted or dropped entries
            self.directory.close(parked.pop(old))

    def _show(self, store: dict[str, Any], parked: dict[str, str]) -> tuple:
        current = store["current"]
        key = parked.pop(current, None)
        chat = self.directory.find(key)
        if chat is not None:  # the server still holds it: no prefill to come back
            chat.shown = True
            outputs = self.handlers.view(key, chat, stats="", system_prompt=chat.conversation.system_prompt or "")
        else:
            outputs = self._show_stored(store)
        return (*outputs.to_gradio(), *ListOutputs.of(store, parked).to_gradio())

    def _show_stored(self, store: dict[str, Any]) -> ChatOutputs:
        """The chat drawn from the browser's copy; the server makes the conversation at its next event."""
        outputs = self.handlers.empty()
        outputs.textbox = gr.update(placeholder=views.READY)
        entry = _entry(store, store["current"])
        if entry is None:
            return outputs
        try:
            history = saved.from_dict(entry["data"])
        except ChatError as error:
            gr.Warning(f"This conversation could not be opened: {error}")
            return outputs
        outputs.chat = views.path_messages(history.entries, {})[0]
        outputs.system_prompt = history.system_prompt or ""
        return outputs


def read_once(path: str, limit: int) -> bytes:
    """An uploaded file's first `limit` bytes; the file (Gradio's copy of the upload) is deleted."""
    try:
        with open(path, "rb") as file:
            return file.read(limit)
    finally:
        Path(path).unlink(missing_ok=True)


def _entry(store: dict[str, Any], chat_id: Any) -> dict[str, Any] | None:
    return next((c for c in store["chats"] if c["id"] == chat_id), None)


class ChatFiles:
    """Exports of the shown conversation, as files the page offers for download."""

    def __init__(self, directory: ChatDirectory):
        self.directory = directory
        self._files = Path(tempfile.mkdtemp(prefix="rewind-chat-exports-"))
        atexit.register(shutil.rmtree, self._files, True)

    def export(self, kind: str, key: Any, store: Any) -> Any:
        """The shown conversation as a file: JSON (the whole tree, `to_dict`) or Markdown (the shown
        path), always from a checked conversation: the server's, or the browser's copy once it
        passed the checks of an Import. Gradio serves its own copy of the file; ours goes soon."""
        self._sweep()
        chat = self.directory.find(key)
        store = checked_store(store)
        entry = _entry(store, store["current"])
        try:
            history = chat.conversation.history if chat is not None else \
                saved.from_dict(entry["data"]) if entry is not None else None
        except ChatError as error:
            gr.Warning(f"This conversation cannot be exported: {error}")
            return gr.skip()
        if history is None:
            gr.Warning("There is no conversation to export yet.")
            return gr.skip()
        data = saved.to_dict(history)
        title = entry["title"] if entry is not None and entry["title"] else title_of(data)
        text = json.dumps(data, ensure_ascii=False, indent=1) if kind == "json" else markdown_of(data, title)
        name = re.sub(r"[^A-Za-z0-9]+", "-", title).strip("-")[:40] or "conversation"
        folder = self._files / secrets.token_hex(8)
        folder.mkdir()
        path = folder / f"{name}.{'json' if kind == 'json' else 'md'}"
        path.write_text(text, encoding="utf-8")
        return gr.update(value=str(path), visible=True)

    def _sweep(self) -> None:
        """Exports Gradio has taken its copy of (it does as the event ends) are deleted."""
        now = time.time()
        for folder in list(self._files.iterdir()):
            if now - folder.stat().st_mtime > SWEEP_AFTER_S:
                shutil.rmtree(folder, ignore_errors=True)
