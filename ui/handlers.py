"""One method per UI event: it checks its inputs, makes an action (ui/actions.py) and hands it to
`ChatHandlers.act`, which runs it on the browser's conversation and returns (or streams)
`ChatOutputs`. A refusal raises `inputs.refused` before anything changed."""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator

import gradio as gr

from chat import ChatError, Continue, Edit, Regenerate, Send
from ui import inputs, views
from ui.actions import REPLIES, Action, Clear, EditReply, Instant, SelectVersion, SwitchBranch, Undo, made
from ui.operator import server_status
from ui.outputs import ChatOutputs
from ui.replies import ReplyEvents


class ChatHandlers(ReplyEvents):
    """Every control's event: its inputs checked and made into an action (ui/actions.py), then
    `act`, the one way from an action to the conversation. The reply-making actions stream
    (ui/replies.py); the others give one view."""

    def act(self, request: gr.Request | None, key: Any, values: tuple, action: Action) -> Iterator[ChatOutputs]:
        """Run `action` on the page's conversation (`key`) with the settings panel's `values`; a
        refusal raises before anything changed."""
        settings = self.settings(values)
        if isinstance(action, REPLIES):
            yield from self._generate(request, key, settings, action)
        else:
            yield self._apply(key, action)

    def _apply(self, key: Any, action: Instant) -> ChatOutputs:
        if isinstance(action, Clear):  # the old conversation (its reply stopped) is freed
            self.directory.close(key)
            return dataclasses.replace(self.empty(), textbox=gr.update(value="", placeholder=views.READY))
        if (chat := self.directory.find(key)) is None:
            raise inputs.refused("There is nothing to undo." if isinstance(action, Undo)
                                 else "There is no conversation yet: send a message first.")
        conversation = chat.conversation
        try:
            if isinstance(action, Undo):
                users = [m["content"] for m in conversation.messages if m["role"] == "user"]
                conversation.undo()
                return self.view(key, chat, textbox=users[-1], stats=views.UNDONE)  # the message back in the box
            if isinstance(action, SelectVersion):
                active, count = conversation.versions
                restored = conversation.select_version(active + action.step)
                return self.view(key, chat, stats=views.version_note(active + action.step, count, restored))
            if isinstance(action, EditReply):
                conversation.edit_reply(action.index, action.text)
                return self.view(key, chat, stats=views.EDITED_REPLY)
            restored = conversation.switch_branch(action.index, action.branch)
        except ChatError as error:
            raise inputs.refused(error) from None
        count = conversation.branches(action.index)[1]
        return self.view(key, chat, stats=views.branch_note(action.branch, count, restored),
                         system_prompt=(conversation.system_prompt or "") if action.index == 0 else gr.skip())

    def _one(self, key: Any, values: tuple, action: Instant) -> ChatOutputs:
        return next(self.act(None, key, values, action))

    # ---- the events: `request` is Gradio's (injected by its type), or None ----------------------
    def send(self, request: gr.Request, text: str, key: Any, *values: Any) -> Iterator[ChatOutputs]:
        text = inputs.text(text, "message", self.limits.max_message_chars)  # before any tokenizing
        yield from self.act(request, key, values, made(Send, text, fit_context=True))

    def prepare(self, text: Any, asked: Any, key: Any, *values: Any) -> Any:
        """The message being typed: the page's conversation prefilled as it will be with it,
        when no reply has work (`Conversation.prepare`). Quietly nothing where it cannot be: no
        conversation yet (the first message makes it), a reply running, a refused input. Hands
        back `asked`, the page's number for this ask, once taken (its draft, if any, in the table)."""
        taken = asked if isinstance(asked, (int, float)) and 0 <= asked < 2**31 else gr.skip()
        chat = self.directory.find(key)
        if chat is None or not isinstance(text, str) or len(text) > self.limits.max_message_chars:
            return taken
        try:
            options = self.settings(values).options()
        except gr.Error:
            return taken
        chat.conversation.prepare(text, options, fit_context=True)
        return taken

    def regenerate(self, request: gr.Request, key: Any, *values: Any) -> Iterator[ChatOutputs]:
        yield from self.act(request, key, values, Regenerate(fit_context=True))

    def regenerate_at(self, request: gr.Request, index: Any, key: Any, *values: Any) -> Iterator[ChatOutputs]:
        """A new sibling of the reply at `index`; what followed the old one stays on its branch."""
        yield from self.act(request, key, values, made(Regenerate, inputs.whole_number(index, "index", 0, 1_000_000),
                                                            fit_context=True))

    def retry_at(self, request: gr.Request, target: Any, key: Any, *values: Any) -> Iterator[ChatOutputs]:
        """↻ under an earlier reply: `target` is its message index, as the page's script sends it."""
        yield from self.act(request, key, values, made(Regenerate, inputs.message_index(target), fit_context=True))

    def continue_reply(self, request: gr.Request, key: Any, *values: Any) -> Iterator[ChatOutputs]:
        yield from self.act(request, key, values, Continue())

    def edit(self, request: gr.Request, index: Any, text: str, key: Any, *values: Any) -> Iterator[ChatOutputs]:
        whole = inputs.whole_number(index, "index", 0, 1_000_000)
        text = inputs.text(text, "message", self.limits.max_message_chars)
        yield from self.act(request, key, values, made(Edit, whole, text, fit_context=True))

    def undo(self, key: Any, *values: Any) -> ChatOutputs:
        return self._one(key, values, Undo())

    def select_version(self, step: int, key: Any, *values: Any) -> ChatOutputs:
        return self._one(key, values, SelectVersion(step))

    def edit_reply(self, index: Any, text: str, key: Any, *values: Any) -> ChatOutputs:
        """A reply's text written by hand: a new sibling of it; the next turn goes on from it."""
        whole = inputs.whole_number(index, "index", 0, 1_000_000)
        return self._one(key, values, EditReply(whole, inputs.text(text, "reply", self.limits.max_message_chars)))

    def switch_branch(self, target: Any, key: Any, *values: Any) -> ChatOutputs:
        """`target` is "message index:branch", from a "‹ 2 / 3 ›" in the chat."""
        return self._one(key, values, SwitchBranch(*inputs.branch_target(target)))

    def clear(self, key: Any, *values: Any) -> ChatOutputs:
        return self._one(key, values, Clear())

    def stop(self, key: Any) -> None:
        """Not an action: it reaches a running reply, whatever the page's events are doing."""
        chat = self.directory.find(key)
        if chat is not None:
            chat.conversation.stop()


class PageEvents:
    """The Chatbot's own events (their data, which message and what text, comes as `event`: the
    dict `ui.wiring.capture` kept), page unload, and the operators' status endpoint."""

    def __init__(self, handlers: ChatHandlers):
        self.handlers = handlers
        self.directory = handlers.directory

    def on_retry(self, event: Any, request: gr.Request, key: Any, *values: Any) -> Iterator[ChatOutputs]:
        """Retry on a reply makes a new sibling of it; on a user message, a new branch there with
        the same text. Either way what followed stays on the old branch."""
        chat = self.directory.find(key)
        index = self.handlers.conversation_index(chat, _event_index(event))
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
        index = self.handlers.conversation_index(chat, position)
        if chat is None or index is None or position is None:
            raise inputs.refused("That message cannot be edited.")
        text = event.get("value") if isinstance(event, dict) else None
        shown = self.handlers.chatbot_messages(chat)[0][position]
        if shown.get("metadata"):  # the reply's thinking block
            raise inputs.refused("Only a reply's answer can be edited, not its thinking.")
        if chat.conversation.messages[index]["role"] == "assistant":  # the note under it is not its text
            yield self.handlers.edit_reply(index, views.without_mark(text) if isinstance(text, str) else text, key,
                                           *values)
        else:  # the edit began from the message as shown: its characters escaped (`views.as_typed`)
            yield from self.handlers.edit(request, index, views.typed_text(text) if isinstance(text, str) else text,
                                          key, *values)

    def on_example(self, event: Any, request: gr.Request, key: Any, *values: Any) -> Iterator[ChatOutputs]:
        value = event.get("value") if isinstance(event, dict) else None
        yield from self.handlers.send(request, value.get("text") if isinstance(value, dict) else value, key, *values)

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
