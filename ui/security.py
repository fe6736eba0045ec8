"""Headers that keep rendered content from reaching other origins, and headers not believed.

A reply (or an imported message) is markdown rendered as HTML in the browser: an image pointing
elsewhere would be fetched as soon as it shows (leaking whatever a prompt injection put in its
address), and a form would submit anywhere. Sanitizing missed forms; a Content-Security-Policy
on every response is enforced by the browser whatever the HTML is: only this origin may be
loaded from, connected to or submitted to. Frames are not restricted (a Space embeds the app).

Gradio builds the page's root address (in `/config` and the page) from `X-Forwarded-Host`,
`X-Forwarded-Proto` and `X-Gradio-Server` when a request has them: any client could make the
server say another host, and a cache in front would hand that to everyone. They are removed
unless the operator trusts a proxy (which then sets them).
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable

CONTENT_SECURITY_POLICY = "; ".join([
    "default-src 'self'",
    "script-src 'self' 'unsafe-inline' 'unsafe-eval'",  # Gradio's page bootstraps inline
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
HEADERS = [(b"content-security-policy", CONTENT_SECURITY_POLICY.encode()),
           (b"referrer-policy", b"no-referrer"), (b"x-content-type-options", b"nosniff")]

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]


PROXY_HEADERS = {b"x-forwarded-host", b"x-forwarded-proto", b"x-gradio-server"}


class SecurityHeaders:
    """Plain ASGI middleware (streams pass through untouched): adds `HEADERS` to every response,
    and drops a request's `PROXY_HEADERS` unless `trust_proxy_headers`."""

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

        async def with_headers(message: dict) -> None:
            if message["type"] == "http.response.start":
                present = {name.lower() for name, _ in message.get("headers", [])}
                message["headers"] = list(message.get("headers", [])) + [
                    (name, value) for name, value in HEADERS if name not in present]
            await send(message)

        await self.app(scope, receive, with_headers)
