"""Which component triggers which handler, with what inputs and outputs: the page's events.

Handlers take and give named dataclasses (ui/outputs.py); Gradio wants positional lists and
tuples, made here from those names and nowhere else.
"""

from __future__ import annotations

import functools
import inspect
import json
from typing import Any, Callable, Iterator

import gradio as gr

from ui.chat_list import ChatList
from ui.handlers import ChatHandlers, PageEvents
from ui.inputs import text_only
from ui.outputs import ChatOutputs, Settings
from ui.page_assets import FORK_INPUT, TARGET_INPUT
from ui import sharing as share_script
from ui.sharing import Sharing
from ui.accounts import AccountEvents


def streamed(handler: Callable[..., Iterator[ChatOutputs]]) -> Callable[..., Iterator[tuple]]:
    """Gradio wants output tuples: a streaming handler's ChatOutputs, turned into them one by one.
    The handler's signature stays (Gradio injects event data and requests by it), the settings named."""
    @functools.wraps(handler)
    def run(*args: Any) -> Iterator[tuple]:
        for outputs in handler(*args):
            yield outputs.to_gradio()
    return settings_named(run)


def instant(handler: Callable[..., ChatOutputs]) -> Callable[..., tuple]:
    @functools.wraps(handler)
    def run(*args: Any) -> tuple:
        return handler(*args).to_gradio()
    return settings_named(run)


def settings_named(run: Callable) -> Callable:
    """A handler's `*values` (the settings panel) as named parameters with their defaults, so the
    API's parameters read `system_prompt`, `thinking`, `max_new_tokens`... (Gradio names what it
    sees in the signature, `param_2`... for the rest) and a client may leave the settings out."""
    signature = inspect.signature(run)
    defaults = Settings()
    parameters = []
    for parameter in signature.parameters.values():
        if parameter.kind is inspect.Parameter.VAR_POSITIONAL:
            parameters += [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                             default=getattr(defaults, name), annotation=type(getattr(defaults, name)))
                           for name in Settings.names()]
        else:
            parameters.append(parameter)
    run.__signature__ = signature.replace(parameters=parameters)  # type: ignore[attr-defined]
    return run


def outputs_of(page: dict[str, Any]) -> list[Any]:
    """The components `ChatOutputs` fills, in its order."""
    named = dict(page, chat=page["chatbot"], system_prompt=page["panel"]["system_prompt"])
    return [named[name] for name in ChatOutputs.names()]


def settings_of(page: dict[str, Any]) -> list[Any]:
    return [page["panel"][name] for name in Settings.names()]


# The page's side of the browser's copy (ui/browser_copy.py): what its script adds to an event's inputs.
PROBE = "(probe, ...rest) => [window.rewindCopy.probe(), ...rest]"
RECORD = "(need, ...rest) => [need && need.id ? window.rewindCopy.record(need.id) : null, ...rest]"
# Send: the text the box held at Enter or Send (ui/page_assets.py), not what it holds when the step runs
SENT_TEXT = "(text, ...rest) => [window.rewindSent ?? text, ...rest]"
# Import: the file the person picks, read by the page (its text, or null if none was picked)
PICK_FILE = "async (text, ...rest) => [await window.rewindCopy.pickFile(), ...rest]"
# ... or the file dropped on the page (taken once)
DROPPED_FILE = "(text, ...rest) => { const dropped = window.rewindDropped ?? null; window.rewindDropped = null; " \
               "return [dropped, ...rest]; }"
WITH_LIST = "(probe, ...rest) => [window.rewindCopy.withList(), ...rest]"
# An export's file, downloaded by the browser at once, named from the conversation's title
DOWNLOAD = DOWNLOAD_FN = ("(file) => { if (!file || typeof file.text !== 'string') return; "
            "const url = URL.createObjectURL(new Blob([file.text], {type: file.type})); "
            "const link = Object.assign(document.createElement('a'), {href: url, download: file.name}); "
            "document.body.appendChild(link); link.click(); link.remove(); "
            "setTimeout(() => URL.revokeObjectURL(url), 60000); }")
ON_LOAD = "(probe, ...rest) => [window.rewindCopy.onLoad(), ...rest]"
# "Export all": the account's file from the server, or, not signed in, one the page makes of its records
EXPORT_ALL = ("(file) => { if (file && file.from_browser) { const conversations = window.rewindCopy.all()"
              ".map((rec) => ({...rec.data, title: rec.title})); if (!conversations.length) return; "
              "file = {name: 'rewind-chat-all.json', type: 'application/json', text: JSON.stringify("
              + json.dumps({"format": "rewind-chat.conversations", "version": 1})[:-1]
              + ", conversations}, null, 1)}; } (" + DOWNLOAD_FN + ")(file); }")
# Keeping this browser's chats in the account: the records of the ids the server offered
CLAIMED_RECORDS = ("(ids, book) => [(Array.isArray(ids) ? ids : []).map((id) => window.rewindCopy.record(id))"
                   ".filter(Boolean), book]")
CHOSEN = ("(chosen, probe, ...rest) => "
          "[chosen, {...window.rewindCopy.probe(), record: window.rewindCopy.record(chosen)}, ...rest]")
APPLY = "(box) => { window.rewindCopy.apply(box); }"
PROMPT_NOTE = ("(applied, typed) => applied && typeof applied.prompt === 'string' && "
               "applied.prompt.trim() !== (typed || '').trim() ? " + json.dumps(
                   "**Not applied yet:** this system prompt starts a new branch at your next message; until then "
                   "Retry, Edit and Continue use the conversation's own (the old one stays a branch).") + " : ''")
# The page's asks to prepare the message being typed carry their number (read as the event starts,
# with the text as it then stands); the server hands it back once the draft is in its table.
PREPARE_ASKED = "(text, asked, ...settings) => [text, window.rewindPrepare.asked, ...settings]"
PREPARE_TAKEN = "(taken) => { window.rewindPrepare.taken = Math.max(window.rewindPrepare.taken, taken || 0); }"
QUIET = dict(queue=False, api_name=False, show_progress="hidden")
SAVE_SETTINGS = f"(...values) => {{ window.rewindSettings.save({json.dumps(Settings.names())}, values); }}"
# The events that carry a whole record from the browser (a load, opening one, rebuilding one, an
# Import) are queued one at a time: checking a large record costs memory and CPU for a while, and
# unqueued, any number of them ran at once (16 forged loads held 5 GB).
ONE_RECORD_AT_A_TIME = dict(concurrency_limit=1, concurrency_id="records")


def with_conversation(chat_list: ChatList, page: dict[str, Any], trigger: Callable) -> Any:
    """The steps before an event: the server says whether it needs the shown conversation's
    record (it lost it, or another tab changed it) and, if so, rebuilds it from the one the page
    then sends. Returns what the event itself is chained to."""
    key, book = page["key"], page["book"]
    return trigger(chat_list.ensure, [page["probe"], key, book], [book, page["need"]], js=PROBE, **QUIET) \
        .then(chat_list.recover, [page["need"], key, book], [key, book], js=RECORD, api_name=False,
              show_progress="hidden", **ONE_RECORD_AT_A_TIME)


def capture(event: gr.EventData) -> dict:
    """A Chatbot event's data (which message, what text), kept for the event's later steps
    (Gradio hands event data to the first step of a chain only). Read from the raw data, whatever
    its shape (the handlers check it): Gradio's own `RetryData` and the like fail on malformed data
    with a traceback in the log."""
    data = event._data if isinstance(event._data, dict) else {}
    return {"index": data.get("index"), "value": data.get("value")}


def wire_conversation(handlers: ChatHandlers, events: PageEvents, chat_list: ChatList, page: dict[str, Any]) -> None:
    """The conversation's own events, as the browser runs them."""
    key, book, outputs = page["key"], page["book"], outputs_of(page)
    with_settings = [key, *settings_of(page)]
    generating = dict(concurrency_id="generate")  # shares the queue's default concurrency limit
    saved_list = [page["outbox"], book, page["chats"], page["title"]]

    def on(trigger: Any, fn: Callable, inputs: list, *, copies_reply: bool = False, **options: Any) -> None:
        """The server first gets the shown conversation back if it lost it, then the event (with
        the reply so far in the browser's copy while it streams), then the browser's copy is
        updated. (API clients call the event itself, by its name.)"""
        step = with_conversation(chat_list, page, trigger)
        if copies_reply:
            step = step.then(chat_list.copying_reply(fn), [*inputs, key, book], [*outputs, page["outbox"]], **options)
        else:
            step = step.then(fn, inputs, outputs, **options)
        step.then(chat_list.sync, [key, book], saved_list, **QUIET)

    textbox, target = page["textbox"], page["branch_target"]
    on(textbox.submit, streamed(handlers.send), [textbox, *with_settings], copies_reply=True, api_name=False,
       js=SENT_TEXT, **generating)
    asked = page["prepare_asked"]
    page["prepare_go"].click(handlers.prepare, [textbox, asked, *with_settings], asked, js=PREPARE_ASKED, api_name=False,
                             show_progress="hidden", trigger_mode="always_last", concurrency_limit=None
                             ).then(None, [asked], None, js=PREPARE_TAKEN, **QUIET)
    on(page["send"].click, streamed(handlers.send), [textbox, *with_settings], copies_reply=True, api_name=False,
       js=SENT_TEXT, **generating)
    on(page["continue_button"].click, streamed(handlers.continue_reply), with_settings, copies_reply=True,
       api_name=False, **generating)
    on(page["branch_go"].click, instant(handlers.switch_branch), [target, *with_settings], api_name="switch_branch",
       js=TARGET_INPUT)
    on(page["retry_go"].click, streamed(handlers.retry_at), [target, *with_settings], copies_reply=True, api_name=False,
       js=TARGET_INPUT, **generating)
    chatbot, event = page["chatbot"], page["event"]  # its own events carry the shown message's index
    for trigger, fn, name, copies in (
            (chatbot.retry, streamed(events.on_retry), "chatbot_retry", True),
            (chatbot.undo, instant(events.on_undo), "chatbot_undo", False),
            (chatbot.edit, streamed(events.on_edit), "chatbot_edit", True),
            (chatbot.example_select, streamed(events.on_example), "chatbot_example", True)):
        captured = trigger(capture, None, [event], **QUIET)
        on(captured.then, fn, [event, *with_settings], copies_reply=copies, api_name=name, api_visibility="private",
           **(generating if copies else {}))
    page["stop"].click(handlers.stop, [key], None, api_name="stop", queue=False)
    page["dark"].click(None, js="() => window.rewindSettings.toggleTheme()", api_name=False)
    page["outbox"].change(None, [page["outbox"]], None, js=APPLY, **QUIET)
    applied, box = page["applied_prompt"], page["panel"]["system_prompt"]
    for trigger in (applied.change, box.change):  # in the page alone, no server step (typing is a change)
        trigger(None, [applied, box], page["panel"]["prompt_note"], js=PROMPT_NOTE, **QUIET)


def list_outputs(page: dict[str, Any]) -> list[Any]:
    """The chat's outputs, then those of the list (in `ListOutputs`' order)."""
    return [*outputs_of(page), page["outbox"], page["book"], page["chats"], page["confirm_delete"], page["title"]]


def wire_list(chat_list: ChatList, page: dict[str, Any]) -> None:
    """The list of conversations kept in the browser."""
    key, book, probe, with_list = page["key"], page["book"], page["probe"], list_outputs(page)
    page["new_chat"].click(chat_list.new_chat, [key, book], with_list, api_name=False) \
        .then(None, js="() => { window.rewindSwitched?.(); }", **QUIET)  # a message held meanwhile goes now
    page["chatbot"].clear(chat_list.clear, [key, book], with_list, api_name=False)
    page["chats"].input(chat_list.open, [page["chats"], probe, key, book], with_list, api_name=False, js=CHOSEN,
                        **ONE_RECORD_AT_A_TIME)
    for trigger in (page["rename"].click, page["title"].submit):  # the button, or Enter in the name
        trigger(chat_list.rename, [page["title"], book], [page["outbox"], book, page["chats"]], api_name=False)
    confirm = [page["confirm_delete"], page["cancel_delete"]]
    page["delete"].click(lambda: [gr.update(visible=True)] * 2, None, confirm, api_name=False)
    page["cancel_delete"].click(lambda: [gr.update(visible=False)] * 2, None, confirm, **QUIET)
    page["confirm_delete"].click(chat_list.delete, [key, book], with_list, api_name=False) \
        .then(lambda: gr.update(visible=False), None, page["cancel_delete"], **QUIET)
    for button, kind in ((page["export_json"], "json"), (page["export_markdown"], "markdown")):
        with_conversation(chat_list, page, button.click) \
            .then(functools.partial(chat_list.files.export, kind), [key, book], page["export_file"], api_name=False) \
            .then(None, page["export_file"], None, js=DOWNLOAD, **QUIET) \
            .then(lambda: None, None, page["export_file"], **QUIET)  # nothing of it stays on the page
    page["export_all"].click(chat_list.files.export_all, None, page["export_file"], api_name=False) \
        .then(None, page["export_file"], None, js=EXPORT_ALL, **QUIET) \
        .then(lambda: None, None, page["export_file"], **QUIET)
    with_conversation(chat_list, page, page["fork_go"].click) \
        .then(chat_list.branch_off, [page["fork_target"], key, book], with_list, js=FORK_INPUT, api_name=False,
              show_progress="hidden")
    for trigger, pick in ((page["import_file"], PICK_FILE), (page["import_drop"], DROPPED_FILE)):
        trigger.click(chat_list.import_text, [page["import_text"], key, book], with_list, js=pick, api_name=False,
                      **ONE_RECORD_AT_A_TIME)
    page["list_refresh"].click(chat_list.refresh, [probe, book], [book, page["chats"]], js=WITH_LIST, **QUIET)


def wire_sharing(sharing: Sharing, chat_list: ChatList, page: dict[str, Any], demo: gr.Blocks) -> None:
    """Share (a link to the path on screen) and Revoke (from the page's list of its links, and the
    signed-in account's)."""
    if chat_list.account_copy is not None:
        demo.load(sharing.account_links, None, page["account_links"], **QUIET) \
            .then(None, page["account_links"], None, js=share_script.FROM_ACCOUNT, **QUIET)
    with_conversation(chat_list, page, page["share"].click) \
        .then(sharing.share, [page["key"], page["book"]], page["share_made"], api_name=False) \
        .then(None, page["share_made"], None, js=share_script.MADE, **QUIET) \
        .then(lambda: None, None, page["share_made"], **QUIET)
    page["revoke_go"].click(sharing.revoke, [page["revoke_request"]], page["revoke_done"], js=share_script.REVOKE_INPUT,
                            api_name=False) \
        .then(None, page["revoke_done"], None, js=share_script.REVOKED, **QUIET)


def wire_load(chat_list: ChatList, page: dict[str, Any], demo: gr.Blocks, accounts: AccountEvents | None = None) -> None:
    """The page's first events: the settings this browser kept, then what this tab showed, from
    the browser's copy (a message typed in the first moment is not drawn over: `ChatList.load`
    leaves a page that already began alone). In that order, so the page says it is ready (the
    message box's placeholder, set by `ChatList.load`) only once the settings are back: a setting
    changed from then on is never drawn over by the values the restore read at load."""
    restored = remember_settings(page, chat_list.handlers.limits.max_system_chars, demo)
    if accounts is not None:  # signed in: the account's settings, kept in this browser too
        panel = settings_of(page)
        restored = restored.then(accounts.settings, None, panel, **QUIET) \
            .then(None, panel, None, js=SAVE_SETTINGS, **QUIET)
        for name, component in zip(Settings.names(), panel):  # a change goes to the account as it is made
            # a slider's value as it is typed or dragged, not on `release` alone: its number box
            # releases only on blur, and a value typed then Enter (or a tab closed) never left;
            # `always_last` keeps one request in flight and sends the last value after it
            trigger, mode = (component.blur, "once") if isinstance(component, gr.Textbox) else \
                (component.input, "always_last")
            trigger(accounts.keeper(name), component, None, trigger_mode=mode, **QUIET)
    loaded = restored.then(chat_list.load, [page["probe"], page["book"]], list_outputs(page), js=ON_LOAD,
                           api_name=False, show_progress="hidden", **ONE_RECORD_AT_A_TIME)
    if accounts is not None:  # signed in: offer to keep this browser's chats in the account
        loaded.then(accounts.offer_claim, [page["book"]], [page["claim"], page["claim_ids"]], **QUIET)
        page["claim"].click(accounts.claim, [page["claim_ids"], page["book"]], [page["claim"], page["book"]],
                            js=CLAIMED_RECORDS, api_name=False, **ONE_RECORD_AT_A_TIME)


def remember_settings(page: dict[str, Any], max_system_chars: int, demo: gr.Blocks) -> Any:
    """The settings and the light/dark choice survive a reload: the page's script keeps them in
    the browser (ui/page_assets.py), with no server step; each value back is checked against its
    control's range before it is shown. Returns the load event that restores them."""
    panel = settings_of(page)
    spec = []
    for name, component in zip(Settings.names(), panel):
        if isinstance(component, gr.Slider):
            spec.append([name, "number", component.minimum, component.maximum])
        elif isinstance(component, gr.Checkbox):
            spec.append([name, "boolean", 0, 0])
        else:
            spec.append([name, "string", 0, max_system_chars])
    restore = (f"(...values) => {{ window.rewindSettings.restoreTheme(); "
               f"return window.rewindSettings.restore({json.dumps(spec)}, values); }}")
    restored = demo.load(None, panel, panel, js=restore, **QUIET)
    for component in panel:
        component.input(None, panel, None, js=SAVE_SETTINGS, **QUIET)
    return restored


def wire_api_twins(handlers: ChatHandlers, page: dict[str, Any]) -> None:
    """API twins of the browser's events: the Chatbot's need browser event data, and the page's
    generating ones carry the reply so far to the browser's copy (an API client keeps its own)."""
    outputs, with_settings = outputs_of(page), [page["key"], *settings_of(page)]
    generating = dict(concurrency_id="generate")
    message = text_only("message", visible=False)
    gr.Button(visible=False).click(streamed(handlers.send), [message, *with_settings], outputs, api_name="send",
                                   **generating)
    gr.Button(visible=False).click(streamed(handlers.continue_reply), with_settings, outputs, api_name="continue",
                                   **generating)
    gr.Button(visible=False).click(instant(handlers.clear), with_settings, outputs, api_name="clear")
    gr.Button(visible=False).click(streamed(handlers.regenerate), with_settings, outputs,
                                   api_name="regenerate", **generating)
    regenerate_index = gr.Number(visible=False, precision=0)
    gr.Button(visible=False).click(streamed(handlers.regenerate_at), [regenerate_index, *with_settings], outputs,
                                   api_name="regenerate_at", **generating)
    gr.Button(visible=False).click(instant(handlers.undo), with_settings, outputs, api_name="undo")
    for step, name in ((-1, "previous_version"), (1, "next_version")):  # the page has ‹ › in the chat
        gr.Button(visible=False).click(instant(functools.partial(handlers.select_version, step)), with_settings,
                                       outputs, api_name=name)
    edit_index, edit_text = gr.Number(visible=False, precision=0), text_only("text", visible=False)
    gr.Button(visible=False).click(streamed(handlers.edit), [edit_index, edit_text, *with_settings], outputs,
                                   api_name="edit", **generating)
    gr.Button(visible=False).click(instant(handlers.edit_reply), [edit_index, edit_text, *with_settings],
                                   outputs, api_name="edit_reply")
