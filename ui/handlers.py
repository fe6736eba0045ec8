"""One method per UI event. Each finds the browser's conversation, runs one operation on it and
returns (or streams) `ChatOutputs`. Refusals are `ChatError`s: shown as a warning, nothing changed."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator

import gradio as gr

from chat import ChatError
from ui import inputs, views
from ui.directory import BrowserChat
from ui.operator import server_status
from ui.outputs import ChatOutputs
from ui.replies import ReplyEvents


class ChatHandlers(ReplyEvents):
    """One method per UI event: the generating ones (ui/replies.py) and the instant ones here.
    Each finds the browser's conversation, runs one operation on it and returns `ChatOutputs`."""

    # ---- instant events -------------------------------------------------------------------------
    def undo(self, key: Any, *values: Any) -> ChatOutputs:
        self.settings(values)
        if (chat := self.directory.find(key)) is None:
            gr.Warning("There is nothing to undo.")
            return self.empty()
        users = [m["content"] for m in chat.conversation.messages if m["role"] == "user"]
        try:
            chat.conversation.undo()
        except ChatError as error:
            gr.Warning(str(error))
            return self.view(key, chat)
        return self.view(key, chat, textbox=users[-1], stats=views.UNDONE)  # the message goes back in the box

    def select_version(self, step: int, key: Any, *values: Any) -> ChatOutputs:
        self.settings(values)
        if (chat := self.directory.find(key)) is None:
            gr.Warning("There is no reply to switch.")
            return self.empty()
        active, count = chat.conversation.versions
        try:
            restored = chat.conversation.select_version(active + step)
        except ChatError as error:
            gr.Warning(str(error))
            return self.view(key, chat)
        return self.view(key, chat, stats=views.version_note(active + step, count, restored))

    def edit_reply(self, index: Any, text: str, key: Any, *values: Any) -> ChatOutputs:
        """A reply's text written by hand: a new sibling of it; the next turn goes on from it."""
        self.settings(values)
        whole = inputs.whole_number(index, "index", 0, 1_000_000)
        text = inputs.text(text, "reply", self.limits.max_message_chars)
        if (chat := self.directory.find(key)) is None:
            gr.Warning("There is no conversation yet: send a message first.")
            return self.empty()
        try:
            chat.conversation.edit_reply(whole, text)
        except ChatError as error:
            gr.Warning(str(error))
            return self.view(key, chat)
        return self.view(key, chat, stats=views.EDITED_REPLY)

    def switch_branch(self, target: Any, key: Any, *values: Any) -> ChatOutputs:
        """`target` is "message index:branch", from a "‹ 2 / 3 ›" in the chat."""
        self.settings(values)
        index, branch = inputs.branch_target(target)
        if (chat := self.directory.find(key)) is None:
            gr.Warning("There is no conversation to switch.")
            return self.empty()
        try:
            restored = chat.conversation.switch_branch(index, branch)
        except ChatError as error:
            gr.Warning(str(error))
            return self.view(key, chat)
        count = chat.conversation.branches(index)[1]
        return self.view(key, chat, stats=views.branch_note(branch, count, restored),
                         system_prompt=(chat.conversation.system_prompt or "") if index == 0 else gr.skip())

    def clear(self, key: Any, *values: Any) -> ChatOutputs:
        """New chat: the old conversation (its reply stopped) is freed; the next message starts one."""
        self.settings(values)
        self.directory.close(key)
        return dataclasses.replace(self.empty(), textbox=gr.update(value="", placeholder=views.READY))

    def stop(self, key: Any) -> None:
        chat = self.directory.find(key)
        if chat is not None:
            chat.conversation.stop()


class PageEvents:
    """The Chatbot's own events (they carry the index of a shown message), page load and unload,
    and the operators' status endpoint."""

    def __init__(self, handlers: ChatHandlers, recover: Callable[[Any, Any, Any], Any] | None = None):
        """`recover(request, key, store)`: the key of the page's conversation, rebuilt from the
        browser's copy (`store`) when the server no longer has it (ui/chat_list.py)."""
        self.handlers = handlers
        self.directory = handlers.directory
        self.recover = recover or (lambda request, key, store: key)

    def on_retry(self, retry: gr.RetryData, request: gr.Request, key: Any, store: Any,
                 *values: Any) -> Iterator[ChatOutputs]:
        """Retry on a reply makes a new sibling of it; on a user message, a new branch there with
        the same text. Either way what followed stays on the old branch."""
        key = self.recover(request, key, store)
        chat = self.directory.find(key)
        index = self._conversation_index(chat, retry.index)
        if chat is None or index is None:
            yield from self.handlers.regenerate(request, key, *values)
            return
        messages = chat.conversation.messages
        if messages[index]["role"] == "assistant":
            yield from self.handlers.regenerate_at(request, index, key, *values)
        elif index >= max(i for i, m in enumerate(messages) if m["role"] == "user"):  # Gradio's Retry under
            yield from self.handlers.regenerate(request, key, *values)  # the last reply names its question
        else:
            yield from self.handlers.edit(request, index, messages[index]["content"], key, *values)

    def on_undo(self, undo: gr.UndoData, request: gr.Request, key: Any, store: Any, *values: Any) -> ChatOutputs:
        return self.handlers.undo(self.recover(request, key, store), *values)

    def on_edit(self, edited: gr.EditData, request: gr.Request, key: Any, store: Any,
                *values: Any) -> Iterator[ChatOutputs]:
        key = self.recover(request, key, store)
        chat = self.directory.find(key)
        index = self._conversation_index(chat, edited.index)
        if chat is None or index is None:
            gr.Warning("That message cannot be edited.")
            yield self.handlers.view(key, chat) if chat else ChatOutputs()
            return
        position = edited.index[0] if isinstance(edited.index, (list, tuple)) else edited.index
        shown = self.handlers.chatbot_messages(chat)[0][position]
        if shown.get("metadata"):  # the reply's thinking block
            gr.Warning("Only a reply's answer can be edited, not its thinking.")
            yield self.handlers.view(key, chat)
        elif chat.conversation.messages[index]["role"] == "assistant":
            yield self.handlers.edit_reply(index, edited.value, key, *values)
        else:
            yield from self.handlers.edit(request, index, edited.value, key, *values)

    def on_example(self, selected: gr.SelectData, request: gr.Request, key: Any, store: Any,
                   *values: Any) -> Iterator[ChatOutputs]:
        yield from self.handlers.send(request, selected.value["text"], key, *values)

    def _conversation_index(self, chat: BrowserChat | None, shown_index: Any) -> int | None:
        if chat is None:
            return None
        if isinstance(shown_index, (list, tuple)):
            shown_index = shown_index[0]
        index_of = self.handlers.chatbot_messages(chat)[1]
        return index_of[shown_index] if isinstance(shown_index, int) and 0 <= shown_index < len(index_of) else None

    def on_unload(self, request: gr.Request) -> None:
        """The tab closed (Gradio's heartbeat stopped): free its conversation now, not in an hour.
        The session hash is Gradio's; it only finds a key this server handed to that page."""
        if request is not None and request.session_hash:
            self.directory.page_closed(request.session_hash)

    def server_status(self) -> dict:
        """Aggregate numbers only (no session keys): what an operator of a shared Space needs."""
        return server_status(self.directory)
