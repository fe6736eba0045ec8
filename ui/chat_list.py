"""The browser's list of conversations: what each page event does with the browser's copy.

The copy itself (one record per conversation, merged by revision in the browser) is described in
ui/browser_copy.py. The server holds caches only; a server that no longer has the shown
conversation (restarted, expired, evicted, or another tab changed it) rebuilds it from the record
the page sends when asked (`ensure`, then `recover`). Per page, the `Book` (a `gr.State`) knows the
shown record and its revision, and the server keys of conversations the page left (parked), so
switching back to one whose cache the server still holds costs no prefill. Ids in the list are
the browser's names for its records, never server keys.
"""

from __future__ import annotations

import functools
import inspect
import json
import re
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator

import gradio as gr

from chat import ChatError
from chat.dialogue import saved
from ui import browser_copy, views
from ui.accounts import AccountCopy, account_of
from ui.browser_copy import Book, Probe, checked_book, checked_probe, checked_record, outbox, said_anything
from ui.directory import BrowserChat, ChatDirectory
from ui.handlers import ChatHandlers
from ui.shared import client_of, page_of
from ui.outputs import ChatOutputs

STOP_WAIT_S = 5.0  # how long leaving a conversation waits for its stopped reply to end


def markdown_of(data: dict[str, Any], title: str | None = None) -> str:
    """The shown path as Markdown (branches not shown are left out; the JSON export keeps them)."""
    history = saved.from_dict(data)
    lines = [f"# {title or browser_copy.title_of(data)}", ""]
    for message in history.messages:
        role = {"system": "System", "user": "User", "assistant": "Assistant"}[message["role"]]
        lines += [f"## {role}", ""]
        if message.get("reasoning_content"):
            lines += ["<details><summary>Thinking</summary>", "", message["reasoning_content"], "", "</details>", ""]
        lines += [message["content"], ""]
    return "\n".join(lines)


def choices_of(book: Book) -> Any:
    return gr.update(choices=list(zip(distinct_titles(book.index), [chat_id for chat_id, _ in book.index])),
                     value=book.current)


def distinct_titles(index: list[tuple[str, str]]) -> list[str]:
    """The list's labels, newest first: a title that several conversations share is numbered from
    its oldest, "What is 33 + 44? (2)" (six of one title in a row could not be told
    apart), so a label does not change when a newer one comes."""
    seen: dict[str, int] = {}
    labels = []
    for _, title in reversed(index):
        seen[title] = seen.get(title, 0) + 1
        labels.append(title if seen[title] == 1 else f"{title} ({seen[title]})")
    return labels[::-1]


@dataclass
class ListOutputs:
    """What the list's own events change besides the chat: the records to write, the page's
    book, the list shown, the delete confirmation and the shown one's name."""

    outbox: Any = None
    book: Any = None
    chats: Any = None
    confirm_delete: Any = None
    title: Any = None

    def to_gradio(self) -> tuple:
        return tuple(gr.skip() if value is None else value for value in
                     (self.outbox, self.book, self.chats, self.confirm_delete, self.title))

    @classmethod
    def of(cls, book: Book, *records: dict[str, Any], **changes: Any) -> "ListOutputs":
        """The list as it now stands, with the shown conversation's name in the rename box."""
        return cls(outbox=outbox(book, *records), book=book, chats=choices_of(book), title=book.title(book.current),
                   **changes)


class CopyKeeping:
    """Around every conversation event: the server gets the shown conversation back if it must
    (`ensure`, `recover`), a streaming reply is copied into the browser's copy as it goes (`copying_reply`), and
    the copy is brought up to date (`sync`)."""

    def __init__(self, handlers: ChatHandlers, account_copy: AccountCopy | None = None):
        self.handlers = handlers
        self.directory = handlers.directory
        self.account_copy = account_copy  # a signed-in page's records go to the store too (ui/accounts.py)

    def _keep(self, book: Book, record: dict[str, Any] | None, key: str | None = None) -> dict[str, Any] | None:
        """`record`, to give the browser; kept in the account's store too when the page is signed in
        (`key`: the server conversation it was written from)."""
        if self.account_copy is not None:
            self.account_copy.keep(book.account, record, key)
        return record

    def _taken_over(self, request: gr.Request, book: Book, record: dict[str, Any]) -> tuple[str, BrowserChat] | None:
        """Signed in: the server conversation another page of this account left in exactly the
        state of `record`, taken over with its cache (no rebuild on a second device)."""
        if self.account_copy is None:
            return None
        key = self.account_copy.live_key(book.account, record["id"])
        chat = self.directory.find(key)
        if chat is None or chat.busy or chat.conversation.snapshot() != record["data"]:
            return None
        new_key = self.directory.take_over(key, page=page_of(request), client=client_of(request))
        chat = self.directory.find(new_key)
        if new_key is None or chat is None:
            return None
        chat.shown = True
        self.account_copy.note_live(book.account, record["id"], new_key)
        return new_key, chat

    def ensure(self, probe: Any, key: Any, book: Any) -> tuple:
        """Before an event: whether the server must rebuild the shown conversation from the
        browser's record (it no longer has it, or another tab changed it). Returns the book and
        what to ask the page for (the record's id, or nothing)."""
        said, book = checked_probe(probe), checked_book(book)
        self._hear(said, book)
        if book.current is None:  # a new chat: its record's id, for the copies of its first reply
            book.current = browser_copy.new_id()
            return book, None
        chat, known = self.directory.find(key), book.revs.get(book.current)
        # this page's own draft of a reply that may still stream (a message typed ahead, a click
        # during it) is no other tab's change: rebuilding from it would stop that reply
        own = (known, book.copied.get(book.current))
        stale = said.current == book.current and said.rev is not None and said.rev not in own
        if said.rev is not None and (chat is None or stale):
            return book, {"id": book.current}
        return book, None

    def recover(self, request: gr.Request, record: Any, key: Any, book: Any) -> tuple:
        """The record `ensure` asked for, made a conversation again (checked as an Import)."""
        book, record = checked_book(book), checked_record(record)
        if record is None or record["id"] != book.current:
            return gr.skip(), gr.skip()
        try:
            new_key, chat = self._taken_over(request, book, record) \
                or self.directory.restore(record["data"], page=page_of(request), client=client_of(request))
        except ChatError as error:
            gr.Warning(f"This conversation could not be opened again: {error}")
            return gr.skip(), gr.skip()
        if self.directory.find(key) is not None:
            self.directory.close(key)  # an older copy of it (another tab changed it since)
        book.read(record, (new_key, chat.conversation.revision))
        return new_key, book

    def copying_reply(self, handler: Callable[..., Iterator[tuple]]) -> Callable[..., Iterator[tuple]]:
        """A generating event's stream with the browser's copy of its reply so far besides it
        (`key` and `book` as its last two inputs; the outbox as its last output): the whole
        record once, as the message shows (so it is in the browser before the reply streams),
        then with each update of the chat the reply's own text (a patch of that draft), so a
        reload mid-reply keeps what was on screen."""
        key_field = ChatOutputs.names().index("key")

        @functools.wraps(handler)
        def run(*args: Any) -> Iterator[tuple]:
            *args, key, book = args
            book, copied, patched = checked_book(book), None, None
            for outputs in handler(*args):
                key = outputs[key_field] if isinstance(outputs[key_field], str) else key
                chat = self.directory.find(key)
                if chat is None or not chat.shown or not book.current or not chat.conversation.is_running:
                    yield (*outputs, gr.skip())
                elif copied is None:
                    data = chat.conversation.snapshot()
                    if said_anything(data):
                        copied = browser_copy.record(book, book.current, data, draft=True)
                        yield (*outputs, outbox(book, copied))
                    else:
                        yield (*outputs, gr.skip())
                elif (reply := chat.conversation.reply_so_far()) is not None and reply != patched:
                    patched = reply
                    yield (*outputs, outbox(book, browser_copy.reply_patch(copied, reply)))
                else:
                    yield (*outputs, gr.skip())
        parameters = list(inspect.signature(handler).parameters.values())
        if all(parameter.kind is not inspect.Parameter.VAR_POSITIONAL for parameter in parameters):
            parameters += [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None)
                           for name in ("page_key", "page_book")]  # Gradio checks the inputs against it
            run.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
        return run

    def sync(self, key: Any, book: Any) -> tuple:
        """After an event: the shown conversation's record, if the event changed it."""
        book, chat = checked_book(book), self.directory.find(key)
        written = self._write(book, key, chat) if chat is not None and chat.shown else None
        if written is None:
            return gr.skip(), gr.skip(), gr.skip(), gr.skip()
        return outbox(book, written), book, choices_of(book), book.title(book.current)

    def _hear(self, said: Probe, book: Book) -> None:
        for notice in book.hear(said):
            gr.Warning(notice)

    def _write(self, book: Book, key: str, chat: BrowserChat) -> dict[str, Any] | None:
        """The shown conversation's record at the next revision; None when nothing changed since
        it was last written, or nothing was said yet."""
        if book.current is None or book.saved == (key, chat.conversation.revision):
            return None
        data = chat.conversation.snapshot()
        if not said_anything(data):
            return None
        written = browser_copy.record(book, book.current, data)
        book.saved = (key, chat.conversation.revision)
        return self._keep(book, written, key)


class ChatArrivals(CopyKeeping):
    """Conversations that arrive as new entries of the list (an Import, a branch off, a shared
    link's copy), and the moves between entries every list event shares: leaving the shown one
    (stopped, written, parked) and drawing one from its record. The base of `ChatList`."""

    def __init__(self, handlers: ChatHandlers, sharing: Any = None, account_copy: AccountCopy | None = None):
        super().__init__(handlers, account_copy)
        self.files = ChatFiles(handlers.directory, account_copy)
        self.sharing = sharing  # ui/sharing.py's Sharing: a shared link's snapshot, to continue in a new chat

    def branch_off(self, request: gr.Request, target: Any, key: Any, book: Any) -> tuple:
        """"Branch off into a new chat" at the shown message `target` (its place in the chat): a
        new entry of the list with the path up to that reply, or, at a message of the person,
        the path before it and the message in the box to send again or change. The new
        conversation's cache starts from a copy of this one's (`engine.branch_off`)."""
        book, chat = checked_book(book), self.directory.find(key)
        place = int(target) if isinstance(target, (int, str)) and str(target).isdigit() else None
        index = self.handlers.conversation_index(chat, place)
        if chat is None or index is None or chat.conversation.messages[index]["role"] == "system":
            gr.Warning("Choose a message or a reply to branch off from.")
            return (*ChatOutputs().to_gradio(), *ListOutputs().to_gradio())
        message = chat.conversation.messages[index]
        last = index if message["role"] == "assistant" else index - 1
        data = chat.conversation.snapshot()
        title = f"{book.title(book.current) or browser_copy.title_of(data)} (branch)"
        branch = saved.path_only({**data, "path": data["path"][:last + 1]})
        box = message["content"] if message["role"] == "user" else ""
        left = self._leave(key, book)
        if not any(item["role"] == "user" for item in branch["messages"]):  # nothing before it: a New chat
            outputs = replace(self.handlers.empty(), textbox=gr.update(value=box, placeholder=views.READY))
            book.current = None
            return (*outputs.to_gradio(), *ListOutputs.of(book, *left).to_gradio())
        new_key, new_chat = self.directory.branch_off(chat, branch, page=page_of(request), client=client_of(request))
        book.current = book.new_entry(title)
        written = self._write(book, new_key, new_chat)
        outputs = self.handlers.view(new_key, new_chat, stats="Branched off into a new chat: the one before is in "
                                     "the list, as it was.", system_prompt=new_chat.conversation.system_prompt or "",
                                     textbox=gr.update(value=box))
        return (*outputs.to_gradio(), *ListOutputs.of(book, *left, *([written] if written else [])).to_gradio())

    def import_text(self, request: gr.Request, text: Any, key: Any, book: Any) -> tuple:
        """A JSON export's text, read by the page from the file the person picked (None: none was),
        checked whole (`engine.restore`), opened as a new entry of the list. The text, not an
        upload: Gradio's upload hands back a path that the event then names, and any file of its
        upload folder could be named so (and was deleted once read)."""
        book = checked_book(book)
        if text is None:
            return (*ChatOutputs().to_gradio(), *ListOutputs().to_gradio())
        try:
            if not isinstance(text, str):
                raise saved.SavedConversationError("the page sent no file's text")
            data = saved.loads(text)
            several = saved.collected(data)
        except ChatError as error:
            gr.Warning(f"That file cannot be imported: {error}")
            return (*ChatOutputs().to_gradio(), *ListOutputs().to_gradio())
        if several is not None:
            records = self.files.collected(book, several, self._keep)
            return (*ChatOutputs().to_gradio(), *ListOutputs.of(book, *records).to_gradio())
        return self._opened(request, data, data.get("title") if isinstance(data, dict) else None, key, book,
                            stats="Imported: its cache is computed at the next message.",
                            refused="That file cannot be imported")

    def _opened(self, request: gr.Request, data: Any, title: Any, key: Any, book: Book, *also: dict[str, Any],
                stats: str, refused: str, **changes: Any) -> tuple:
        """Saved data (an Import, a shared link's snapshot), checked whole (`engine.restore`), shown
        as a new entry of the list under `title` if it has one."""
        try:
            new_key, chat = self.directory.restore(data, page=page_of(request), client=client_of(request))
        except (ChatError, OSError) as error:
            gr.Warning(f"{refused}: {error}")
            return (*ChatOutputs().to_gradio(), *ListOutputs().to_gradio())
        left = self._leave(key, book)
        book.current = book.new_entry(title)  # the name it was exported or shared with, if any
        written = self._write(book, new_key, chat)
        outputs = self.handlers.view(new_key, chat, stats=stats, system_prompt=chat.conversation.system_prompt or "",
                                     **changes)  # its own system prompt
        return (*outputs.to_gradio(), *ListOutputs.of(book, *also, *left, *([written] if written else [])).to_gradio())

    # ---- moving between conversations --------------------------------------------------------------
    def _leave(self, key: Any, book: Book) -> list[dict[str, Any]]:
        """The shown conversation goes to the list: a running reply is stopped (and kept), its
        latest state written, its server key parked for a cheap return. Returns what to write."""
        chat = self.directory.find(key)
        if chat is None:
            return []
        chat.shown = False
        chat.conversation.stop()
        deadline = time.monotonic() + STOP_WAIT_S
        while (chat.conversation.is_busy or chat.streams.count) and time.monotonic() < deadline:
            time.sleep(0.02)  # its stream ends too: no update of it can arrive after this page's next view
        written = self._write(book, key, chat)
        if book.current is not None and any(entry == book.current for entry, _ in book.index):
            book.parked[book.current] = key
        else:
            self.directory.close(key)  # nothing said in it: nothing to come back to
        listed = {entry for entry, _ in book.index}
        for old in [name for name in book.parked if name not in listed]:  # deleted or dropped entries
            self.directory.close(book.parked.pop(old))
        book.saved = None
        return [written] if written else []

    def _drawn(self, record: dict[str, Any], outputs: ChatOutputs) -> ChatOutputs:
        """The chat drawn from a record; the server makes the conversation at its next event."""
        try:
            history = saved.from_dict(record["data"])
        except ChatError as error:
            gr.Warning(f"This conversation could not be opened: {error}")
            return outputs
        outputs.chat = views.path_messages(history.entries)[0]
        outputs.system_prompt = history.system_prompt or ""
        outputs.applied_prompt = {"prompt": outputs.system_prompt}
        return outputs


class ChatList(ChatArrivals):
    """The list's own events: the page's load, another tab's change, open, New chat, rename,
    delete, import (and, through `files`, export)."""

    def load(self, request: gr.Request, profile: gr.OAuthProfile | None, probe: Any, book: Any) -> tuple:
        """Page load: the conversation this tab showed, from the browser's record (nothing made on
        the server until the next event), and the list; or, opened from a shared link's "Continue
        in a new chat", a copy of its snapshot as a new entry. Signed in: the account's records
        this browser lacks come with it. An event of this page that began first (a quick first
        message) is left as it is."""
        said, book = checked_probe(probe), checked_book(book)
        if book.current is not None or book.revs:
            return (*ChatOutputs().to_gradio(), *ListOutputs().to_gradio())
        self._hear(said, book)
        book.account = account_of(profile)
        from_account = self.account_copy.at_load(book, said.revs) if self.account_copy else []
        for record in from_account:  # the account's is newer than what this browser showed
            if said.record is not None and record["id"] == said.record["id"]:
                said.record = None if record.get("deleted") else record
        if said.share is not None and self.sharing is not None:
            found = self.sharing.snapshot(said.share)
            if found is not None:
                return self._opened(request, found[1], found[0], None, book, *from_account,
                                    stats="A copy of the shared conversation: yours to go on with. Its cache is "
                                    "computed at your next message.",
                                    refused="That shared conversation cannot be opened",
                                    textbox=gr.update(placeholder=views.READY))
            gr.Warning("That shared link leads nowhere: it was revoked, or never made.")
        outputs = self.handlers.empty()
        outputs.textbox = gr.update(placeholder=views.READY)
        if said.record is not None and said.record["id"] == said.current:
            outputs = self._drawn(said.record, outputs)
            if outputs.chat:  # drawn (else a warning said why)
                book.current = said.record["id"]
                book.read(said.record)
                pending = said.pending_prompt
                if pending and pending[0] == book.current and len(pending[1]) <= self.handlers.limits.max_system_chars:
                    outputs.system_prompt = pending[1]  # typed before the reload, still not applied
        listed = ListOutputs.of(book, *from_account)
        if not from_account:
            listed.outbox = None  # nothing to write
        return (*outputs.to_gradio(), *listed.to_gradio())

    def refresh(self, probe: Any, book: Any) -> tuple:
        """Another tab changed the list (or this one kept a copy): show it as the browser has it."""
        book = checked_book(book)
        self._hear(checked_probe(probe), book)
        return book, choices_of(book)

    def open(self, request: gr.Request, chosen: Any, probe: Any, key: Any, book: Any) -> tuple:
        """Show another conversation of the list; the one left is kept (its reply, if one runs, stopped)."""
        said, book = checked_probe(probe), checked_book(book)
        chosen = browser_copy.checked_id(chosen)
        record = said.record if said.record is not None and said.record["id"] == chosen else None
        if chosen is None or chosen == book.current or record is None:
            if chosen is not None and chosen != book.current:
                gr.Warning("That conversation is no longer kept in this browser.")
            return (*ChatOutputs().to_gradio(), *ListOutputs(book=book, chats=choices_of(book)).to_gradio())
        left = self._leave(key, book)
        book.current = chosen
        parked_key = book.parked.pop(chosen, None)
        chat = self.directory.find(parked_key)
        if chat is not None and book.revs.get(chosen) == record["rev"]:  # the server still holds it: no prefill
            chat.shown = True
            book.saved = (parked_key, chat.conversation.revision)
            outputs = self.handlers.view(parked_key, chat, stats="",
                                         system_prompt=chat.conversation.system_prompt or "")
        else:
            self.directory.close(parked_key)
            outputs = self._drawn(record, self.handlers.empty())
            book.read(record)
        return (*outputs.to_gradio(), *ListOutputs.of(book, *left).to_gradio())

    def new_chat(self, key: Any, book: Any, stats: str = "") -> tuple:
        """New chat: the current conversation stays in the list (a running reply is stopped and kept).
        The box is left as it is: a message typed while this ran is sent to the new chat once it is
        there (the page holds it), not emptied by this event's answer."""
        book = checked_book(book)
        left = self._leave(key, book)
        book.current = None
        outputs = replace(self.handlers.empty(), textbox=gr.update(placeholder=views.READY), stats=stats)
        return (*outputs.to_gradio(), *ListOutputs.of(book, *left).to_gradio())

    def clear(self, key: Any, book: Any) -> tuple:
        """The chat's trash button: a New chat that says so (it blanked only the view, and the next
        message went on with the old conversation). Nothing is deleted: that is the
        list's Delete, with its confirmation."""
        return self.new_chat(key, book, stats=views.CLEARED)

    def rename(self, title: Any, book: Any) -> tuple:
        book = checked_book(book)
        text = browser_copy.checked_title(title)
        if book.current is None or all(entry != book.current for entry, _ in book.index):
            gr.Warning("Open a conversation and type its new name first.")
            return gr.skip(), gr.skip(), gr.skip()
        if not text:  # one is open (this said "open a conversation first")
            gr.Warning("A name cannot be empty: type one, then Rename.")
            return gr.skip(), gr.skip(), gr.skip()
        return outbox(book, self._keep(book, browser_copy.rename(book, book.current, text))), book, choices_of(book)

    def delete(self, key: Any, book: Any) -> tuple:
        """Confirmed: the shown conversation leaves the list (a tombstone, so no tab brings it back)
        and the server."""
        book = checked_book(book)
        self.directory.close(key)
        listed = book.current is not None and any(entry == book.current for entry, _ in book.index)
        records = [self._keep(book, browser_copy.tombstone(book, book.current))] if listed and book.current else []
        book.current, book.saved = None, None
        outputs = self.handlers.empty()
        outputs.stats = "Deleted." if records else ""
        return (*outputs.to_gradio(), *ListOutputs.of(book, *records, confirm_delete=gr.update(visible=False))
                .to_gradio())


class ChatFiles:
    """Exports of the shown conversation, downloaded by the page at once:
    before, a "Download" box appeared at the sidebar's foot, below the fold with a long list, and
    went on offering the file of a conversation the person had since left. And "Export all"."""

    def __init__(self, directory: ChatDirectory, account_copy: AccountCopy | None = None):
        self.directory, self.account_copy = directory, account_copy

    @staticmethod
    def collected(book: Book, conversations: list[Any],
                  keep: Callable[[Book, dict[str, Any]], dict[str, Any] | None]) -> list[dict[str, Any]]:
        """An "Export all" file: each conversation checked whole and written to the list as a
        record of its own (the server makes none until one is opened); the shown chat stays."""
        records, refused = [], []
        for number, data in enumerate(conversations[:browser_copy.MAX_CHATS], 1):
            try:
                saved.from_dict(data)
            except ChatError as error:
                refused.append(f"conversation {number}: {error}")
                continue
            chat_id = book.new_entry(data.get("title"))
            records.append(keep(book, browser_copy.record(book, chat_id, data)))
        for problem in refused[:3]:
            gr.Warning(f"Not imported: {problem}")
        skipped = len(conversations) - browser_copy.MAX_CHATS
        gr.Info(f"Imported {len(records)} conversation{'s' * (len(records) != 1)}"
                + (f" (this browser keeps {browser_copy.MAX_CHATS}: the last {skipped} were left out)."
                   if skipped > 0 else "."))
        return records

    def export_all(self, profile: gr.OAuthProfile | None) -> Any:
        """Signed in: every conversation of the account, from the store. Otherwise the page makes
        the file itself from its browser's records (`EXPORT_ALL` in ui/wiring.py): they are there."""
        account = account_of(profile)
        if account is None or self.account_copy is None:
            return {"from_browser": True}
        conversations = [{**record["data"], "title": record["title"]}
                         for record in self.account_copy.records.all(account)]
        if not conversations:
            gr.Warning("There is no conversation to export yet.")
            return gr.skip()
        return {"name": "rewind-chat-all.json", "type": "application/json",
                "text": json.dumps(saved.collection(conversations), ensure_ascii=False, indent=1)}

    def export(self, kind: str, key: Any, book: Any) -> Any:
        """The shown conversation as a file for the page to download (`DOWNLOAD` in ui/wiring.py):
        its name, its type and its text. JSON is the whole tree (`to_dict`, with its name),
        Markdown the shown path; from the server's conversation (the event's `ensure` rebuilt it
        from the browser's record if need be). Nothing is written to disk."""
        book, chat = checked_book(book), self.directory.find(key)
        data = chat.conversation.snapshot() if chat is not None else None
        if data is None or not said_anything(data):
            gr.Warning("There is no conversation to export yet.")
            return gr.skip()
        title = book.title(book.current) or browser_copy.title_of(data)
        json_kind = kind == "json"
        text = json.dumps({**data, "title": title}, ensure_ascii=False, indent=1) if json_kind \
            else markdown_of(data, title)
        name = re.sub(r"[^A-Za-z0-9]+", "-", title).strip("-")[:40] or "conversation"
        return {"name": f"{name}.{'json' if json_kind else 'md'}", "text": text,
                "type": "application/json" if json_kind else "text/markdown"}
