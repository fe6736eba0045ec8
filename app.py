"""rewind-chat: the Gradio UI. Layout and wiring only; the handlers live in ui/.

Run `python app.py` (offline demo model) or `python app.py --model Qwen/Qwen3-0.6B`.
Conversations live on the server, one per browser session, found through a key the server
makes and keeps in `gr.State`; no endpoint takes a session id from the client.
"""

from __future__ import annotations

import functools
import os
import socket
import sys
from typing import Any, Callable, Iterator

import gradio as gr
from starlette.middleware import Middleware

from chat import ChatEngine, ModelLoadError, remote
from ui.chat_list import ChatList, empty_store
from ui.config import AppConfig
from ui.directory import ChatDirectory
from ui.handlers import ChatHandlers, PageEvents
from ui.inputs import Limits
from ui.operator import Metrics, routes
from ui.security import SecurityHeaders
from ui import gradio_tuning, views
from ui.outputs import ChatOutputs, Settings

try:  # Hugging Face ZeroGPU: generation must run inside `spaces.GPU`
    import spaces
except ImportError:
    spaces = None
ON_ZERO_GPU = spaces is not None and bool(os.environ.get("SPACES_ZERO_GPU"))

EXAMPLES = [
    "What is 47 + 38?",
    "What is 7 * 46?",
    "What does regenerate do?",
]


def streamed(handler: Callable[..., Iterator[ChatOutputs]]) -> Callable[..., Iterator[tuple]]:
    """Gradio wants output tuples: a streaming handler's ChatOutputs, turned into them one by one.
    `wraps` keeps the handler's signature, from which Gradio injects event data and requests."""
    @functools.wraps(handler)
    def run(*args: Any) -> Iterator[tuple]:
        for outputs in handler(*args):
            yield outputs.to_gradio()
    return run


def instant(handler: Callable[..., ChatOutputs]) -> Callable[..., tuple]:
    @functools.wraps(handler)
    def run(*args: Any) -> tuple:
        return handler(*args).to_gradio()
    return run


PAGE_SCRIPT = """() => {
    const narrow = window.matchMedia("(max-width: 700px)").matches;
    for (let wait = 0; narrow && wait < 5000; wait += 100) {  // a phone: the list starts folded away
        setTimeout(() => {
            const sidebar = document.querySelector("#sidebar");
            if (sidebar && !sidebar.dataset.folded && sidebar.closest(".sidebar.open, .open")) {
                sidebar.dataset.folded = "1";
                sidebar.closest(".sidebar, .open")?.querySelector("button[aria-label='Toggle Sidebar']")?.click();
            }
        }, wait);
    }
    document.addEventListener("keydown", (event) => {  // Escape stops a reply
        if (event.key === "Escape") document.querySelector("#stop")?.click();
    });
    document.addEventListener("click", (event) => {  // "‹ 2 / 3 ›" and ↻ under a message
        const button = event.target.closest?.("button.branch-step");
        if (!button || button.disabled) return;
        event.preventDefault();
        event.stopPropagation();
        const step = [...button.classList].map((c) => c.match(/^bs-(\\d+)-(\\d+)$/)).find(Boolean);
        const retry = [...button.classList].map((c) => c.match(/^br-(\\d+)$/)).find(Boolean);
        const box = document.querySelector("#branch-target textarea, #branch-target input");
        if (!box || !(step || retry)) return;
        box.value = step ? `${step[1]}:${step[2]}` : retry[1];
        box.dispatchEvent(new Event("input", {bubbles: true}));
        setTimeout(() => document.querySelector(step ? "#branch-go" : "#retry-go")?.click(), 50);
    }, true);
}"""
CSS = """
#versions-row { flex-wrap: nowrap; align-items: center; }
.branch-nav { font-size: 0.85em; opacity: 0.85; white-space: nowrap; }
.message-row:has(.branch-nav) .message { background: none !important; border: none !important;
  padding: 0 !important; box-shadow: none !important; }
.branch-nav button { padding: 0 0.5em; font-size: 1.1em; cursor: pointer; }
.branch-nav button:disabled { opacity: 0.3; cursor: default; }
/* the controls under a message are a message of their own: no copy or edit buttons on them */
.message-row:has(.branch-nav) + .message-buttons { display: none !important; }
@media (max-width: 640px) {  /* a phone: the chat fills the screen, the input and its button stay in view */
  #header p { display: none; }
  #header h2 { font-size: 1.05rem; margin: 0; }
  #chatbot { height: calc(100dvh - 260px) !important; min-height: 160px; }
  #input-row { position: sticky; bottom: 0; z-index: 10; flex-wrap: nowrap !important;
               background: var(--body-background-fill); padding-bottom: 4px; }
  #input-row > * { min-width: 0 !important; }
  #send, #stop { flex: 0 0 72px !important; }
}
"""
LATEX = [{"left": "$$", "right": "$$", "display": True}, {"left": "\\[", "right": "\\]", "display": True},
         {"left": "$", "right": "$", "display": False}, {"left": "\\(", "right": "\\)", "display": False}]
DEMO_PLACEHOLDER = ("The `demo` model is a toy trained here in under an hour: it does two-digit arithmetic with "
                    "its steps in a thinking block, follow-ups (\"and plus 7?\", \"double it\") and a few phrases. "
                    "Nothing else.")


def build(handlers: ChatHandlers, *, model_label: str, max_new_tokens: int, placeholder: str = "Ask anything.",
          storage_secret: str = "rewind-chat") -> gr.Blocks:
    """`storage_secret`: what the browsers' copies of their conversations are sealed with; the
    same across restarts, or every browser's list is unreadable after one (see README)."""
    chat_list = ChatList(handlers)
    events = PageEvents(handlers, recover=chat_list.recover)
    defaults = Settings()
    directory = handlers.directory
    with gr.Blocks(title="rewind-chat", fill_height=True) as demo:
        # Plain functions, not bound methods: Gradio deep-copies component props for every page it
        # serves, and a bound method's copy would take the directory, the engine and the model along.
        key = gr.State(None, delete_callback=lambda closed: directory.close(closed))
        parked = gr.State({}, delete_callback=lambda kept: [directory.close(k) for k in (kept or {}).values()])
        store = gr.BrowserState(empty_store(), storage_key="rewind-chat-conversations", secret=storage_secret)
        with gr.Sidebar(label="Conversations", open=True, elem_id="sidebar", width=280):
            sidebar_new_chat = gr.Button("New chat", size="sm", elem_id="sidebar-new-chat")
            chats = gr.Radio(choices=[], label="Kept in this browser", elem_id="chat-list")
            title = gr.Textbox(label="Name of this conversation", elem_id="chat-title", max_lines=1)
            rename = gr.Button("Rename", size="sm", elem_id="rename")
            with gr.Row():
                export_json = gr.Button("Export JSON", size="sm", elem_id="export-json")
                export_markdown = gr.Button("Export Markdown", size="sm", elem_id="export-markdown")
            download = gr.File(label="Download", visible=False, interactive=False, elem_id="download")
            import_file = gr.UploadButton("Import JSON", file_types=[".json"], size="sm", elem_id="import")
            delete = gr.Button("Delete this conversation", size="sm", variant="stop", elem_id="delete")
            confirm_delete = gr.Button("Yes, delete it for good", size="sm", variant="stop", visible=False,
                                       elem_id="confirm-delete")
        gr.Markdown(f"## rewind-chat · {model_label}\n"
                    "One KV cache per conversation, rolled back instead of recomputed: "
                    "regenerate, undo, edit, stop and branches reuse everything before the change.",
                    elem_id="header")
        chatbot = gr.Chatbot(label="Chat", editable="all", height=520, examples=[{"text": t} for t in EXAMPLES],
                             placeholder=placeholder, sanitize_html=True, elem_id="chatbot",
                             latex_delimiters=LATEX, buttons=["copy"], feedback_options=None,
                             group_consecutive_messages=False)
        with gr.Row(equal_height=True, elem_id="versions-row"):
            versions = gr.Markdown("", visible=False, elem_id="versions")
            previous_version = gr.Button("◀", size="sm", visible=False, elem_id="previous-version", scale=0)
            next_version = gr.Button("▶", size="sm", visible=False, elem_id="next-version", scale=0)
        with gr.Row(elem_id="input-row", equal_height=True):  # Send turns into Stop while a reply streams
            textbox = gr.Textbox(placeholder=views.READY, show_label=False, scale=6, elem_id="message",
                                 autofocus=True)
            send = gr.Button("Send", variant="primary", scale=1, min_width=72, elem_id="send")
            stop = gr.Button("Stop", variant="stop", scale=1, min_width=72, elem_id="stop", visible=False)
        with gr.Row():
            continue_button = gr.Button("Continue", size="sm", elem_id="continue")
            new_chat = gr.Button("New chat", size="sm", elem_id="new-chat")
            dark = gr.Button("Light / dark", size="sm", elem_id="dark-mode")
        stats = gr.Markdown("", elem_id="stats")
        with gr.Accordion("Settings", open=False):
            panel = dict(
                system_prompt=gr.Textbox(label="System prompt (changing it starts a new branch; the old one is kept)",
                                         value=defaults.system_prompt, elem_id="system-prompt"),
                thinking=gr.Checkbox(label="Thinking (for models whose template supports it)", value=defaults.thinking),
                max_new_tokens=gr.Slider(1, max_new_tokens, value=min(defaults.max_new_tokens, max_new_tokens), step=1,
                                         label="Max new tokens", elem_id="max-new-tokens"),
                temperature=gr.Slider(0, 2, value=defaults.temperature, step=0.05, label="Temperature (0 = greedy)",
                                      elem_id="temperature"),
                top_p=gr.Slider(0.05, 1, value=defaults.top_p, step=0.01, label="Top-p"),
                top_k=gr.Slider(0, 200, value=defaults.top_k, step=1, label="Top-k (0 = off)"),
                repetition_penalty=gr.Slider(0.5, 2, value=defaults.repetition_penalty, step=0.01,
                                             label="Repetition penalty"),
            )
        branch_target = gr.Textbox(visible="hidden", elem_id="branch-target")
        branch_go = gr.Button(visible="hidden", elem_id="branch-go")
        retry_go = gr.Button(visible="hidden", elem_id="retry-go")
        settings = [panel[name] for name in Settings.names()]
        components = dict(chat=chatbot, textbox=textbox, key=key, stats=stats, versions=versions,
                          previous_version=previous_version, next_version=next_version, send=send, stop=stop,
                          system_prompt=panel["system_prompt"])
        outputs = [components[name] for name in ChatOutputs.names()]
        list_outputs = [store, parked, chats, confirm_delete, download, title]
        with_settings = [key, *settings]
        with_store = [key, store, *settings]

        generating = dict(concurrency_id="generate")  # shares the queue's default concurrency limit
        private = dict(api_visibility="private")
        quiet = dict(queue=False, api_name=False, show_progress="hidden")

        def on(trigger: Any, fn: Callable, inputs: list, **options: Any) -> None:
            """A conversation event as the browser runs it: the server first gets the shown
            conversation back if it lost it, then the event, then the browser's copy is updated.
            (API clients call the event itself, by its name.)"""
            trigger(chat_list.ensure, [key, store], [key], **quiet) \
                .then(fn, inputs, outputs, **options) \
                .then(chat_list.sync, [key, store], [store, chats], **quiet)

        on(textbox.submit, streamed(handlers.send), [textbox, *with_settings], api_name=False, **generating)
        on(send.click, streamed(handlers.send), [textbox, *with_settings], api_name="send", **generating)
        on(continue_button.click, streamed(handlers.continue_reply), with_settings, api_name="continue", **generating)
        on(previous_version.click, instant(lambda k, *s: handlers.select_version(-1, k, *s)), with_settings,
           api_name="previous_version")
        on(next_version.click, instant(lambda k, *s: handlers.select_version(1, k, *s)), with_settings,
           api_name="next_version")
        on(branch_go.click, instant(handlers.switch_branch), [branch_target, *with_settings], api_name="switch_branch")
        on(retry_go.click, streamed(handlers.retry_at), [branch_target, *with_settings], api_name=False,
           **generating)
        # the Chatbot's own events carry the shown message's index; they get the conversation back themselves
        for trigger, fn, name, extra in ((chatbot.retry, streamed(events.on_retry), "chatbot_retry", generating),
                                         (chatbot.undo, instant(events.on_undo), "chatbot_undo", {}),
                                         (chatbot.edit, streamed(events.on_edit), "chatbot_edit", generating),
                                         (chatbot.example_select, streamed(events.on_example), "chatbot_example",
                                          generating)):
            trigger(fn, with_store, outputs, api_name=name, **private, **extra) \
                .then(chat_list.sync, [key, store], [store, chats], **quiet)
        stop.click(handlers.stop, [key], None, api_name="stop", queue=False)
        dark.click(None, js="() => document.body.classList.toggle('dark')", api_name=False)

        # the list of conversations (kept in the browser)
        with_list = [*outputs, *list_outputs]
        for button in (new_chat, sidebar_new_chat):
            button.click(chat_list.new_chat, [key, store, parked], with_list, api_name=False)
        chats.input(chat_list.open, [chats, key, store, parked], with_list, api_name=False)
        rename.click(chat_list.rename, [title, store], [store, chats], api_name=False)
        delete.click(chat_list.ask_delete, None, confirm_delete, api_name=False)
        confirm_delete.click(chat_list.delete, [key, store, parked], with_list, api_name=False)
        export_json.click(functools.partial(chat_list.export, "json"), [key, store], download, api_name=False)
        export_markdown.click(functools.partial(chat_list.export, "markdown"), [key, store], download,
                              api_name=False)
        import_file.upload(chat_list.import_file, [import_file, key, store, parked], with_list, api_name=False)
        demo.load(chat_list.load, [store], with_list, api_name=False)

        # API twins of the browser's events (the Chatbot's need browser event data)
        gr.Button(visible=False).click(instant(handlers.clear), with_settings, outputs, api_name="clear")
        gr.Button(visible=False).click(streamed(handlers.regenerate), with_settings, outputs,
                                       api_name="regenerate", **generating)
        regenerate_index = gr.Number(visible=False, precision=0)
        gr.Button(visible=False).click(streamed(handlers.regenerate_at), [regenerate_index, *with_settings], outputs,
                                       api_name="regenerate_at", **generating)
        gr.Button(visible=False).click(instant(handlers.undo), with_settings, outputs, api_name="undo")
        edit_index, edit_text = gr.Number(visible=False, precision=0), gr.Textbox(visible=False)
        gr.Button(visible=False).click(streamed(handlers.edit), [edit_index, edit_text, *with_settings], outputs,
                                       api_name="edit", **generating)
        gr.Button(visible=False).click(instant(handlers.edit_reply), [edit_index, edit_text, *with_settings],
                                       outputs, api_name="edit_reply")
        demo.unload(events.on_unload)
        status = gr.JSON(visible=False)
        gr.Button(visible=False).click(events.server_status, None, status, api_name="status", queue=False)
    return demo


def port_is_free(host: str, port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def load_engine(config: AppConfig) -> Any:
    """The embedded engine, or an OpenAI-compatible server behind the same face (chat/served.py)."""
    if config.backend == "openai":
        from chat.served import ServedEngine

        engine = ServedEngine(config.base_url, config.model, api_key=config.api_key, tokenizer=config.tokenizer,
                              prompt_format=config.prompt_format)
        print(f"rewind-chat: replies from {config.base_url} (model {config.model}); tokenizer and template from "
              f"{config.tokenizer or config.model}", flush=True)
        return engine
    # On ZeroGPU each call runs in a worker process: caches live on the CPU between calls, and
    # shared prefixes (kept inside a worker) are off.
    engine = ChatEngine.load(config.model, device="cuda" if ON_ZERO_GPU else config.device, dtype=config.dtype,
                             max_checkpoints=config.max_checkpoints, offload_sessions=ON_ZERO_GPU,
                             max_batch_size=config.max_batch, prefill_chunk=config.prefill_chunk,
                             cache_budget_bytes=int(config.cache_budget_mb * 2**20),
                             **(dict(shared_prefixes=0) if ON_ZERO_GPU else {}))
    if ON_ZERO_GPU:  # each reply runs in the worker process `spaces.GPU` forks (chat/remote.py)
        remote.ENGINE = engine
        engine.run_replies_in(spaces.GPU(duration=120)(remote.run_in_worker))
    model = engine.model
    print(f"rewind-chat: model {config.model} ({type(model).__name__}, "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters) on {model.device}, "
          f"{str(model.dtype).replace('torch.', '')}", flush=True)
    return engine


def main(argv: list[str] | None = None) -> int:
    config = AppConfig.from_args(argv)
    if not port_is_free(config.host, config.port):
        print(f"rewind-chat: port {config.port} on {config.host} is in use; choose another with --port (or PORT)",
              file=sys.stderr)
        return 1
    if config.backend not in ("local", "openai") or (config.backend == "openai" and not config.base_url):
        print("rewind-chat: --backend is local or openai, and openai needs --base-url (BASE_URL)", file=sys.stderr)
        return 1
    if config.prompt_format not in ("messages", "text", "token-ids"):
        print("rewind-chat: --prompt-format is messages, text or token-ids", file=sys.stderr)
        return 1
    try:
        engine = load_engine(config)
    except ModelLoadError as error:
        print(f"rewind-chat: {error}", file=sys.stderr)
        return 1
    directory = ChatDirectory(engine, max_sessions=config.max_sessions, idle_timeout_s=config.idle_timeout_min * 60,
                              max_per_client=config.max_per_client or None)
    is_demo = config.model == "demo" and config.backend == "local"
    label = "`demo` (a toy model trained here: arithmetic and a few phrases)" if is_demo else f"`{config.model}`"
    if config.backend == "openai":
        label = f"`{config.model}` (served at {config.base_url})"
    limits = Limits(max_new_tokens=config.max_new_tokens, max_message_chars=config.max_message_chars,
                    max_system_chars=config.max_system_chars)
    metrics = Metrics(directory)
    demo = build(ChatHandlers(engine, directory, limits=limits, metrics=metrics), model_label=label,
                 max_new_tokens=config.max_new_tokens, storage_secret=config.storage_secret,
                 **(dict(placeholder=DEMO_PLACEHOLDER) if is_demo else {}))
    demo.queue(default_concurrency_limit=config.streams, max_size=256)
    gradio_tuning.poll_queue_every(demo)  # two costs of Gradio's that slow decoding down (see there)
    gradio_tuning.pass_skipped_outputs_through()
    # show_error: a refused API input says why (Gradio's own checks of a component's value included)
    demo.launch(server_name=config.host, server_port=config.port, enable_monitoring=config.monitoring, show_error=True,
                footer_links=["api"], run_history=False, quiet=True, prevent_thread_lock=True,
                css=CSS, js=PAGE_SCRIPT,
                app_kwargs={"middleware": [Middleware(SecurityHeaders)], "routes": routes(directory, metrics)})
    print(f"rewind-chat: open {demo.local_url} (health: {demo.local_url}healthz, metrics: {demo.local_url}metrics)",
          flush=True)
    demo.block_thread()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
