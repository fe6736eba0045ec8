"""Which component triggers which handler, with what inputs and outputs: the page's events.

Handlers take and give named dataclasses (ui/outputs.py); Gradio wants positional lists and
tuples, made here from those names and nowhere else.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterator

import gradio as gr

from ui.chat_list import ChatList
from ui.handlers import ChatHandlers, PageEvents
from ui.outputs import ChatOutputs, Settings
from ui.page_assets import TARGET_INPUT


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


def outputs_of(page: dict[str, Any]) -> list[Any]:
    """The components `ChatOutputs` fills, in its order."""
    named = dict(page, chat=page["chatbot"], system_prompt=page["panel"]["system_prompt"])
    return [named[name] for name in ChatOutputs.names()]


def settings_of(page: dict[str, Any]) -> list[Any]:
    return [page["panel"][name] for name in Settings.names()]


def wire_conversation(handlers: ChatHandlers, events: PageEvents, chat_list: ChatList, page: dict[str, Any]) -> None:
    """The conversation's own events, as the browser runs them."""
    key, store, outputs = page["key"], page["store"], outputs_of(page)
    with_settings, with_store = [key, *settings_of(page)], [key, store, *settings_of(page)]
    generating = dict(concurrency_id="generate")  # shares the queue's default concurrency limit
    quiet = dict(queue=False, api_name=False, show_progress="hidden")

    def on(trigger: Any, fn: Callable, inputs: list, **options: Any) -> None:
        """The server first gets the shown conversation back if it lost it, then the event, then
        the browser's copy is updated. (API clients call the event itself, by its name.)"""
        trigger(chat_list.ensure, [key, store], [key], **quiet) \
            .then(fn, inputs, outputs, **options) \
            .then(chat_list.sync, [key, store], [store, page["chats"]], **quiet)

    textbox, target = page["textbox"], page["branch_target"]
    on(textbox.submit, streamed(handlers.send), [textbox, *with_settings], api_name=False, **generating)
    on(page["send"].click, streamed(handlers.send), [textbox, *with_settings], api_name="send", **generating)
    on(page["continue_button"].click, streamed(handlers.continue_reply), with_settings, api_name="continue",
       **generating)
    on(page["previous_version"].click, instant(lambda k, *s: handlers.select_version(-1, k, *s)), with_settings,
       api_name="previous_version")
    on(page["next_version"].click, instant(lambda k, *s: handlers.select_version(1, k, *s)), with_settings,
       api_name="next_version")
    on(page["branch_go"].click, instant(handlers.switch_branch), [target, *with_settings], api_name="switch_branch",
       js=TARGET_INPUT)
    on(page["retry_go"].click, streamed(handlers.retry_at), [target, *with_settings], api_name=False, js=TARGET_INPUT,
       **generating)
    chatbot = page["chatbot"]  # its own events carry the shown message's index; they get the conversation back
    for trigger, fn, name, extra in ((chatbot.retry, streamed(events.on_retry), "chatbot_retry", generating),
                                     (chatbot.undo, instant(events.on_undo), "chatbot_undo", {}),
                                     (chatbot.edit, streamed(events.on_edit), "chatbot_edit", generating),
                                     (chatbot.example_select, streamed(events.on_example), "chatbot_example",
                                      generating)):
        trigger(fn, with_store, outputs, api_name=name, api_visibility="private", **extra) \
            .then(chat_list.sync, [key, store], [store, page["chats"]], **quiet)
    page["stop"].click(handlers.stop, [key], None, api_name="stop", queue=False)
    page["dark"].click(None, js="() => document.body.classList.toggle('dark')", api_name=False)


def list_outputs(page: dict[str, Any]) -> list[Any]:
    """The chat's outputs, then those of the list (in `ListOutputs`' order)."""
    return [*outputs_of(page), page["store"], page["parked"], page["chats"], page["confirm_delete"], page["download"],
            page["title"]]


def wire_list(chat_list: ChatList, page: dict[str, Any]) -> None:
    """The list of conversations kept in the browser."""
    key, store, parked, with_list = page["key"], page["store"], page["parked"], list_outputs(page)
    for button in (page["new_chat"], page["sidebar_new_chat"]):
        button.click(chat_list.new_chat, [key, store, parked], with_list, api_name=False)
    page["chats"].input(chat_list.open, [page["chats"], key, store, parked], with_list, api_name=False)
    page["rename"].click(chat_list.rename, [page["title"], store], [store, page["chats"]], api_name=False)
    page["delete"].click(chat_list.ask_delete, None, page["confirm_delete"], api_name=False)
    page["confirm_delete"].click(chat_list.delete, [key, store, parked], with_list, api_name=False)
    for button, kind in ((page["export_json"], "json"), (page["export_markdown"], "markdown")):
        button.click(functools.partial(chat_list.files.export, kind), [key, store], page["download"], api_name=False)
    # one Import at a time: parsing and checking a large file costs memory for a while
    page["import_file"].upload(chat_list.import_file, [page["import_file"], key, store, parked], with_list,
                               api_name=False, concurrency_limit=1, concurrency_id="import")


def wire_api_twins(handlers: ChatHandlers, page: dict[str, Any]) -> None:
    """API twins of the browser's events (the Chatbot's need browser event data)."""
    outputs, with_settings = outputs_of(page), [page["key"], *settings_of(page)]
    generating = dict(concurrency_id="generate")
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
