"""What every UI event handler shares: the engine, the browsers' conversations, the limits, the
metrics, and how a conversation is drawn (`ChatOutputs`). A refusal raises `inputs.refused`
before anything changed: an error an API client can catch, one toast on the page."""

from __future__ import annotations

import ipaddress
from typing import Any

import gradio as gr

from ui import views
from ui.directory import BrowserChat, ChatDirectory
from ui.inputs import Limits
from ui.operator import Metrics
from ui.outputs import ChatOutputs, Settings


class HandlersBase:
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
        return ChatOutputs(chat=[], key=None, stats="", versions="", applied_prompt=None,
                           send=gr.update(visible=True), stop=gr.update(visible=False))

    def view(self, key: str, browser: BrowserChat, *, write_key: bool = True, **changes: Any) -> ChatOutputs:
        """The whole chat as it stands; `changes` override fields (a streaming reply, the box).
        `write_key=False` leaves the page's key alone (a stream must not undo a New chat)."""
        conversation = browser.conversation
        active, count = conversation.versions
        outputs = ChatOutputs(
            chat=self.chatbot_messages(browser)[0], key=key,
            stats=views.stats_line(conversation.stats),
            versions=views.version_label(active, count),
            applied_prompt={"prompt": conversation.system_prompt or ""})
        if not write_key:
            outputs.key = gr.skip()
        outputs.send, outputs.stop = gr.update(visible=True), gr.update(visible=False)
        for name, value in changes.items():
            setattr(outputs, name, value)
        return outputs

    @staticmethod
    def chatbot_messages(browser: BrowserChat) -> tuple[list[dict], list[int | None]]:
        return views.path_messages(browser.conversation.history.entries)

    def conversation_index(self, chat: BrowserChat | None, shown_index: int | None) -> int | None:
        """The conversation's message a message shown in the chat is (None: none, or a branch switcher)."""
        if chat is None:
            return None
        index_of = self.chatbot_messages(chat)[1]
        return index_of[shown_index] if isinstance(shown_index, int) and 0 <= shown_index < len(index_of) else None


def page_of(request: gr.Request | None) -> str | None:
    """Gradio's session hash: it only finds keys this server handed to that page (to free them)."""
    return getattr(request, "session_hash", None) or None


def client_of(request: gr.Request | None) -> str | None:
    """The caller's address, to count what it holds: the socket's peer, or what X-Forwarded-For
    says when the peer is a proxy the operator trusts (uvicorn resolves it: `--trusted-proxies`)."""
    client = getattr(request, "client", None) if request is not None else None
    host = getattr(client, "host", None)
    return client_key(host) if isinstance(host, str) else None


def client_key(host: str) -> str:
    """One key per client whatever the spelling: an address in its canonical form, an IPv4 one
    written as IPv6 (`::ffff:a.b.c.d`) as IPv4, and an IPv6 one by its /64 (one subscriber's
    network, in which a host picks any of 2^64 addresses freely). Not an address: as it came."""
    try:
        address = ipaddress.ip_address(host.strip().strip("[]").split("%")[0])
    except ValueError:
        return host
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address)
