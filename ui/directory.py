"""Which conversation each browser has. Keys are made here and kept in the page's `gr.State`;
no key is ever taken from what a client says it is. A page's Gradio session hash finds the keys
this server handed to that page, only to free them when the tab closes; a client's address
counts what it holds, so one client cannot push everyone else out.

A conversation is created by the first message, never by a page load or a call that changes
nothing, so idle pages and cheap calls hold no memory and no session slot.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from chat.storage.sessions import SessionManager, TooManySessions
from chat import Conversation, ServerBusyError
from chat.in_flight import InFlight


class Closes:
    """A page's `gr.State` delete callback: closes the conversation its value names (or, for the
    book, every one it parked). An object, neither a bound method nor a closure: Gradio deep-copies
    component props for every page it serves (this copies as itself, not the directory, engine and
    model behind it) and lists them in /config (this shows as words, not a memory address)."""

    def __init__(self, directory: "ChatDirectory", *, parked: bool = False):
        self._directory, self._parked = directory, parked

    def __call__(self, value: Any) -> None:
        keys = list(getattr(value, "parked", {}).values()) if self._parked else [value]
        for key in keys:
            self._directory.close(key)

    def __deepcopy__(self, memo: dict) -> "Closes":
        return self

    def __repr__(self) -> str:
        return "closes the page's conversations"


@dataclass
class BrowserChat:
    """What one browser owns: its conversation, and where the page is with it."""

    conversation: Conversation
    client: str | None = None  # the address that opened it
    shown: bool = True  # False while the page shows another conversation of its list
    # events streaming into the page from it, each held while it streams: once none is, no update
    # of theirs is still on its way (a page's next view waits for that)
    streams: InFlight = field(default_factory=InFlight, repr=False)

    @property
    def busy(self) -> bool:  # what the session manager asks before it closes one for room
        return self.conversation.is_busy

    def close(self) -> None:
        """Its reply (if one runs) stopped; its cache freed once the reply ended."""
        self.conversation.close()


class ChatDirectory:
    def __init__(self, engine: Any, *, max_sessions: int | None = None, idle_timeout_s: float | None = None,
                 max_per_client: int | None = None):
        """`engine`: a `ChatEngine` or a `ServedEngine` (the same face). `max_per_client`:
        conversations one address may hold; at the limit its own least recently used idle one is
        closed to make room (never someone else's). The caches' memory budget is the engine's."""
        self.engine = engine
        self.max_per_client = max_per_client
        every = None if idle_timeout_s is None else min(60.0, max(idle_timeout_s / 4, 0.05))
        self.manager = SessionManager(max_sessions=max_sessions, idle_timeout_s=idle_timeout_s, on_close=self._forget,
                                      expire_every_s=every)
        self._keys_of_page: dict[str, set[str]] = {}
        self._keys_of_client: dict[str, list[str]] = {}  # oldest first
        self._lock = threading.Lock()
        self._opening = threading.Lock()  # held from a client's count to its record (`_open`)

    def find(self, key: Any) -> BrowserChat | None:
        return self.manager.get(key)

    def chat(self, key: Any, system_prompt: str, *, page: str | None = None,
             client: str | None = None) -> tuple[str, BrowserChat, str | None]:
        """The browser's chat for a new message, and a notice for the user if something changed.
        A new conversation starts when there is none; a changed system prompt starts a new branch
        at the root of the current one (refused while it is generating), the old one kept."""
        system = system_prompt.strip()
        chat = self.manager.get(key)
        if chat is not None:
            conversation, notice = chat.conversation, None
            if (conversation.system_prompt or "") != system:
                said = any(m["role"] != "system" for m in conversation.messages)
                conversation.set_system_prompt(system or None)  # refused (busy) while a reply runs
                if said:
                    notice = ("The system prompt changed: the conversation starts again on a new branch; the "
                              "earlier one is kept (‹ › at the top of the chat).")
            return key, chat, notice
        notice = "Your session had expired: a new conversation was started." if isinstance(key, str) else None
        new_key, chat = self._open(BrowserChat(self.engine.conversation(system or None, client=client), client=client), page)
        return new_key, chat, notice

    def restore(self, data: Any, *, page: str | None = None, client: str | None = None) -> tuple[str, BrowserChat]:
        """A conversation the browser kept (or a file), checked whole by `engine.restore`; its cache
        is computed at its next turn."""
        return self._open(BrowserChat(self.engine.restore(data, client=client), client=client), page)

    def branch_off(self, source: BrowserChat, data: Any, *, page: str | None = None,
                   client: str | None = None) -> tuple[str, BrowserChat]:
        """A new conversation of a path of `source` (saved data), its cache a copy of `source`'s
        where the engine can (`engine.branch_off`)."""
        return self._open(BrowserChat(self.engine.branch_off(source.conversation, data, client=client), client=client),
                          page)

    def take_over(self, key: Any, *, page: str | None = None, client: str | None = None) -> str | None:
        """Another page of the same person takes over an idle conversation, cache and all (a
        signed-in person opening it on another device): it moves to a new key held by that page;
        the page that had it finds nothing under its old key and rebuilds from its record if it
        goes on. None when there is no such idle conversation."""
        chat = self.manager.get(key)
        if chat is None or chat.busy:
            return None
        with self._opening:
            new_key = self.manager.rekey(key)
            if new_key is None:
                return None
            with self._lock:
                chat.client = client if client is not None else chat.client
                if chat.client is not None:
                    self._keys_of_client.setdefault(chat.client, []).append(new_key)
                if page is not None:
                    self._keys_of_page.setdefault(page, set()).add(new_key)
        return new_key

    def close(self, key: Any) -> None:
        """Free a conversation (New chat, a closed tab); a reply still running is stopped first."""
        self.manager.close(key)

    def page_closed(self, page: str) -> None:
        with self._lock:
            keys = self._keys_of_page.pop(page, set())
        for key in keys:
            self.close(key)

    def pages(self) -> int:
        with self._lock:
            return len(self._keys_of_page)

    def _open(self, chat: BrowserChat, page: str | None) -> tuple[str, BrowserChat]:
        """Count, make room, open and record as one step: opens are taken one at a time (they are
        cheap), so a client's count is never read by one open while another is between its count
        and its record (16 sends at once from one address kept 6 under a limit of 4).
        A lock of its own: closing one for room calls back into `_forget`, which takes
        `_lock`."""
        with self._opening:
            if chat.client is not None and self.max_per_client is not None:
                self._make_room_for(chat.client)
            try:
                key = self.manager.open(chat)
            except TooManySessions as error:
                raise ServerBusyError(str(error)) from error
            with self._lock:
                if chat.client is not None:
                    self._keys_of_client.setdefault(chat.client, []).append(key)
                if page is not None:  # closing the tab frees it
                    self._keys_of_page.setdefault(page, set()).add(key)
            return key, chat

    def _make_room_for(self, client: str) -> None:
        assert self.max_per_client is not None
        with self._lock:
            held = list(self._keys_of_client.get(client, []))
        if len(held) < self.max_per_client:
            return
        idle = [key for key in held if (chat := self.manager.get(key)) is not None and not chat.busy]
        if not idle:
            raise ServerBusyError(f"you already have {len(held)} conversations generating; wait for one to end")
        self.manager.close(idle[0])  # this client's own oldest

    def _forget(self, key: str) -> None:
        """A key stopped being valid (closed, expired, made room for): forget where it was held."""
        with self._lock:
            for keys in self._keys_of_page.values():
                keys.discard(key)
            self._keys_of_page = {page: keys for page, keys in self._keys_of_page.items() if keys}
            for client, keys in list(self._keys_of_client.items()):
                if key in keys:
                    keys.remove(key)
                if not keys:
                    del self._keys_of_client[client]
