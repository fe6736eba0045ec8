"""Headers that keep rendered content from running or reaching other origins, and headers not believed.

A reply (or an imported message) is markdown rendered as HTML in the browser: an image pointing
elsewhere would be fetched as soon as it shows (leaking whatever a prompt injection put in its
address), a form would submit anywhere and a `javascript:` link would run when clicked. Whatever
the HTML is, the browser enforces a Content-Security-Policy on every response: only this origin
may be loaded from, connected to or submitted to, and only scripts carrying the response's nonce
run (and those they load: 'strict-dynamic'), so no inline handler and no `javascript:` address
runs. Each HTML page gets a fresh nonce on every `<script>` tag it holds. Frames are not
restricted (a Space embeds the app).

Gradio builds the page's root address (in `/config` and the page) from `X-Forwarded-Host`,
`X-Forwarded-Proto` and `X-Gradio-Server` when a request has them: any client could make the
server say another host, and a cache in front would hand that to everyone. They are removed
unless the operator trusts a proxy (which then sets them).
"""

from __future__ import annotations

import re
import secrets
from typing import Any, Awaitable, Callable

_SCRIPT_TAG = re.compile(rb"<script\b", re.I)


def content_security_policy(nonce: str) -> str:
    """The policy of a response whose scripts carry `nonce` ('unsafe-eval': the page's own script
    is given to Gradio as a function's source, which it evaluates)."""
    return "; ".join([f"script-src 'nonce-{nonce}' 'strict-dynamic' 'self' 'unsafe-eval'", _OTHER_SOURCES])


_OTHER_SOURCES = "; ".join([
    "default-src 'self'",
    "style-src 'self' 'unsafe-inline'",
    "img-src 'self' data: blob:",
    "media-src 'self' data: blob:",
    "font-src 'self' data:",
    "connect-src 'self'",
    "worker-src 'self' blob:",
    "form-action 'self'",
    "base-uri 'self'",
    "object-src 'none'",
])
HEADERS = [(b"referrer-policy", b"no-referrer"), (b"x-content-type-options", b"nosniff")]

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]


PROXY_HEADERS = {b"x-forwarded-host", b"x-forwarded-proto", b"x-gradio-server"}
# Gradio's file upload: no component of the page uploads (an Import is read as text in the
# browser), and open, any client could fill the disk until Gradio's sweep. Answered 404 unread.
CLOSED_PATHS = frozenset({"/upload", "/gradio_api/upload"})


class SecurityHeaders:
    """Plain ASGI middleware: adds `HEADERS` and the policy to every response (streams pass
    through untouched; an HTML page is read whole and its `<script>` tags given the nonce), and
    drops a request's `PROXY_HEADERS` unless `trust_proxy_headers`."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], trust_proxy_headers: bool = False):
        self.app = app
        self.trust_proxy_headers = trust_proxy_headers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        if not self.trust_proxy_headers:
            scope = dict(scope, headers=[(name, value) for name, value in scope.get("headers", [])
                                         if name.lower() not in PROXY_HEADERS])
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        if path.removeprefix(scope.get("root_path", "")).rstrip("/") in CLOSED_PATHS:
            await _not_found(send)
            return

        nonce = secrets.token_urlsafe(18)
        started: dict | None = None
        body: list[bytes] = []

        async def with_headers(message: dict) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                present = {name.lower() for name, _ in headers}
                headers += [(name, value) for name, value in HEADERS if name not in present]
                if b"content-security-policy" not in present:
                    headers.append((b"content-security-policy", content_security_policy(nonce).encode()))
                message = dict(message, headers=headers)
                if _is_html(headers):
                    started = message  # sent with the whole body
                    return
            elif message["type"] == "http.response.body" and started is not None:
                body.append(message.get("body", b""))
                if message.get("more_body", False):
                    return
                page = _SCRIPT_TAG.sub(f'<script nonce="{nonce}"'.encode(), b"".join(body))
                headers = [(name, value) for name, value in started["headers"] if name.lower() != b"content-length"]
                await send(dict(started, headers=headers + [(b"content-length", str(len(page)).encode())]))
                message = {"type": "http.response.body", "body": page}
            await send(message)

        await self.app(scope, receive, with_headers)


def _is_html(headers: list[tuple[bytes, bytes]]) -> bool:
    return any(name.lower() == b"content-type" and value.lower().startswith(b"text/html") for name, value in headers)


async def _not_found(send: Send) -> None:
    body = b'{"detail":"Not Found"}'
    await send({"type": "http.response.start", "status": 404,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *HEADERS, (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})
