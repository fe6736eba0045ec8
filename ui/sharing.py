"""Share by link: a read-only snapshot of the path on screen at `/share/<id>`.

The Share button stores the shown path alone (chat/storage/shares.py) and gives the page the link's id
and the key that revokes it; the browser keeps both in its list of shared links (`SCRIPT`), and
its Revoke sends them back. The share page is made here, on the server, as plain HTML: every text
of the conversation is escaped, and its Content-Security-Policy allows no script at all and no
fetch of anything (its style is inline), so what a conversation says can neither run nor call
out. Its "Continue in a new chat" opens the app with `?share=<id>`: the page's load copies the
snapshot into the viewer's own list (`ChatList.load`) and takes the id out of the address.
"""

from __future__ import annotations

import html
import time
from typing import Any

import gradio as gr
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Route

from chat.dialogue import saved
from chat.errors import ChatError
from chat.storage.shares import Shares, is_share_id
from ui import browser_copy
from ui.accounts import account_of
from ui.chat_list import checked_book
from ui.directory import ChatDirectory
from ui.shared import client_of

SHARE_PAGE_POLICY = "; ".join(["default-src 'none'", "style-src 'unsafe-inline'", "form-action 'none'",
                               "base-uri 'none'", "frame-ancestors 'self'"])


class Sharing:
    """The page's Share and Revoke."""

    def __init__(self, directory: ChatDirectory, shares: Shares):
        self.directory, self.shares = directory, shares

    def share(self, request: gr.Request, profile: gr.OAuthProfile | None, key: Any, book: Any) -> Any:
        """The shown path as a snapshot; the page keeps what comes back ({"id", "key", "title",
        "created"}). Signed in, the link is the account's too: listed and revoked on any device."""
        book, chat = checked_book(book), self.directory.find(key)
        data = chat.conversation.snapshot() if chat is not None else None
        if data is None or not browser_copy.said_anything(data):
            gr.Warning("There is nothing to share yet: say something first.")
            return gr.skip()
        shared = saved.path_only(data)
        title = share_title(book, shared)
        try:
            owner = account_of(profile)
            share_id, revoke_key = self.shares.create(owner=owner, client=owner or client_of(request) or "unknown",
                                                      title=title, snapshot=shared)
        except ChatError as error:
            gr.Warning(str(error))
            return gr.skip()
        gr.Info("Link made and copied: anyone who has it can read this chat as it is now (later messages are "
                "not shared). Your links are under Shared links, where you can revoke them.")
        return {"id": share_id, "key": revoke_key, "title": title, "created": time.time()}

    def revoke(self, profile: gr.OAuthProfile | None, asked: Any) -> Any:
        """Revoke {"id", "key"} (the key the share gave this browser, or none: the signed-in
        account's own link). Says which link is gone, or was already: the page then drops it."""
        share_id = asked.get("id") if isinstance(asked, dict) else None
        revoke_key = asked.get("key") if isinstance(asked, dict) else None
        revoke_key = revoke_key[:200] if isinstance(revoke_key, str) else None
        owner = account_of(profile)
        if not is_share_id(share_id) or (revoke_key is None and owner is None):
            return gr.skip()
        if self.shares.revoke(share_id, owner=owner, key=revoke_key):
            gr.Info("Link revoked: it now leads nowhere.")
        elif self.shares.get(share_id) is None:
            gr.Info("That link was already gone.")
        else:
            gr.Warning("That link could not be revoked from this browser.")
            return gr.skip()
        return {"id": share_id}

    def account_links(self, profile: gr.OAuthProfile | None) -> Any:
        """The signed-in account's links, made on any device (the page lists them beside its own)."""
        owner = account_of(profile)
        return self.shares.listed(owner) if owner is not None else []

    def snapshot(self, share_id: Any) -> tuple[str, dict[str, Any]] | None:
        """(title, conversation data) of a link, or None."""
        found = self.shares.get(share_id) if is_share_id(share_id) else None
        return None if found is None else (found["title"], found["snapshot"])

    def routes(self) -> list[Route]:
        async def page(request: Request) -> Response:
            found = self.snapshot(request.path_params["share_id"])
            if found is None:
                return HTMLResponse(_page("Not found", "<p>This link leads nowhere: it was never made, or it was "
                                                       "revoked.</p>"), status_code=404,
                                    headers={"content-security-policy": SHARE_PAGE_POLICY})
            return HTMLResponse(share_page(*found, share_id=request.path_params["share_id"]),
                                headers={"content-security-policy": SHARE_PAGE_POLICY, "cache-control": "no-store"})

        return [Route("/share/{share_id}", page, methods=["GET"])]


def share_title(book: browser_copy.Book, shared: dict[str, Any]) -> str:
    """A shared page's title: the name the person gave the chat, else the first message of the
    path shared (the list's title may be a first message edited away, which is not published)."""
    if book.current is not None and book.current in book.renamed:
        return book.title(book.current)
    return browser_copy.title_of(shared)


def share_page(title: str, data: dict[str, Any], *, share_id: str) -> str:
    """The snapshot as a page: each message's text escaped and shown as written (no Markdown, no
    HTML: nothing in it can render as markup, run or fetch)."""
    parts = []
    if data.get("system_prompt"):
        parts.append(f'<div class="message system"><b>System prompt</b><div class="text">'
                     f'{html.escape(data["system_prompt"])}</div></div>')
    for message in data["messages"]:
        if message["role"] == "system":
            continue
        who = "You" if message["role"] == "user" else "Assistant"
        thinking = message.get("reasoning_content") or ""
        details = (f'<details><summary>Thinking</summary><div class="text">{html.escape(thinking)}</div></details>'
                   if thinking else "")
        parts.append(f'<div class="message {message["role"]}"><b>{who}</b>{details}'
                     f'<div class="text">{html.escape(message["content"])}</div></div>')
    body = (f"<h1>{html.escape(title)}</h1><p class=\"note\">A conversation shared from rewind-chat, read-only."
            f' <a class="continue" href="../?share={html.escape(share_id)}">Continue in a new chat</a></p>'
            + "".join(parts))
    return _page(title, body)


def _page(title: str, body: str) -> str:
    return ("<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
            f"<meta name=\"referrer\" content=\"no-referrer\"><title>{html.escape(title)} · rewind-chat</title>"
            f"<style>{STYLE}</style></head><body><main>{body}</main></body></html>")


STYLE = """
body { font-family: system-ui, sans-serif; margin: 0; background: #fafafa; color: #1f2937; }
main { max-width: 760px; margin: 0 auto; padding: 24px 16px 64px; }
h1 { font-size: 1.4rem; overflow-wrap: anywhere; }
.note { color: #4b5563; }
.continue { display: inline-block; margin-left: 8px; padding: 8px 14px; border-radius: 8px; background: #f97316;
            color: white; text-decoration: none; min-height: 24px; }
.message { margin: 12px 0; padding: 12px 14px; border-radius: 12px; background: white; border: 1px solid #e5e7eb; }
.message.user { background: #eef2ff; margin-left: 12%; }
.message.system { background: #f3f4f6; }
.text { white-space: pre-wrap; overflow-wrap: anywhere; margin-top: 6px; }
details { margin-top: 6px; color: #4b5563; }
@media (prefers-color-scheme: dark) {
  body { background: #111827; color: #e5e7eb; } .message { background: #1f2937; border-color: #374151; }
  .message.user { background: #312e81; } .message.system { background: #374151; } .note, details { color: #9ca3af; }
}
"""

# The page's list of the links it made (localStorage: what a browser shared without signing in
# can be revoked from that browser only, with the key each link came with). Drawn with text
# nodes only; the titles are the person's own.
SCRIPT = """<script>
window.rewindShares = (() => {
  const KEY = "rewind-chat:shares";
  let account = [];  // signed in: the account's links, made on any device (revoked through the account)
  const kept = () => { try { const list = JSON.parse(localStorage.getItem(KEY)); return Array.isArray(list) ? list : []; }
                       catch { return []; } };
  const all = () => { const own = kept(), ids = new Set(own.map((made) => made.id));
                      return [...own, ...account.filter((made) => made && typeof made.id === "string" && !ids.has(made.id))]; };
  const save = (list) => { try { localStorage.setItem(KEY, JSON.stringify(list)); } catch {} };
  const link = (id) => new URL("share/" + encodeURIComponent(id), location.origin + location.pathname).href;
  const draw = () => {
    const box = document.querySelector("#shared-links");
    if (!box) return;
    let list = box.querySelector(".shared-list");
    if (!list) { list = document.createElement("div"); list.className = "shared-list"; box.appendChild(list); }
    list.replaceChildren();
    const links = all();
    if (links.length) {  // nothing at all until a link is made
      const heading = document.createElement("p"); heading.className = "shared-heading";
      heading.textContent = "Shared links (anyone with one can read that chat as it was)";
      list.appendChild(heading);
    }
    for (const made of links) {
      const row = document.createElement("div"); row.className = "shared-link";
      const anchor = Object.assign(document.createElement("a"), {href: link(made.id), target: "_blank", rel: "noopener"});
      anchor.textContent = made.title || "A conversation";
      const revoke = Object.assign(document.createElement("button"), {type: "button", className: "revoke"});
      revoke.textContent = "Revoke";
      revoke.addEventListener("click", () => { window.rewindRevoke = {id: made.id, key: made.key};
                                               document.querySelector("#revoke-go")?.click(); });
      row.append(anchor, revoke);
      list.appendChild(row);
    }
  };
  return {
    draw, link,
    fromAccount: (links) => { account = Array.isArray(links) ? links : []; draw(); },
    made: (made) => {
      if (!made || typeof made.id !== "string") return;
      save([{id: made.id, key: made.key, title: made.title, created: made.created}, ...kept()]);
      draw();
      navigator.clipboard?.writeText(link(made.id)).catch(() => {});
    },
    revoked: (done) => {
      if (!done || !done.id) return;
      save(kept().filter((made) => made.id !== done.id));
      account = account.filter((made) => made.id !== done.id);
      draw();
    },
  };
})();
</script>"""
MADE = "(made) => { window.rewindShares.made(made); }"
REVOKE_INPUT = "(asked) => [window.rewindRevoke ?? null]"
REVOKED = "(done) => { window.rewindShares.revoked(done); }"
FROM_ACCOUNT = "(links) => { window.rewindShares.fromAccount(links); }"
