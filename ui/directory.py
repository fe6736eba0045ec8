"""Which conversation each browser has. Keys are made here and kept in the page's `gr.State`;
no key is ever taken from what a client says it is. A page's Gradio session hash finds its key
only to free it when the tab closes."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from cache_sessions.manager import SessionManager, TooManySessions
from chat import ChatEngine, Conversation, ServerBusyError


@dataclass
class BrowserChat:
    """What one browser owns: its conversation, how long each reply thought, the running stream."""

    conversation: Conversation
    thinking_seconds: dict[int, float] = field(default_factory=dict)
    running: Any = None  # the operation streaming now, to stop it

    @property
    def session(self):  # what the session manager measures and releases
        return self.conversation.session


class ChatDirectory:
    def __init__(self, engine: ChatEngine, *, budget_bytes: int | None = None, max_sessions: int | None = None,
                 idle_timeout_s: float | None = None):
        self.engine = engine
        self.manager = SessionManager(budget_bytes=budget_bytes, max_sessions=max_sessions,
                                      idle_timeout_s=idle_timeout_s, prefix_store=engine.prefix_store,
                                      on_close=self._forget_pages_of, extra_bytes=engine.scheduler.batch_bytes)
        self._key_of_page: dict[str, str] = {}
        self._lock = threading.Lock()

    def find(self, key: Any) -> BrowserChat | None:
        return self.manager.get(key)

    def chat(self, key: Any, system_prompt: str, *, fresh: bool = False) -> tuple[str, BrowserChat, str | None]:
        """This browser's chat, and a notice for the user if it is a new one. A new conversation
        starts when asked (`fresh`), when the system prompt changed, or when there is none."""
        system = system_prompt.strip()
        chat = self.manager.get(key)
        if chat is not None and not fresh and (chat.conversation.system_prompt or "") == system:
            return key, chat, None
        notice = None
        if chat is not None and not fresh and any(m["role"] != "system" for m in chat.conversation.messages):
            notice = "The system prompt changed: a new conversation was started."
        elif chat is None and isinstance(key, str):  # a key this server gave out, since expired
            notice = "Your session had expired: a new conversation was started."
        with self._lock:
            pages = [page for page, known in self._key_of_page.items() if known == key]
        self.manager.close(key)
        chat = BrowserChat(self.engine.conversation(system or None))
        try:
            new_key = self.manager.open(chat)
        except TooManySessions as error:
            raise ServerBusyError(str(error)) from error
        with self._lock:  # closing the tab frees the new conversation
            self._key_of_page.update({page: new_key for page in pages})
        return new_key, chat, notice

    def page_opened(self, page: str, key: str) -> None:
        with self._lock:
            self._key_of_page[page] = key

    def page_closed(self, page: str) -> None:
        with self._lock:
            key = self._key_of_page.pop(page, None)
        self.manager.close(key)

    def _forget_pages_of(self, key: str) -> None:
        with self._lock:
            for page in [page for page, known in self._key_of_page.items() if known == key]:
                del self._key_of_page[page]

    def pages(self) -> int:
        with self._lock:
            return len(self._key_of_page)
