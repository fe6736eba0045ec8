"""rewind-chat: the Gradio UI. UI only: each event is one Conversation operation.

Run `python app.py` (offline demo model) or `python app.py --model Qwen/Qwen3-0.6B`.
Conversations live on the server, one per browser session, found through a key the server
makes and keeps in `gr.State`; no endpoint takes a session id from the client.
"""

import argparse
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import gradio as gr

from cache_sessions.manager import SessionManager, TooManySessions
from chat import (
    ChatEngine,
    Conversation,
    ConversationBusyError,
    ConversationError,
    ModelLoadError,
)
from chat import remote
from chat.conversation import ReplyStream
from chat.remote import RemoteOperation

try:  # Hugging Face ZeroGPU: generation must run inside `spaces.GPU`
    import spaces
except ImportError:
    spaces = None
ON_ZERO_GPU = spaces is not None and bool(os.environ.get("SPACES_ZERO_GPU"))

EXAMPLES = [
    "Explain what a KV cache is in two sentences.",
    "Write a haiku about rolling back time.",
    "What is 17 * 23? Think it through.",
]
THINKING_TITLE = "Thinking"
GENERATING = "generating… (Stop ends it and keeps what was written)"


def env(name: str, default: Any) -> Any:
    return os.environ.get(name, default)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="rewind-chat: a chat UI whose KV cache rolls back instead of recomputing")
    parser.add_argument("--model", default=env("MODEL_ID", "demo"),
                        help='hub id, local folder, or "demo" (tiny random model, offline) [env MODEL_ID]')
    parser.add_argument("--host", default=env("HOST", env("GRADIO_SERVER_NAME", "127.0.0.1")), help="[env HOST]")
    parser.add_argument("--port", type=int, default=int(env("PORT", env("GRADIO_SERVER_PORT", 7860))), help="[env PORT]")
    parser.add_argument("--device", default=env("DEVICE", None), help="cuda, mps or cpu; automatic by default [env DEVICE]")
    parser.add_argument("--dtype", default=env("DTYPE", None), help="bfloat16, float16, float32; automatic [env DTYPE]")
    parser.add_argument("--cache-budget-mb", type=float, default=float(env("CACHE_BUDGET_MB", 2048)),
                        help="all KV caches together; over it, idle sessions are evicted [env CACHE_BUDGET_MB]")
    parser.add_argument("--max-sessions", type=int, default=int(env("MAX_SESSIONS", 64)), help="[env MAX_SESSIONS]")
    parser.add_argument("--idle-timeout-min", type=float, default=float(env("IDLE_TIMEOUT_MIN", 30)),
                        help="free a session idle this long [env IDLE_TIMEOUT_MIN]")
    parser.add_argument("--concurrency", type=int, default=int(env("CONCURRENCY", 2)),
                        help="generations running at once [env CONCURRENCY]")
    parser.add_argument("--max-new-tokens", type=int, default=int(env("MAX_NEW_TOKENS", 512)), help="[env MAX_NEW_TOKENS]")
    parser.add_argument("--max-checkpoints", type=int, default=int(env("MAX_CHECKPOINTS", 16)), help="[env MAX_CHECKPOINTS]")
    return parser.parse_args(argv)


@dataclass
class BrowserChat:
    """What one browser session owns: its conversation and how long each reply thought."""

    conversation: Conversation
    thinking_seconds: dict[int, float] = field(default_factory=dict)
    running: Any = None  # the operation streaming now, to stop it

    @property
    def session(self):
        return self.conversation.session


@dataclass
class Settings:
    system_prompt: str
    thinking: bool
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    repetition_penalty: float

    def options(self) -> dict[str, Any]:
        greedy = self.temperature <= 0
        options: dict[str, Any] = dict(max_new_tokens=int(self.max_new_tokens), do_sample=not greedy,
                                       enable_thinking=bool(self.thinking),
                                       repetition_penalty=float(self.repetition_penalty))
        if not greedy:
            options.update(temperature=float(self.temperature), top_p=float(self.top_p), top_k=int(self.top_k))
        return options


def stats_line(chat: BrowserChat) -> str:
    stats = chat.conversation.stats
    if stats is None:
        return ""
    parts = [
        f"reused **{stats.reused_tokens}** tokens",
        f"prefilled **{stats.prefilled_tokens}**",
        f"time to first token **{stats.ttft_s * 1000:.0f} ms**",
        f"**{stats.decode_tokens_per_s:.1f}** tokens/s",
        f"cache {stats.cache_tokens} tokens, {stats.cache_bytes / 2**20:.2f} MiB",
    ]
    if stats.shared_prefix_tokens:
        parts.append(f"{stats.shared_prefix_tokens} from the shared system prompt")
    if stats.rebuilt:
        parts.append("**rebuilt**: this conversation's cache had been freed")
    if stats.stopped:
        parts.append("stopped")
    return " · ".join(parts)


class ChatApp:
    def __init__(self, engine: ChatEngine, manager: SessionManager, *, max_new_tokens: int = 512,
                 model_label: str = "model", runner: Any = None):
        """`runner`: on ZeroGPU, `spaces.GPU(chat.remote.run_operation)`; operations then run in
        its worker process (see chat/remote.py). None: they run here."""
        self.engine = engine
        self.model_label = model_label
        self.runner = runner
        self._key_of_connection: dict[str, str] = {}  # Gradio's session hash -> our key, for unload
        self.manager = manager
        self.max_new_tokens = max_new_tokens

    # ---- sessions -------------------------------------------------------------------------------
    def _chat(self, key: str | None, settings: Settings, *, fresh: bool = False) -> tuple[str, BrowserChat]:
        """This browser's chat; a new one when asked (`fresh`), when the system prompt changed, or
        when there is none (first visit, expired)."""
        system = settings.system_prompt.strip()
        chat = self.manager.get(key)
        if chat is not None and not fresh and (chat.conversation.system_prompt or "") == system:
            return key, chat
        if chat is not None and not fresh and any(m["role"] != "system" for m in chat.conversation.messages):
            gr.Info("The system prompt changed: a new conversation was started.")
        elif chat is None and isinstance(key, str):  # a key this server gave out, since expired
            gr.Info("Your session had expired: a new conversation was started.")
        self.manager.close(key)
        chat = BrowserChat(self.engine.conversation(system or None))
        new_key = self.manager.open(chat)
        for connection, known in list(self._key_of_connection.items()):  # closing the tab frees the new one
            if known == key:
                self._key_of_connection[connection] = new_key
        return new_key, chat

    def start(self, chat: BrowserChat, operation: str, *args: Any, **kwargs: Any) -> Any | None:
        """Plan `operation` on the conversation and return its stream; None, after a warning,
        when it is refused (bad input, nothing to act on, busy): then nothing has changed."""
        try:
            if self.runner is None:
                stream = getattr(chat.conversation, operation)(*args, **kwargs)
            else:
                stream = RemoteOperation(chat.conversation, self.engine, self.runner, operation, *args, **kwargs)
        except (ConversationError, ConversationBusyError, ValueError, TypeError) as error:
            gr.Warning(_why(error))
            return None
        chat.running = stream
        return stream

    # ---- display ---------------------------------------------------------------------------------
    def display(self, chat: BrowserChat, upto: int | None = None) -> tuple[list[dict], list[int]]:
        """Chatbot messages for the history, and for each of them the conversation index."""
        shown: list[dict] = []
        index_of: list[int] = []
        for index, message in enumerate(chat.conversation.messages[:upto]):
            if message["role"] == "system":
                continue
            if message["role"] == "assistant" and message.get("reasoning_content"):
                metadata = {"title": THINKING_TITLE, "status": "done"}
                if index in chat.thinking_seconds:
                    metadata["duration"] = round(chat.thinking_seconds[index], 1)
                shown.append({"role": "assistant", "content": message["reasoning_content"], "metadata": metadata})
                index_of.append(index)
            if message["role"] == "user" or message["content"] or not message.get("reasoning_content"):
                shown.append({"role": message["role"], "content": message["content"]})
                index_of.append(index)
        return shown, index_of

    def outputs(self, key: str, chat: BrowserChat, shown: list[dict] | None = None, textbox: Any = None,
                status: str | None = None) -> tuple:
        if shown is None:
            shown = self.display(chat)[0]
        active, count = chat.conversation.versions
        label = f"version **{active + 1} / {count}**" if count > 1 else ""
        return (
            shown,
            gr.skip() if textbox is None else textbox,
            key,
            stats_line(chat) if status is None else status,
            gr.update(value=label, visible=count > 1),
            gr.update(visible=count > 1, interactive=active > 0),
            gr.update(visible=count > 1, interactive=active < count - 1),
        )

    # ---- streaming -------------------------------------------------------------------------------
    def stream(self, key: str, chat: BrowserChat, stream: ReplyStream | RemoteOperation, base: list[dict],
               reasoning: str = "", answer: str = "") -> Iterator[tuple]:
        """Show the reply as it streams: reasoning in a collapsible message, then the answer."""
        started = time.perf_counter()
        thinking_since: float | None = None
        thought_for: float | None = None
        try:
            with self.manager.using(key):
                for delta in stream:
                    if delta.kind == "reasoning":
                        thinking_since = thinking_since or time.perf_counter()
                        reasoning += delta.text
                    else:
                        if thinking_since and thought_for is None:
                            thought_for = time.perf_counter() - thinking_since
                        answer += delta.text
                    yield self.outputs(key, chat, base + _reply_messages(reasoning, answer, thought_for),
                                       status=GENERATING)
        except (ConversationBusyError, ConversationError) as error:
            gr.Warning(_why(error))
        except Exception as error:  # the model failed: the conversation is intact, say so
            gr.Warning(f"Generation failed: {error}")
        last = len(chat.conversation.messages) - 1
        if reasoning.strip():
            chat.thinking_seconds[last] = thought_for or (time.perf_counter() - (thinking_since or started))
        yield self.outputs(key, chat)

    def _settings(self, values: tuple) -> Settings:
        return Settings(*values)

    # ---- handlers --------------------------------------------------------------------------------
    def send(self, text: str, key: str | None, *settings_values: Any) -> Iterator[tuple]:
        settings = self._settings(settings_values)
        try:
            key, chat = self._chat(key, settings)
        except TooManySessions as error:
            gr.Warning(str(error))
            yield (gr.skip(),) * 7
            return
        stream = self.start(chat, "send", text, fit_context=True, **settings.options())
        if stream is None:
            yield self.outputs(key, chat)  # the message stays in the box
            return
        if stream.dropped_turns:
            gr.Warning(f"The conversation was too long for the model's context: the {stream.dropped_turns} "
                       "oldest turn(s) were dropped (the system prompt is kept).")
        base = self.display(chat)[0] + [{"role": "user", "content": text}]
        yield self.outputs(key, chat, base, textbox="", status=GENERATING)
        yield from self.stream(key, chat, stream, base)

    def regenerate(self, key: str | None, *settings_values: Any) -> Iterator[tuple]:
        settings = self._settings(settings_values)
        key, chat = self._chat(key, settings)
        conv = chat.conversation
        stream = self.start(chat, "regenerate", **settings.options())
        if stream is None:
            yield self.outputs(key, chat)
            return
        upto = len(conv.messages) - (1 if conv.messages[-1]["role"] == "assistant" else 0)
        yield from self.stream(key, chat, stream, self.display(chat, upto)[0])

    def continue_reply(self, key: str | None, *settings_values: Any) -> Iterator[tuple]:
        settings = self._settings(settings_values)
        key, chat = self._chat(key, settings)
        conv = chat.conversation
        stream = self.start(chat, "continue_reply", **settings.options())
        if stream is None:
            yield self.outputs(key, chat)
            return
        last = conv.messages[-1]
        base = self.display(chat, len(conv.messages) - 1)[0]
        yield from self.stream(key, chat, stream, base, reasoning=last["reasoning_content"], answer=last["content"])

    def edit(self, index: int, text: str, key: str | None, *settings_values: Any) -> Iterator[tuple]:
        settings = self._settings(settings_values)
        key, chat = self._chat(key, settings)
        index = int(index) if isinstance(index, (int, float)) and float(index).is_integer() else index
        stream = self.start(chat, "edit", index, text, **settings.options())
        if stream is None:
            yield self.outputs(key, chat)
            return
        chat.thinking_seconds = {i: s for i, s in chat.thinking_seconds.items() if i < index}
        base = self.display(chat, index)[0] + [{"role": "user", "content": text}]
        yield self.outputs(key, chat, base, status=GENERATING)
        yield from self.stream(key, chat, stream, base)

    def undo(self, key: str | None, *settings_values: Any) -> tuple:
        key, chat = self._chat(key, self._settings(settings_values))
        conv = chat.conversation
        users = [m["content"] for m in conv.messages if m["role"] == "user"]
        try:
            conv.undo()
        except (ConversationError, ConversationBusyError) as error:
            gr.Warning(_why(error))
            return self.outputs(key, chat)
        return self.outputs(key, chat, textbox=users[-1])  # the undone message goes back in the box

    def select_version(self, step: int, key: str | None, *settings_values: Any) -> tuple:
        key, chat = self._chat(key, self._settings(settings_values))
        conv = chat.conversation
        active, count = conv.versions
        try:
            restored = conv.select_version(active + step)
        except (ConversationError, ConversationBusyError) as error:
            gr.Warning(_why(error))
            return self.outputs(key, chat)
        result = self.outputs(key, chat)
        note = ("switched without running the model: its cache was restored" if restored
                else "its cache will be rebuilt on the next turn")
        return result[:3] + (f"Version {active + step + 1} / {count}: {note}.",) + result[4:]

    def stop(self, key: str | None) -> None:
        chat = self.manager.get(key)
        if chat is not None:
            if isinstance(chat.running, RemoteOperation):
                chat.running.stop()
            chat.conversation.stop()

    def on_load(self, request: gr.Request, key: str | None, *settings_values: Any) -> str:
        """A page opened: its conversation starts now, so that closing the tab can free it."""
        key, _ = self._chat(key, self._settings(settings_values))
        if request is not None and request.session_hash:
            self._key_of_connection[request.session_hash] = key
        return key

    def on_unload(self, request: gr.Request) -> None:
        """The tab closed (Gradio's heartbeat stopped): free its conversation now, not in an hour.
        The session hash is Gradio's; it only finds a key this server handed to that page."""
        if request is not None:
            self.manager.close(self._key_of_connection.pop(request.session_hash, None))

    def server_status(self) -> dict:
        """Aggregate numbers only (no session keys): what an operator of a shared Space needs."""
        stats = self.manager.stats()
        return {"conversations": stats.sessions, "generating": stats.in_use,
                "cache_bytes": stats.cache_bytes, "cache_budget_bytes": stats.budget_bytes,
                "shared_prefix_bytes": stats.shared_prefix_bytes, "evictions": stats.evictions,
                "expired": stats.expired}

    def clear(self, key: str | None, *settings_values: Any) -> tuple:
        key, chat = self._chat(key, self._settings(settings_values), fresh=True)
        return self.outputs(key, chat, textbox="")

    # chatbot's own events carry the index of the message they act on
    def on_retry(self, retry: gr.RetryData, key: str | None, *settings_values: Any) -> Iterator[tuple]:
        yield from self._retry_at(retry.index, key, settings_values)

    def _retry_at(self, shown_index: Any, key: str | None, settings_values: tuple) -> Iterator[tuple]:
        chat = self.manager.get(key)
        index = self._conversation_index(chat, shown_index)
        if chat is None or index is None:
            yield from self.regenerate(key, *settings_values)
            return
        messages = chat.conversation.messages
        last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
        if index >= last_user:
            yield from self.regenerate(key, *settings_values)
        else:
            yield from self.edit(index, messages[index]["content"], key, *settings_values)

    def on_undo(self, undo: gr.UndoData, key: str | None, *settings_values: Any) -> tuple:
        return self.undo(key, *settings_values)

    def on_edit(self, edited: gr.EditData, key: str | None, *settings_values: Any) -> Iterator[tuple]:
        chat = self.manager.get(key)
        index = self._conversation_index(chat, edited.index)
        if chat is None or index is None:
            gr.Warning("That message cannot be edited.")
            yield self.outputs(key, chat) if chat else (gr.skip(),) * 7
            return
        yield from self.edit(index, edited.value, key, *settings_values)

    def on_example(self, selected: gr.SelectData, key: str | None, *settings_values: Any) -> Iterator[tuple]:
        yield from self.send(selected.value["text"], key, *settings_values)

    def _conversation_index(self, chat: BrowserChat | None, shown_index: Any) -> int | None:
        if chat is None:
            return None
        if isinstance(shown_index, (list, tuple)):
            shown_index = shown_index[0]
        index_of = self.display(chat)[1]
        return index_of[shown_index] if isinstance(shown_index, int) and 0 <= shown_index < len(index_of) else None

    # ---- layout ----------------------------------------------------------------------------------
    def build(self) -> gr.Blocks:
        with gr.Blocks(title="rewind-chat", fill_height=True) as demo:
            gr.Markdown(f"## rewind-chat · {self.model_label}\n"
                        "One KV cache per conversation, rolled back instead of recomputed: "
                        "regenerate, undo, edit, stop and versions reuse everything before the change.")
            key = gr.State(None, delete_callback=self.manager.close)
            chatbot = gr.Chatbot(
                label="Chat",
                editable="user",
                height=520,
                examples=[{"text": text} for text in EXAMPLES],
                placeholder="Ask anything. The `demo` model is tiny and untrained: its replies are random text.",
                sanitize_html=True,
                elem_id="chatbot",
            )
            with gr.Row(equal_height=True):
                versions = gr.Markdown("", visible=False, elem_id="versions")
                previous_version = gr.Button("◀", size="sm", visible=False, elem_id="previous-version", scale=0)
                next_version = gr.Button("▶", size="sm", visible=False, elem_id="next-version", scale=0)
            with gr.Row():
                textbox = gr.Textbox(placeholder="Message (Enter to send)", show_label=False, scale=6,
                                     elem_id="message", autofocus=True)
                send = gr.Button("Send", variant="primary", scale=1, elem_id="send")
                stop = gr.Button("Stop", variant="stop", scale=1, elem_id="stop")
            with gr.Row():
                continue_button = gr.Button("Continue", size="sm", elem_id="continue")
                new_chat = gr.Button("New chat", size="sm", elem_id="new-chat")
            stats = gr.Markdown("", elem_id="stats")
            with gr.Accordion("Settings", open=False):
                system_prompt = gr.Textbox(label="System prompt (changing it starts a new conversation)",
                                           value="You are a helpful assistant.", elem_id="system-prompt")
                thinking = gr.Checkbox(label="Thinking (for models whose template supports it)", value=True)
                max_new_tokens = gr.Slider(1, self.max_new_tokens, value=min(256, self.max_new_tokens), step=1,
                                           label="Max new tokens", elem_id="max-new-tokens")
                temperature = gr.Slider(0, 2, value=0.7, step=0.05, label="Temperature (0 = greedy)",
                                        elem_id="temperature")
                top_p = gr.Slider(0.05, 1, value=0.95, step=0.01, label="Top-p")
                top_k = gr.Slider(0, 200, value=50, step=1, label="Top-k (0 = off)")
                repetition_penalty = gr.Slider(0.5, 2, value=1.0, step=0.01, label="Repetition penalty")
            settings = [system_prompt, thinking, max_new_tokens, temperature, top_p, top_k, repetition_penalty]
            outputs = [chatbot, textbox, key, stats, versions, previous_version, next_version]
            edit_index = gr.Number(visible=False, precision=0)
            edit_text = gr.Textbox(visible=False)
            api_edit = gr.Button(visible=False)

            generating = dict(concurrency_id="generate")  # shares the queue's default concurrency limit
            control = dict(queue=False)
            for trigger in (textbox.submit, send.click):
                trigger(self.send, [textbox, key, *settings], outputs, api_name="send" if trigger == send.click
                        else False, **generating)
            private = dict(api_visibility="private")
            chatbot.retry(self.on_retry, [key, *settings], outputs, api_name="chatbot_retry", **private,
                          **generating)
            chatbot.undo(self.on_undo, [key, *settings], outputs, api_name="chatbot_undo", **private)
            chatbot.edit(self.on_edit, [key, *settings], outputs, api_name="chatbot_edit", **private, **generating)
            chatbot.example_select(self.on_example, [key, *settings], outputs, api_name="chatbot_example",
                                   **private, **generating)
            chatbot.clear(self.clear, [key, *settings], outputs, api_name="chatbot_clear", api_visibility="private")
            continue_button.click(self.continue_reply, [key, *settings], outputs, api_name="continue", **generating)
            previous_version.click(lambda k, *s: self.select_version(-1, k, *s), [key, *settings], outputs,
                                   api_name="previous_version")
            next_version.click(lambda k, *s: self.select_version(1, k, *s), [key, *settings], outputs,
                               api_name="next_version")
            new_chat.click(self.clear, [key, *settings], outputs, api_name="clear")
            stop.click(self.stop, [key], None, api_name="stop", **control)
            # API twins of the chatbot's own events (which need browser event data)
            api_regenerate = gr.Button(visible=False)
            api_regenerate.click(self.regenerate, [key, *settings], outputs, api_name="regenerate", **generating)
            api_undo = gr.Button(visible=False)
            api_undo.click(self.undo, [key, *settings], outputs, api_name="undo")
            api_edit.click(self.edit, [edit_index, edit_text, key, *settings], outputs, api_name="edit",
                           **generating)
            demo.load(self.on_load, [key, *settings], [key], api_visibility="private")
            demo.unload(self.on_unload)
            status = gr.JSON(visible=False)
            api_status = gr.Button(visible=False)
            api_status.click(self.server_status, None, status, api_name="status", queue=False)
        return demo


def _reply_messages(reasoning: str, answer: str, thought_for: float | None) -> list[dict]:
    shown = []
    if reasoning:
        metadata: dict[str, Any] = {"title": THINKING_TITLE, "status": "done" if thought_for is not None else "pending"}
        if thought_for is not None:
            metadata["duration"] = round(thought_for, 1)
        shown.append({"role": "assistant", "content": reasoning, "metadata": metadata})
    if answer or not reasoning:
        shown.append({"role": "assistant", "content": answer})
    return shown


def _why(error: BaseException) -> str:
    return str(error) or type(error).__name__


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = "cuda" if ON_ZERO_GPU else args.device
    try:
        # On ZeroGPU each call runs in a worker process: caches live on the CPU between calls, and
        # shared prefixes (kept inside a worker) are off.
        engine = ChatEngine.load(args.model, device=device, dtype=args.dtype, max_checkpoints=args.max_checkpoints,
                                 offload_sessions=ON_ZERO_GPU, shared_prefixes=0 if ON_ZERO_GPU else 8)
    except ModelLoadError as error:
        print(f"rewind-chat: {error}", file=sys.stderr)
        return 1
    manager = SessionManager(
        budget_bytes=int(args.cache_budget_mb * 2**20),
        max_sessions=args.max_sessions,
        idle_timeout_s=args.idle_timeout_min * 60,
        prefix_store=engine.prefix_store,
    )
    label = "`demo` (a tiny untrained model: random text)" if args.model == "demo" else f"`{args.model}`"
    runner = None
    if ON_ZERO_GPU:
        remote.ENGINE = engine
        runner = spaces.GPU(duration=120)(remote.run_operation)
    demo = ChatApp(engine, manager, max_new_tokens=args.max_new_tokens, model_label=label, runner=runner).build()
    demo.queue(default_concurrency_limit=args.concurrency, max_size=256)
    demo.launch(server_name=args.host, server_port=args.port)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
