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
from ui.config import AppConfig
from ui.directory import ChatDirectory
from ui.handlers import ChatHandlers, PageEvents
from ui.inputs import Limits
from ui.operator import Metrics, routes
from ui.security import SecurityHeaders
from ui import views
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


ESCAPE_STOPS = """() => document.addEventListener("keydown", (event) => {
    if (event.key === "Escape") document.querySelector("#stop")?.click();
})"""
CSS = """
#versions-row { flex-wrap: nowrap; align-items: center; }
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


def build(handlers: ChatHandlers, *, model_label: str, max_new_tokens: int,
          placeholder: str = "Ask anything.") -> gr.Blocks:
    events = PageEvents(handlers)
    defaults = Settings()
    with gr.Blocks(title="rewind-chat", fill_height=True) as demo:
        gr.Markdown(f"## rewind-chat · {model_label}\n"
                    "One KV cache per conversation, rolled back instead of recomputed: "
                    "regenerate, undo, edit, stop and versions reuse everything before the change.",
                    elem_id="header")
        key = gr.State(None, delete_callback=handlers.directory.close)
        chatbot = gr.Chatbot(label="Chat", editable="user", height=520, examples=[{"text": t} for t in EXAMPLES],
                             placeholder=placeholder, sanitize_html=True, elem_id="chatbot",
                             latex_delimiters=LATEX, buttons=["copy"], feedback_options=None)
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
                system_prompt=gr.Textbox(label="System prompt (changing it starts a new conversation)",
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
        settings = [panel[name] for name in Settings.names()]
        components = dict(chat=chatbot, textbox=textbox, key=key, stats=stats, versions=versions,
                          previous_version=previous_version, next_version=next_version, send=send, stop=stop)
        outputs = [components[name] for name in ChatOutputs.names()]
        with_settings = [key, *settings]

        generating = dict(concurrency_id="generate")  # shares the queue's default concurrency limit
        private = dict(api_visibility="private")
        textbox.submit(streamed(handlers.send), [textbox, *with_settings], outputs, api_name=False, **generating)
        send.click(streamed(handlers.send), [textbox, *with_settings], outputs, api_name="send", **generating)
        chatbot.retry(streamed(events.on_retry), with_settings, outputs, api_name="chatbot_retry", **private,
                      **generating)
        chatbot.undo(instant(events.on_undo), with_settings, outputs, api_name="chatbot_undo", **private)
        chatbot.edit(streamed(events.on_edit), with_settings, outputs, api_name="chatbot_edit", **private,
                     **generating)
        chatbot.example_select(streamed(events.on_example), with_settings, outputs, api_name="chatbot_example",
                               **private, **generating)
        continue_button.click(streamed(handlers.continue_reply), with_settings, outputs, api_name="continue",
                              **generating)
        previous_version.click(instant(lambda k, *s: handlers.select_version(-1, k, *s)), with_settings, outputs,
                               api_name="previous_version")
        next_version.click(instant(lambda k, *s: handlers.select_version(1, k, *s)), with_settings, outputs,
                           api_name="next_version")
        new_chat.click(instant(handlers.clear), with_settings, outputs, api_name="clear")
        dark.click(None, js="() => document.body.classList.toggle('dark')", api_name=False)
        stop.click(handlers.stop, [key], None, api_name="stop", queue=False)
        # API twins of the chatbot's own events (which need browser event data)
        gr.Button(visible=False).click(streamed(handlers.regenerate), with_settings, outputs,
                                       api_name="regenerate", **generating)
        gr.Button(visible=False).click(instant(handlers.undo), with_settings, outputs, api_name="undo")
        edit_index, edit_text = gr.Number(visible=False, precision=0), gr.Textbox(visible=False)
        gr.Button(visible=False).click(streamed(handlers.edit), [edit_index, edit_text, *with_settings], outputs,
                                       api_name="edit", **generating)
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


def main(argv: list[str] | None = None) -> int:
    config = AppConfig.from_args(argv)
    if not port_is_free(config.host, config.port):
        print(f"rewind-chat: port {config.port} on {config.host} is in use; choose another with --port (or PORT)",
              file=sys.stderr)
        return 1
    try:
        # On ZeroGPU each call runs in a worker process: caches live on the CPU between calls, and
        # shared prefixes (kept inside a worker) are off.
        engine = ChatEngine.load(config.model, device="cuda" if ON_ZERO_GPU else config.device, dtype=config.dtype,
                                 max_checkpoints=config.max_checkpoints, offload_sessions=ON_ZERO_GPU,
                                 max_batch_size=config.max_batch, prefill_chunk=config.prefill_chunk,
                                 **(dict(shared_prefixes=0) if ON_ZERO_GPU else {}))
    except ModelLoadError as error:
        print(f"rewind-chat: {error}", file=sys.stderr)
        return 1
    model = engine.model
    print(f"rewind-chat: model {config.model} ({type(model).__name__}, "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters) on {model.device}, "
          f"{str(model.dtype).replace('torch.', '')}", flush=True)
    directory = ChatDirectory(engine, budget_bytes=int(config.cache_budget_mb * 2**20),
                              max_sessions=config.max_sessions, idle_timeout_s=config.idle_timeout_min * 60,
                              max_per_client=config.max_per_client or None)
    runner = None
    if ON_ZERO_GPU:
        remote.ENGINE = engine
        runner = spaces.GPU(duration=120)(remote.run_plan)
    is_demo = config.model == "demo"
    label = "`demo` (a toy model trained here: arithmetic and a few phrases)" if is_demo else f"`{config.model}`"
    limits = Limits(max_new_tokens=config.max_new_tokens, max_message_chars=config.max_message_chars,
                    max_system_chars=config.max_system_chars)
    metrics = Metrics(directory)
    demo = build(ChatHandlers(engine, directory, runner=runner, limits=limits, metrics=metrics), model_label=label,
                 max_new_tokens=config.max_new_tokens, **(dict(placeholder=DEMO_PLACEHOLDER) if is_demo else {}))
    demo.queue(default_concurrency_limit=config.streams, max_size=256)
    # show_error: a refused API input says why (Gradio's own checks of a component's value included)
    demo.launch(server_name=config.host, server_port=config.port, enable_monitoring=config.monitoring, show_error=True,
                footer_links=["api"], run_history=False, quiet=True, prevent_thread_lock=True,
                css=CSS, js=ESCAPE_STOPS,
                app_kwargs={"middleware": [Middleware(SecurityHeaders)], "routes": routes(directory, metrics)})
    print(f"rewind-chat: open {demo.local_url} (health: {demo.local_url}healthz, metrics: {demo.local_url}metrics)",
          flush=True)
    demo.block_thread()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
