"""The events that make a reply (send, regenerate, edit, continue, retry): plan the operation (a
refusal, raised as `inputs.refused`, changes nothing), then stream the reply into the chat,
reasoning and answer apart."""

from __future__ import annotations

import time
from typing import Any, Iterator

import gradio as gr

from chat import ChatError, Continue, Edit, Operation, Regenerate, Send
from ui import inputs, views
from ui.directory import BrowserChat
from ui.outputs import ChatOutputs, Settings
from ui.shared import HandlersBase

UPDATE_INTERVAL_S = 0.04  # the chat's streamed updates: at most 25 a second (the final one always goes)
_BUSY = dict(send=gr.update(visible=False), stop=gr.update(visible=True))


class ReplyEvents(HandlersBase):
    def _generate(self, request: gr.Request | None, key: Any, settings: Settings,
                  operation: Operation) -> Iterator[ChatOutputs]:
        """Plan the operation (a refusal changes nothing), then stream the reply into the chat.
        Only a new message makes a conversation; the other operations need one already."""
        try:
            if isinstance(operation, Send):
                current = self.directory.find(key)
                if current is None or (current.conversation.system_prompt or "") != settings.system_prompt.strip():
                    # a new conversation: planned on a scratch one first, so a refusal keeps the old one
                    self.engine.conversation(settings.system_prompt.strip() or None).plan(operation,
                                                                                          settings.options())
                key, chat = self.chat(request, key, settings)
            elif (chat := self.directory.find(key)) is None:
                raise inputs.refused("There is no conversation yet: send a message first.")
        except ChatError as error:  # the server is full, or busy
            raise inputs.refused(error) from None
        try:
            gone = lambda: key not in self.directory.manager or not chat.shown  # noqa: E731  (the page moved on)
            stream = chat.conversation.start(operation, settings.options(), cancelled=gone)
        except ChatError as error:
            raise inputs.refused(error) from None  # the message stays in the box
        if stream.newly_dropped:
            gr.Warning(f"The conversation is longer than the model's context: from now on it does not see the "
                       f"{stream.dropped_turns} oldest turn(s). They stay here; the system prompt is kept.")
        base, reasoning, answer = self._before_reply(chat, operation)
        if isinstance(operation, (Send, Edit)):  # show the user's message at once
            # the box is not emptied here: the page empties it if it still holds what was sent
            # (a message typed meanwhile was lost); an API client keeps its own
            yield self.view(key, chat, chat=base, stats=views.GENERATING, **_BUSY,
                            textbox=gr.update(placeholder=views.BUSY))
        with chat.streams.held():  # (Gradio has sent every earlier update when it asks for the next)
            yield from self._stream(key, chat, stream, base, reasoning, answer, type(operation).__name__.lower())

    def _before_reply(self, chat: BrowserChat, operation: Operation) -> tuple[list[dict], str, str]:
        """What stays on screen above the streaming reply, and the reply text it starts from."""
        messages = chat.conversation.messages
        thinking = views.thinking_of(chat.conversation.history.entries)
        shown = lambda upto: views.chatbot_messages(messages[:upto], thinking)[0]  # noqa: E731
        if isinstance(operation, Send):
            return shown(len(messages)) + [{"role": "user", "content": views.as_typed(operation.text)}], "", ""
        if isinstance(operation, Edit):
            return shown(operation.index) + [{"role": "user", "content": views.as_typed(operation.text)}], "", ""
        if isinstance(operation, Continue):
            return shown(len(messages) - 1), messages[-1]["reasoning_content"], messages[-1]["content"]
        if isinstance(operation, Regenerate) and operation.index is not None:
            return shown(operation.index), "", ""
        return shown(len(messages) - (messages[-1]["role"] == "assistant")), "", ""

    def _stream(self, key: str, chat: BrowserChat, stream: Any, base: list[dict], reasoning: str,
                answer: str, operation: str) -> Iterator[ChatOutputs]:
        """Show the reply as it streams: reasoning in a collapsible message, then the answer."""
        thinking_since, thought_for, failed = None, None, False
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
                        yield ChatOutputs()  # (why: see the end)
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
        if key in self.directory.manager and chat.shown:  # unless the page moved on meanwhile
            yield self.view(key, chat, write_key=False, textbox=gr.update(placeholder=views.READY))
        else:  # Gradio's message that the event ended repeats its last update, which may come after
            yield ChatOutputs()  # the next view's: the last must change nothing

    def _abandon(self, chat: BrowserChat, deltas: Iterator[Any]) -> None:
        """Stop a reply nobody reads any more and let it end as Stop ends it: the partial reply
        kept, the conversation free for the next message (within a decode step or two)."""
        chat.conversation.stop()
        try:
            for _ in deltas:
                pass
        except Exception:  # noqa: S110  (it failed while ending: the conversation says so itself)
            pass

