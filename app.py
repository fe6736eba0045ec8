"""rewind-chat: the Gradio UI. Layout and wiring only; the handlers live in ui/.

Run `python app.py` (offline demo model) or `python app.py --model Qwen/Qwen3-0.6B`.
Conversations live on the server, one per browser session, found through a key the server
makes and keeps in `gr.State`; no endpoint takes a session id from the client.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import gradio as gr
from starlette.middleware import Middleware

from chat import ChatEngine, ModelLoadError
from chat.api import ApiRuns, api_routes
from chat.backends import remote
from chat.storage.shares import Shares
from chat.storage.store import Quotas, Records, SignOuts, default_url, open_database
from ui.accounts import AccountCopy, AccountEvents, SignedOutSessions, sign_in_configured
from ui.browser_copy import Book
from ui.chat_list import ChatList
from ui.config import AppConfig
from ui.directory import ChatDirectory, Closes
from ui.handlers import ChatHandlers, PageEvents
from ui.inputs import Limits, StrictBlocks, text_only
from ui.launch import port_is_free, serve
from ui.operator import Metrics, routes
from ui.sharing import Sharing
from ui import views
from ui.outputs import Settings
from ui.page_assets import LATEX
from ui.wiring import wire_api_twins, wire_conversation, wire_list, wire_load, wire_sharing

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


DEMO_PLACEHOLDER = ("The `demo` model is a toy trained here on two CPU cores: two-digit addition and subtraction "
                    "and one-digit times two-digit multiplication, asked in many ways at any point of the "
                    "chat, with its steps in a thinking block, and a few phrases about this app. Nothing else.")


EXPORTS_KEPT_S = 600  # Gradio's copies of exports and uploads are deleted this long after they were made
# the page's own scripts: its copy of the conversations, its settings, the links it shared


def build(handlers: ChatHandlers, *, model_label: str, max_new_tokens: int,
          placeholder: str = "Ask anything.", sharing: Sharing | None = None,
          account_copy: AccountCopy | None = None) -> gr.Blocks:
    """The page. With `account_copy` (OAuth configured: a Space with `hf_oauth: true`), a Sign in
    button, and signed-in people's conversations kept in the store too (ui/accounts.py)."""
    chat_list = ChatList(handlers, sharing, account_copy)
    directory = handlers.directory
    with StrictBlocks(title="rewind-chat", fill_height=True, delete_cache=(EXPORTS_KEPT_S, EXPORTS_KEPT_S)) as demo:
        # the browser's copy (ui/browser_copy.py): the page's book of it, what the server sends
        # to be written, what the page's script says before an event, what the server asks for
        page = dict(key=gr.State(None, delete_callback=Closes(directory)),
                    book=gr.State(Book(), delete_callback=Closes(directory, parked=True)),
                    outbox=gr.JSON(visible=False), probe=gr.JSON(visible=False), need=gr.JSON(visible=False),
                    event=gr.JSON(visible=False), applied_prompt=gr.JSON(visible=False))
        page |= sidebar(max_new_tokens, sign_in=account_copy is not None)
        gr.Markdown(f"**rewind-chat** · {model_label}", elem_id="header")
        page |= chat_area(placeholder, handlers.limits.max_message_chars)
        page |= dict(branch_target=gr.Textbox(visible="hidden", elem_id="branch-target"),
                     branch_go=gr.Button(visible="hidden", elem_id="branch-go"),
                     retry_go=gr.Button(visible="hidden", elem_id="retry-go"),
                     prepare_go=gr.Button(visible="hidden", elem_id="prepare-go"),
                     prepare_asked=gr.Number(visible=False, precision=0),  # which ask the server took
                     fork_target=gr.Textbox(visible="hidden", elem_id="fork-target"),
                     fork_go=gr.Button(visible="hidden", elem_id="fork-go"),
                     list_refresh=gr.Button(visible="hidden", elem_id="list-refresh"))
        events = PageEvents(handlers)
        wire_conversation(handlers, events, chat_list, page)
        wire_list(chat_list, page)
        if sharing is not None:
            wire_sharing(sharing, chat_list, page, demo)
        wire_api_twins(handlers, page)
        wire_load(chat_list, page, demo, AccountEvents(account_copy, handlers.limits) if account_copy else None)
        demo.unload(events.on_unload)
        status = gr.JSON(visible=False)
        gr.Button(visible=False).click(events.server_status, None, status, api_name="status", queue=False)
    return demo


def sidebar(max_new_tokens: int, sign_in: bool = False) -> dict[str, Any]:
    """The list and everything about it, the settings and light/dark: the chat's own column is
    the conversation and its box only (a page like the chat apps people use)."""
    with gr.Sidebar(label="Conversations", open=True, elem_id="sidebar", width=280):
        if sign_in:  # signed in, the list follows the person to their other browsers
            gr.LoginButton(value="Sign in to keep your chats on every device", logout_value="Sign out ({})",
                           size="sm", elem_id="sign-in")
        parts = dict(claim=gr.Button("", size="sm", visible=False, elem_id="claim"), claim_ids=gr.JSON(visible=False))
        parts |= dict(new_chat=gr.Button("New chat", size="sm", variant="primary", elem_id="new-chat"),
                     search=gr.Textbox(label="Search chats", placeholder="Search chats", show_label=False, elem_id="chat-search",
                                       max_lines=1, container=False),  # the page filters the list (no event)
                     chats=gr.Radio(choices=[], label="Kept in this browser", elem_id="chat-list"),
                     title=text_only("title", label="Name of this conversation", elem_id="chat-title", max_lines=1),
                     rename=gr.Button("Rename", size="sm", elem_id="rename"))
        with gr.Row():
            parts |= dict(export_json=gr.Button("Export JSON", size="sm", elem_id="export-json"),
                          export_markdown=gr.Button("Export Markdown", size="sm", elem_id="export-markdown"),
                          export_all=gr.Button("Export all", size="sm", elem_id="export-all"))
        parts |= dict(export_file=gr.JSON(visible=False),  # the page downloads what an export gives
                      # the page reads the chosen file and sends its text: nothing is uploaded, so no path
                      # a client names is ever opened here
                      import_file=gr.Button("Import JSON", size="sm", elem_id="import"),
                      import_text=gr.JSON(visible=False),
                      import_drop=gr.Button(visible="hidden", elem_id="import-drop"),  # a file dropped on the page
                      delete=gr.Button("Delete this conversation", size="sm", variant="stop", elem_id="delete"),
                      confirm_delete=gr.Button("Yes, delete it for good", size="sm", variant="stop", visible=False,
                                               elem_id="confirm-delete"),
                      cancel_delete=gr.Button("Cancel", size="sm", visible=False, elem_id="cancel-delete"),
                      share=gr.Button("Share a link to this chat", size="sm", elem_id="share"))
        parts["shared_links"] = gr.HTML("", elem_id="shared-links")  # drawn by the page (ui/sharing.py)
        parts |= dict(share_made=gr.JSON(visible=False), revoke_request=gr.JSON(visible=False),
                      account_links=gr.JSON(visible=False),
                      revoke_done=gr.JSON(visible=False), revoke_go=gr.Button(visible="hidden", elem_id="revoke-go"))
        parts["panel"] = settings_panel(max_new_tokens)
        parts["dark"] = gr.Button("Light / dark", size="sm", elem_id="dark-mode")
    return parts


def chat_area(placeholder: str, max_message_chars: int) -> dict[str, Any]:
    examples = [{"text": text} for text in EXAMPLES]
    # the chat takes the window's height, the box at its foot (the page's style and script)
    parts = dict(chatbot=gr.Chatbot(label="Chat", show_label=False, editable="all", height=520, examples=examples,
                                    placeholder=placeholder, sanitize_html=True, elem_id="chatbot",
                                    latex_delimiters=LATEX, buttons=["copy"], feedback_options=None,
                                    group_consecutive_messages=False))
    # the last reply's versions: shown in the chat as its ‹ 2 / 3 › (one control for every branch);
    # this label is for API clients
    parts["versions"] = gr.Markdown("", visible=False, elem_id="versions")
    with gr.Row(elem_id="input-row", equal_height=True):  # Send turns into Stop while a reply streams
        # a long paste scrolls inside the box (8 lines at most); the page says when it is over the
        # limit (the class carries it to the page's script), as it is crossed, not after Send
        parts |= dict(textbox=text_only("message", placeholder=views.LOADING, label="Message", show_label=False, scale=6,
                                         elem_id="message", autofocus=True, lines=1, max_lines=8,
                                         elem_classes=[f"limit-{max_message_chars}"]),
                      send=gr.Button("Send", variant="primary", scale=1, min_width=72, elem_id="send"),
                      stop=gr.Button("Stop", variant="stop", scale=1, min_width=72, elem_id="stop", visible=False),
                      continue_button=gr.Button("Continue", scale=1, min_width=88, elem_id="continue"))
    parts["stats"] = gr.Markdown("", elem_id="stats")  # what the last turn cost: small, under the box
    return parts


def settings_panel(max_new_tokens: int) -> dict[str, Any]:
    """Settings as a person reads them; the sampling knobs a developer wants fold away under More."""
    defaults = Settings()
    with gr.Accordion("Settings", open=False, elem_id="settings"):
        # the labels name the API's parameters too (Gradio derives them): they stay; `info` says it for people
        panel = dict(
            system_prompt=text_only("system_prompt",
                                    label="System prompt (changing it starts a new branch; the old one is kept)",
                                     info="Instructions the assistant follows in this conversation",
                                     value=defaults.system_prompt, elem_id="system-prompt"),
            prompt_note=gr.Markdown("", elem_id="prompt-note"),
            thinking=gr.Checkbox(label="Thinking (for models whose template supports it)", value=defaults.thinking,
                                 info="The model reasons before it answers; the reasoning folds away above the answer"),
            max_new_tokens=gr.Slider(1, max_new_tokens, value=min(defaults.max_new_tokens, max_new_tokens), step=1,
                                     label="Max new tokens",
                                     info="The longest reply, in tokens (about ¾ of a word each)",
                                     elem_id="max-new-tokens"),
            temperature=gr.Slider(0, 2, value=defaults.temperature, step=0.05, label="Temperature (0 = greedy)",
                                  info="Creativity: 0 always picks the likeliest word; higher varies more",
                                  elem_id="temperature"),
            prepare_toggle=prepare_switch(),  # the browser's own: not one of `Settings`
        )
        with gr.Accordion("More (for developers)", open=False, elem_id="more-settings"):
            panel |= dict(
                top_p=gr.Slider(0.05, 1, value=defaults.top_p, step=0.01, label="Top-p"),
                top_k=gr.Slider(0, 200, value=defaults.top_k, step=1, label="Top-k (0 = off)"),
                repetition_penalty=gr.Slider(0.5, 2, value=defaults.repetition_penalty, step=0.01,
                                             label="Repetition penalty"))
    return panel


def prepare_switch() -> gr.Checkbox:
    """Kept in the browser only (ui/page_assets.py): the server keeps no setting, and no text."""
    return gr.Checkbox(label="Prepare the reply while I type (the message is sent to this server as you type, "
                             "to compute it ahead; nothing is kept but the model's cache)",
                       value=True, interactive=True, elem_id="prepare-toggle")


def load_engine(config: AppConfig) -> Any:
    """The embedded engine, or an OpenAI-compatible server behind the same face (chat/backends/served.py)."""
    if config.backend == "openai":
        from chat.backends.served import ServedEngine

        engine = ServedEngine(config.base_url, config.model, api_key=config.api_key, tokenizer=config.tokenizer,
                              prompt_format=config.prompt_format, warm_while_typing=config.warm_served)
        print(f"rewind-chat: replies from {config.base_url} (model {config.model}); tokenizer and template from "
              f"{config.tokenizer or config.model}", flush=True)
        return engine
    # On ZeroGPU each call runs in a worker process: caches live on the CPU between calls, and
    # shared prefixes (kept inside a worker) and the cold tier (the sessions travel) are off.
    engine = ChatEngine.load(config.model, device="cuda" if ON_ZERO_GPU else config.device, dtype=config.dtype,
                             max_checkpoints=config.max_checkpoints, offload_sessions=ON_ZERO_GPU,
                             max_batch_size=config.max_batch, prefill_chunk=config.prefill_chunk,
                             prefill_chunk_alone=config.prefill_chunk_alone,
                             cache_budget_bytes=int(config.cache_budget_mb * 2**20),
                             cache_dir=None if ON_ZERO_GPU else config.cache_dir,
                             cache_dir_bytes=int(config.cache_dir_mb * 2**20), kv_cache=config.kv_cache,
                             kv_bits=config.kv_bits, weights=config.weights, compile=config.compile,
                             draft=config.draft,
                             **(dict(shared_prefixes=0) if ON_ZERO_GPU else {}))
    if ON_ZERO_GPU:  # each reply runs in the worker process `spaces.GPU` forks (chat/backends/remote.py)
        remote.ENGINE = engine
        engine.run_replies_in(spaces.GPU(duration=120)(remote.run_in_worker))
    model = engine.model
    chosen = getattr(engine, "weights", config.weights)  # "auto" resolved by timing (chat/model_step/weights.py)
    held = str(model.dtype).replace("torch.", "") + ("" if chosen == "full" else f", {chosen} weights") + \
        (f" (auto: {chosen} timed faster here)" if config.weights == "auto" and chosen != "full" else "")
    # packed and int8 layers hold their weights as buffers
    weights = sum(tensor.numel() for tensor in (*model.parameters(), *model.buffers()))
    print(f"rewind-chat: model {config.model} ({type(model).__name__}, "
          f"{weights / 1e6:.1f} M parameters) on {model.device}, {held}", flush=True)
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
    if config.storage_secret:
        print("rewind-chat: STORAGE_SECRET is no longer used: the copy each browser keeps is not sealed (its key "
              "is sent to every page); the server checks every copy as an Import", file=sys.stderr)
    os.environ["FORWARDED_ALLOW_IPS"] = config.proxies  # uvicorn's: whose X-Forwarded-For it believes
    if config.proxies:
        print(f"rewind-chat: trusting X-Forwarded-For from {config.proxies}", flush=True)
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
    database = open_database(config.store_url or default_url())
    sharing = Sharing(directory, Shares(database, Quotas(anonymous_share_days=config.anonymous_share_days)))
    account_copy = AccountCopy(Records(database)) if sign_in_configured() else None
    demo = build(ChatHandlers(engine, directory, limits=limits, metrics=metrics), model_label=label,
                 max_new_tokens=config.max_new_tokens, sharing=sharing, account_copy=account_copy,
                 **(dict(placeholder=DEMO_PLACEHOLDER) if is_demo else {}))
    # signed in: a sign-out holds on every replica (inside Gradio's session middleware: it sees the session)
    middleware = [Middleware(SignedOutSessions, sign_outs=SignOuts(database))] if account_copy is not None else []
    api = ApiRuns(engine, max_new_tokens=config.max_new_tokens) \
        if config.serve_api and config.backend == "local" and not ON_ZERO_GPU else None
    served_api = api_routes(api, api_key=config.serve_api_key, max_body_bytes=int(config.max_request_mb * 2**20)) \
        if api is not None else []
    return serve(demo, config, routes(directory, metrics, api) + sharing.routes() + served_api, middleware)


def run() -> None:
    """The `rewind-chat` command (pyproject.toml), as `python app.py`."""
    from chat.host import end_process

    end_process(main())


if __name__ == "__main__":
    run()
