"""One method per UI event. Each finds the browser's conversation, runs one operation on it and
returns (or streams) `ChatOutputs`. Refusals are `ChatError`s: shown as a warning, nothing changed."""

from __future__ import annotations

import time
from typing import Any, Callable, Iterator

import gradio as gr

from chat import ChatEngine, ChatError, Continue, Edit, Operation, Regenerate, Send
from chat.remote import RemoteOperation, Runner
from ui import views
from ui.directory import BrowserChat, ChatDirectory
from ui.outputs import ChatOutputs, Settings


class ChatHandlers:
    def __init__(self, engine: ChatEngine, directory: ChatDirectory, *, runner: Runner | None = None):
        """`runner`: on ZeroGPU, `spaces.GPU(chat.remote.run_plan)`; operations then run in its
        worker process (see chat/remote.py). None: they run here."""
        self.engine = engine
        self.directory = directory
        self.runner = runner

    # ---- what every handler shares ------------------------------------------------------------
    def chat(self, key: Any, settings: Settings, *, fresh: bool = False) -> tuple[str, BrowserChat]:
        key, chat, notice = self.directory.chat(key, settings.system_prompt, fresh=fresh)
        if notice:
            gr.Info(notice)
        return key, chat

    def view(self, key: str, browser: BrowserChat, **changes: Any) -> ChatOutputs:
        """The whole chat as it stands; `changes` override fields (a streaming reply, the box)."""
        conversation = browser.conversation
        active, count = conversation.versions
        outputs = ChatOutputs(
            chat=views.chatbot_messages(conversation.messages, browser.thinking_seconds)[0], key=key,
            stats=views.stats_line(conversation.stats),
            versions=gr.update(value=views.version_label(active, count), visible=count > 1),
            previous_version=gr.update(visible=count > 1, interactive=active > 0),
            next_version=gr.update(visible=count > 1, interactive=active < count - 1))
        for name, value in changes.items():
            setattr(outputs, name, value)
        return outputs

    def _generate(self, key: Any, values: tuple, make: Callable[[BrowserChat], Operation]) -> Iterator[ChatOutputs]:
        """Plan the operation (a refusal changes nothing), then stream the reply into the chat."""
        settings = Settings.from_values(values)
        try:
            key, chat = self.chat(key, settings)
        except ChatError as error:  # the server is full
            gr.Warning(str(error))
            yield ChatOutputs()
            return
        try:
            operation = make(chat)
            if self.runner is None:
                stream = chat.conversation.start(operation, settings.options())
            else:
                stream = RemoteOperation(chat.conversation, self.runner, operation, settings.options())
        except ChatError as error:
            gr.Warning(str(error))
            yield self.view(key, chat)  # the message stays in the box
            return
        chat.running = stream
        if stream.dropped_turns:
            gr.Warning(f"The conversation was too long for the model's context: the {stream.dropped_turns} "
                       "oldest turn(s) were dropped (the system prompt is kept).")
        base, reasoning, answer = self._before_reply(chat, operation)
        if isinstance(operation, (Send, Edit)):  # show the user's message at once
            yield self.view(key, chat, chat=base, stats=views.GENERATING,
                            textbox="" if isinstance(operation, Send) else gr.skip())
        yield from self._stream(key, chat, stream, base, reasoning, answer)

    def _before_reply(self, chat: BrowserChat, operation: Operation) -> tuple[list[dict], str, str]:
        """What stays on screen above the streaming reply, and the reply text it starts from."""
        messages = chat.conversation.messages
        shown = lambda upto: views.chatbot_messages(messages[:upto], chat.thinking_seconds)[0]  # noqa: E731
        if isinstance(operation, Send):
            return shown(len(messages)) + [{"role": "user", "content": operation.text}], "", ""
        if isinstance(operation, Edit):
            chat.thinking_seconds = {i: s for i, s in chat.thinking_seconds.items() if i < operation.index}
            return shown(operation.index) + [{"role": "user", "content": operation.text}], "", ""
        if isinstance(operation, Continue):
            return shown(len(messages) - 1), messages[-1]["reasoning_content"], messages[-1]["content"]
        return shown(len(messages) - (messages[-1]["role"] == "assistant")), "", ""

    def _stream(self, key: str, chat: BrowserChat, stream: Any, base: list[dict], reasoning: str,
                answer: str) -> Iterator[ChatOutputs]:
        """Show the reply as it streams: reasoning in a collapsible message, then the answer."""
        started, thinking_since, thought_for = time.perf_counter(), None, None
        deltas = iter(stream)
        try:
            with self.directory.manager.using(key):
                try:
                    for delta in deltas:
                        if delta.kind == "reasoning":
                            thinking_since = thinking_since or time.perf_counter()
                            reasoning += delta.text
                        else:
                            if thinking_since and thought_for is None:
                                thought_for = time.perf_counter() - thinking_since
                            answer += delta.text
                        yield self.view(key, chat, chat=base + views.reply_messages(reasoning, answer, thought_for),
                                        stats=views.GENERATING)
                except GeneratorExit:  # the client went away (closed tab, dropped connection, cancel)
                    self._abandon(chat, deltas)
                    raise
        except ChatError as error:
            gr.Warning(str(error))
        except Exception as error:  # the model failed: the conversation is intact, say so
            gr.Warning(f"Generation failed: {error}")
        finally:
            chat.running = None
        if reasoning.strip():
            last = len(chat.conversation.messages) - 1
            chat.thinking_seconds[last] = thought_for or (time.perf_counter() - (thinking_since or started))
        yield self.view(key, chat)

    def _abandon(self, chat: BrowserChat, deltas: Iterator[Any]) -> None:
        """Stop a reply nobody reads any more and let it end as Stop ends it: the partial reply
        kept, the conversation free for the next message (within a decode step or two)."""
        self.stop_running(chat)
        try:
            for _ in deltas:
                pass
        except Exception:  # noqa: S110  (it failed while ending: the conversation says so itself)
            pass

    # ---- generating events ----------------------------------------------------------------------
    def send(self, text: str, key: Any, *values: Any) -> Iterator[ChatOutputs]:
        yield from self._generate(key, values, lambda chat: Send(text, fit_context=True))

    def regenerate(self, key: Any, *values: Any) -> Iterator[ChatOutputs]:
        yield from self._generate(key, values, lambda chat: Regenerate())

    def continue_reply(self, key: Any, *values: Any) -> Iterator[ChatOutputs]:
        yield from self._generate(key, values, lambda chat: Continue())

    def edit(self, index: Any, text: str, key: Any, *values: Any) -> Iterator[ChatOutputs]:
        whole = int(index) if isinstance(index, (int, float)) and float(index).is_integer() else index
        yield from self._generate(key, values, lambda chat: Edit(whole, text))

    # ---- instant events -------------------------------------------------------------------------
    def undo(self, key: Any, *values: Any) -> ChatOutputs:
        key, chat = self.chat(key, Settings.from_values(values))
        users = [m["content"] for m in chat.conversation.messages if m["role"] == "user"]
        try:
            chat.conversation.undo()
        except ChatError as error:
            gr.Warning(str(error))
            return self.view(key, chat)
        return self.view(key, chat, textbox=users[-1])  # the undone message goes back in the box

    def select_version(self, step: int, key: Any, *values: Any) -> ChatOutputs:
        key, chat = self.chat(key, Settings.from_values(values))
        active, count = chat.conversation.versions
        try:
            restored = chat.conversation.select_version(active + step)
        except ChatError as error:
            gr.Warning(str(error))
            return self.view(key, chat)
        return self.view(key, chat, stats=views.version_note(active + step, count, restored))

    def clear(self, key: Any, *values: Any) -> ChatOutputs:
        key, chat = self.chat(key, Settings.from_values(values), fresh=True)
        return self.view(key, chat, textbox="")

    def stop(self, key: Any) -> None:
        chat = self.directory.find(key)
        if chat is not None:
            self.stop_running(chat)

    @staticmethod
    def stop_running(chat: BrowserChat) -> None:
        if isinstance(chat.running, RemoteOperation):
            chat.running.stop()
        chat.conversation.stop()


class PageEvents:
    """The Chatbot's own events (they carry the index of a shown message), page load and unload,
    and the operators' status endpoint."""

    def __init__(self, handlers: ChatHandlers):
        self.handlers = handlers
        self.directory = handlers.directory

    def on_retry(self, retry: gr.RetryData, key: Any, *values: Any) -> Iterator[ChatOutputs]:
        """Retry on the last turn regenerates; on an earlier user message it edits it unchanged."""
        chat = self.directory.find(key)
        index = self._conversation_index(chat, retry.index)
        if chat is None or index is None:
            yield from self.handlers.regenerate(key, *values)
            return
        messages = chat.conversation.messages
        if index >= max(i for i, m in enumerate(messages) if m["role"] == "user"):
            yield from self.handlers.regenerate(key, *values)
        else:
            yield from self.handlers.edit(index, messages[index]["content"], key, *values)

    def on_undo(self, undo: gr.UndoData, key: Any, *values: Any) -> ChatOutputs:
        return self.handlers.undo(key, *values)

    def on_edit(self, edited: gr.EditData, key: Any, *values: Any) -> Iterator[ChatOutputs]:
        chat = self.directory.find(key)
        index = self._conversation_index(chat, edited.index)
        if chat is None or index is None:
            gr.Warning("That message cannot be edited.")
            yield self.handlers.view(key, chat) if chat else ChatOutputs()
            return
        yield from self.handlers.edit(index, edited.value, key, *values)

    def on_example(self, selected: gr.SelectData, key: Any, *values: Any) -> Iterator[ChatOutputs]:
        yield from self.handlers.send(selected.value["text"], key, *values)

    def _conversation_index(self, chat: BrowserChat | None, shown_index: Any) -> int | None:
        if chat is None:
            return None
        if isinstance(shown_index, (list, tuple)):
            shown_index = shown_index[0]
        index_of = views.chatbot_messages(chat.conversation.messages, chat.thinking_seconds)[1]
        return index_of[shown_index] if isinstance(shown_index, int) and 0 <= shown_index < len(index_of) else None

    def on_load(self, request: gr.Request, key: Any, *values: Any) -> str:
        """A page opened: its conversation starts now, so that closing the tab can free it."""
        key, _ = self.handlers.chat(key, Settings.from_values(values))
        if request is not None and request.session_hash:
            self.directory.page_opened(request.session_hash, key)
        return key

    def on_unload(self, request: gr.Request) -> None:
        """The tab closed (Gradio's heartbeat stopped): free its conversation now, not in an hour.
        The session hash is Gradio's; it only finds a key this server handed to that page."""
        if request is not None and request.session_hash:
            self.directory.page_closed(request.session_hash)

    def server_status(self) -> dict:
        """Aggregate numbers only (no session keys): what an operator of a shared Space needs."""
        stats, batch = self.directory.manager.stats(), self.directory.engine.batch_stats()
        return {"conversations": stats.sessions, "generating": stats.in_use,
                "batch": {"decoding": batch.decoding, "prefilling": batch.prefilling, "waiting": batch.waiting,
                          "max_batch_size": batch.max_batch_size, "largest_batch": batch.largest_batch,
                          "decode_steps": batch.steps, "batch_bytes": batch.batch_bytes,
                          "join_wait_mean_s": round(batch.join_wait_mean_s, 4),
                          "join_wait_max_s": round(batch.join_wait_max_s, 4)},
                "cache_bytes": stats.cache_bytes, "cache_budget_bytes": stats.budget_bytes,
                "shared_prefix_bytes": stats.shared_prefix_bytes, "evictions": stats.evictions,
                "expired": stats.expired, "closed_for_room": stats.closed_for_room}
