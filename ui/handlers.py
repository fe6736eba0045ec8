"""One method per UI event. Each finds the browser's conversation, runs one operation on it and
returns (or streams) `ChatOutputs`. A refusal raises `inputs.refused` before anything changed."""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator

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
            raise inputs.refused("There is nothing to undo.")
        users = [m["content"] for m in chat.conversation.messages if m["role"] == "user"]
        try:
            chat.conversation.undo()
        except ChatError as error:
            raise inputs.refused(error) from None
        return self.view(key, chat, textbox=users[-1], stats=views.UNDONE)  # the message goes back in the box

    def select_version(self, step: int, key: Any, *values: Any) -> ChatOutputs:
        self.settings(values)
        if (chat := self.directory.find(key)) is None:
            raise inputs.refused("There is no reply to switch.")
        active, count = chat.conversation.versions
        try:
            restored = chat.conversation.select_version(active + step)
        except ChatError as error:
            raise inputs.refused(error) from None
        return self.view(key, chat, stats=views.version_note(active + step, count, restored))

    def edit_reply(self, index: Any, text: str, key: Any, *values: Any) -> ChatOutputs:
        """A reply's text written by hand: a new sibling of it; the next turn goes on from it."""
        self.settings(values)
        whole = inputs.whole_number(index, "index", 0, 1_000_000)
        text = inputs.text(text, "reply", self.limits.max_message_chars)
        if (chat := self.directory.find(key)) is None:
            raise inputs.refused("There is no conversation yet: send a message first.")
        try:
            chat.conversation.edit_reply(whole, text)
        except ChatError as error:
            raise inputs.refused(error) from None
        return self.view(key, chat, stats=views.EDITED_REPLY)

    def switch_branch(self, target: Any, key: Any, *values: Any) -> ChatOutputs:
        """`target` is "message index:branch", from a "‹ 2 / 3 ›" in the chat."""
        self.settings(values)
        index, branch = inputs.branch_target(target)
        if (chat := self.directory.find(key)) is None:
            raise inputs.refused("There is no conversation to switch.")
        try:
            restored = chat.conversation.switch_branch(index, branch)
        except ChatError as error:
            raise inputs.refused(error) from None
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
    """The Chatbot's own events (their data, which message and what text, comes as `event`: the
    dict `ui.wiring.capturing` kept), page unload, and the operators' status endpoint."""

    def __init__(self, handlers: ChatHandlers):
        self.handlers = handlers
        self.directory = handlers.directory

    def on_retry(self, event: Any, request: gr.Request, key: Any, *values: Any) -> Iterator[ChatOutputs]:
        """Retry on a reply makes a new sibling of it; on a user message, a new branch there with
        the same text. Either way what followed stays on the old branch."""
        chat = self.directory.find(key)
        index = self._conversation_index(chat, _event_index(event))
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

    def on_undo(self, event: Any, key: Any, *values: Any) -> ChatOutputs:
        return self.handlers.undo(key, *values)

    def on_edit(self, event: Any, request: gr.Request, key: Any, *values: Any) -> Iterator[ChatOutputs]:
        chat = self.directory.find(key)
        position = _event_index(event)
        index = self._conversation_index(chat, position)
        if chat is None or index is None or position is None:
            raise inputs.refused("That message cannot be edited.")
        text = event.get("value") if isinstance(event, dict) else None
        shown = self.handlers.chatbot_messages(chat)[0][position]
        if shown.get("metadata"):  # the reply's thinking block
            raise inputs.refused("Only a reply's answer can be edited, not its thinking.")
        if chat.conversation.messages[index]["role"] == "assistant":
            yield self.handlers.edit_reply(index, text, key, *values)
        else:
            yield from self.handlers.edit(request, index, text, key, *values)

    def on_example(self, event: Any, request: gr.Request, key: Any, *values: Any) -> Iterator[ChatOutputs]:
        value = event.get("value") if isinstance(event, dict) else None
        yield from self.handlers.send(request, value.get("text") if isinstance(value, dict) else value, key, *values)

    def _conversation_index(self, chat: BrowserChat | None, shown_index: int | None) -> int | None:
        if chat is None:
            return None
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


def _event_index(event: Any) -> int | None:
    """The shown message a Chatbot event names (Gradio sends an index, or [index, part])."""
    index = event.get("index") if isinstance(event, dict) else None
    if isinstance(index, (list, tuple)) and index:
        index = index[0]
    return index if isinstance(index, int) and not isinstance(index, bool) else None
