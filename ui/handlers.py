"""One method per UI event. Each finds the browser's conversation, runs one operation on it and
returns (or streams) `ChatOutputs`. Refusals are `ChatError`s: shown as a warning, nothing changed."""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Callable, Iterator

import gradio as gr

from chat import ChatError, Continue, Edit, Operation, Regenerate, Send
from ui import views
from ui import inputs
from ui.directory import BrowserChat, ChatDirectory
from ui.inputs import Limits
from ui.operator import Metrics, server_status
from ui.outputs import ChatOutputs, Settings


class ChatHandlers:
    def __init__(self, engine: Any, directory: ChatDirectory, *, limits: Limits = Limits(),
                 metrics: Metrics | None = None):
        """`engine`: whatever makes conversations (the embedded engine, a model server's, ZeroGPU's:
        the handlers cannot tell). `limits`: what a request may be."""
        self.engine = engine
        self.directory = directory
        self.limits = limits
        self.metrics = metrics  # fed after every reply (ui/operator.py)

    def settings(self, values: tuple) -> Settings:
        return Settings.from_values(values, self.limits)

    # ---- what every handler shares ------------------------------------------------------------
    def chat(self, request: gr.Request | None, key: Any, settings: Settings) -> tuple[str, BrowserChat]:
        """The conversation a new message goes to (made here if there is none)."""
        key, chat, notice = self.directory.chat(key, settings.system_prompt, page=page_of(request),
                                                client=client_of(request))
        if notice:
            gr.Info(notice)
        return key, chat

    def empty(self) -> ChatOutputs:
        """What a page without a conversation shows."""
        return ChatOutputs(chat=[], key=None, stats="", versions=gr.update(visible=False),
                           previous_version=gr.update(visible=False), next_version=gr.update(visible=False),
                           send=gr.update(visible=True), stop=gr.update(visible=False))

    def view(self, key: str, browser: BrowserChat, *, write_key: bool = True, **changes: Any) -> ChatOutputs:
        """The whole chat as it stands; `changes` override fields (a streaming reply, the box).
        `write_key=False` leaves the page's key alone (a stream must not undo a New chat)."""
        conversation = browser.conversation
        active, count = conversation.versions
        outputs = ChatOutputs(
            chat=self.chatbot_messages(browser)[0], key=key,
            stats=views.stats_line(conversation.stats),
            versions=gr.update(value=views.version_label(active, count), visible=count > 1),
            previous_version=gr.update(visible=count > 1, interactive=active > 0),
            next_version=gr.update(visible=count > 1, interactive=active < count - 1))
        if not write_key:
            outputs.key = gr.skip()
        outputs.send, outputs.stop = gr.update(visible=True), gr.update(visible=False)
        for name, value in changes.items():
            setattr(outputs, name, value)
        return outputs

    @staticmethod
    def chatbot_messages(browser: BrowserChat) -> tuple[list[dict], list[int | None]]:
        return views.path_messages(browser.conversation.history.entries, browser.thinking_by_index())

    def _generate(self, request: gr.Request | None, key: Any, values: tuple,
                  make: Callable[[], Operation]) -> Iterator[ChatOutputs]:
        """Plan the operation (a refusal changes nothing), then stream the reply into the chat.
        Only a new message makes a conversation; the other operations need one already."""
        settings = self.settings(values)
        try:
            operation = make()  # checked when made: an empty message is refused here
        except ChatError as error:
            gr.Warning(str(error))
            chat = self.directory.find(key)
            yield self.view(key, chat) if chat else ChatOutputs()
            return
        try:
            if isinstance(operation, Send):
                current = self.directory.find(key)
                if current is None or (current.conversation.system_prompt or "") != settings.system_prompt.strip():
                    # a new conversation: planned on a scratch one first, so a refusal keeps the old one
                    self.engine.conversation(settings.system_prompt.strip() or None).plan(operation,
                                                                                          settings.options())
                key, chat = self.chat(request, key, settings)
            elif (chat := self.directory.find(key)) is None:
                gr.Warning("There is no conversation yet: send a message first.")
                yield self.empty()
                return
        except ChatError as error:  # the server is full, or busy
            gr.Warning(str(error))
            yield ChatOutputs()
            return
        try:
            gone = lambda: key not in self.directory.manager or not chat.shown  # noqa: E731  (the page moved on)
            stream = chat.conversation.start(operation, settings.options(), cancelled=gone)
        except ChatError as error:
            gr.Warning(str(error))
            yield self.view(key, chat)  # the message stays in the box
            return
        if stream.dropped_turns:
            gr.Warning(f"The conversation was too long for the model's context: the {stream.dropped_turns} "
                       "oldest turn(s) were dropped (the system prompt is kept).")
        base, reasoning, answer = self._before_reply(chat, operation)
        if isinstance(operation, (Send, Edit)):  # show the user's message at once
            yield self.view(key, chat, chat=base, stats=views.GENERATING, **_BUSY,
                            textbox=gr.update(value="", placeholder=views.BUSY) if isinstance(operation, Send)
                            else gr.update(placeholder=views.BUSY))
        yield from self._stream(key, chat, stream, base, reasoning, answer, type(operation).__name__.lower())

    def _before_reply(self, chat: BrowserChat, operation: Operation) -> tuple[list[dict], str, str]:
        """What stays on screen above the streaming reply, and the reply text it starts from."""
        messages = chat.conversation.messages
        thinking = chat.thinking_by_index()
        shown = lambda upto: views.chatbot_messages(messages[:upto], thinking)[0]  # noqa: E731
        if isinstance(operation, Send):
            return shown(len(messages)) + [{"role": "user", "content": operation.text}], "", ""
        if isinstance(operation, Edit):
            return shown(operation.index) + [{"role": "user", "content": operation.text}], "", ""
        if isinstance(operation, Continue):
            return shown(len(messages) - 1), messages[-1]["reasoning_content"], messages[-1]["content"]
        if isinstance(operation, Regenerate) and operation.index is not None:
            return shown(operation.index), "", ""
        return shown(len(messages) - (messages[-1]["role"] == "assistant")), "", ""

    def _stream(self, key: str, chat: BrowserChat, stream: Any, base: list[dict], reasoning: str,
                answer: str, operation: str) -> Iterator[ChatOutputs]:
        """Show the reply as it streams: reasoning in a collapsible message, then the answer."""
        started, thinking_since, thought_for, failed = time.perf_counter(), None, None, False
        shown_at = 0.0  # when the last update went out: at most one per UPDATE_INTERVAL_S
        deltas = iter(stream)
        try:
            try:
                for delta in deltas:
                    if delta.kind == "reasoning":
                        thinking_since = thinking_since or time.perf_counter()
                        reasoning += delta.text
                    else:
                        if thinking_since and thought_for is None:
                            thought_for = time.perf_counter() - thinking_since
                        answer += delta.text
                    if key not in self.directory.manager or not chat.shown:  # the page shows another
                        # conversation (New chat, the list), or the tab closed: the page
                        self._abandon(chat, deltas)  # has moved on; write nothing over it
                        return
                    if time.perf_counter() - shown_at < UPDATE_INTERVAL_S:
                        continue  # each update resends the chat: coalesce fast tokens
                    first, shown_at = shown_at == 0.0, time.perf_counter()
                    # the first update shows Stop and the busy line; later ones carry only the chat
                    yield ChatOutputs(chat=base + views.reply_messages(reasoning, answer, thought_for),
                                      **({"stats": views.GENERATING, **_BUSY} if first else {}))
            except GeneratorExit:  # the client went away (closed tab, dropped connection, cancel)
                self._abandon(chat, deltas)
                raise
        except ChatError as error:
            failed = True
            gr.Warning(str(error))
        except Exception as error:  # the model failed: the conversation is intact, say so
            failed = True
            gr.Warning(f"Generation failed: {error}")
        finally:
            if self.metrics is not None:
                self.metrics.reply_done(operation, chat.conversation.stats, failed)
        path = chat.conversation.history.entries
        if reasoning.strip() and path and path[-1].role == "assistant":
            chat.thinking_seconds[path[-1].uid] = thought_for or (time.perf_counter() - (thinking_since or started))
        if key in self.directory.manager and chat.shown:  # unless the page moved on meanwhile
            yield self.view(key, chat, write_key=False, textbox=gr.update(placeholder=views.READY))

    def _abandon(self, chat: BrowserChat, deltas: Iterator[Any]) -> None:
        """Stop a reply nobody reads any more and let it end as Stop ends it: the partial reply
        kept, the conversation free for the next message (within a decode step or two)."""
        chat.conversation.stop()
        try:
            for _ in deltas:
                pass
        except Exception:  # noqa: S110  (it failed while ending: the conversation says so itself)
            pass

    # ---- generating events ----------------------------------------------------------------------
    # `request` is Gradio's (injected by its type), or None: it says which page and address call.
    def send(self, request: gr.Request, text: str, key: Any, *values: Any) -> Iterator[ChatOutputs]:
        text = inputs.text(text, "message", self.limits.max_message_chars)  # before any tokenizing
        yield from self._generate(request, key, values, lambda: Send(text, fit_context=True))

    def regenerate(self, request: gr.Request, key: Any, *values: Any) -> Iterator[ChatOutputs]:
        yield from self._generate(request, key, values, Regenerate)

    def regenerate_at(self, request: gr.Request, index: Any, key: Any, *values: Any) -> Iterator[ChatOutputs]:
        """A new sibling of the reply at `index`; what followed the old one stays on its branch."""
        whole = inputs.whole_number(index, "index", 0, 1_000_000)
        yield from self._generate(request, key, values, lambda: Regenerate(whole))

    def continue_reply(self, request: gr.Request, key: Any, *values: Any) -> Iterator[ChatOutputs]:
        yield from self._generate(request, key, values, Continue)

    def retry_at(self, request: gr.Request, target: Any, key: Any, *values: Any) -> Iterator[ChatOutputs]:
        """↻ under an earlier reply: `target` is its message index, as the page's script sends it."""
        yield from self.regenerate_at(request, inputs.message_index(target), key, *values)

    def edit(self, request: gr.Request, index: Any, text: str, key: Any, *values: Any) -> Iterator[ChatOutputs]:
        whole = inputs.whole_number(index, "index", 0, 1_000_000)
        text = inputs.text(text, "message", self.limits.max_message_chars)
        yield from self._generate(request, key, values, lambda: Edit(whole, text))

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


UPDATE_INTERVAL_S = 0.04  # the chat's streamed updates: at most 25 a second (the final one always goes)
_BUSY = dict(send=gr.update(visible=False), stop=gr.update(visible=True))


def page_of(request: gr.Request | None) -> str | None:
    """Gradio's session hash: it only finds keys this server handed to that page (to free them)."""
    return getattr(request, "session_hash", None) or None


def client_of(request: gr.Request | None) -> str | None:
    """The caller's address, to count what it holds. On a Hugging Face Space the proxy puts the
    browser's address first in X-Forwarded-For; elsewhere that header is the client's own word."""
    if request is None:
        return None
    if os.environ.get("SPACE_ID"):
        forwarded = (request.headers.get("x-forwarded-for") or "").split(",")[0].strip()
        if forwarded:
            return forwarded
    client = getattr(request, "client", None)
    return getattr(client, "host", None)
