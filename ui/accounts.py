"""Signed-in people's conversations follow them: the browser's records, kept in the store too.

Signing in is Gradio's OAuth with Hugging Face (a Space with `hf_oauth: true`): the account is
the OAuth session's subject, read from the session cookie Gradio signs, never from anything the
page sends. A signed-in page writes every record it gives the browser (a conversation's latest
state, a rename, a tombstone) to the account's records in the store as well (chat/storage/store.py merges
them as the browser does); at its load it gets the account's records its browser lacks or holds
older. The browser's copy stays: it is the page's cache and its offline view. Anonymous use is
unchanged.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import threading
import time
from typing import Any, Awaitable, Callable

import gradio as gr

from chat.dialogue import saved
from chat.errors import ChatError
from ui.inputs import Limits
from ui.outputs import Settings
from chat.storage.store import Preferences, Records, SignOuts, StoreError
from ui.browser_copy import Book, checked_book, checked_record

MAX_SENT_AT_LOAD = 50  # as many as a browser keeps (ui/browser_copy.py MAX_CHATS), newest first


def sign_in_configured(environ: dict[str, str] | None = None) -> bool:
    """Gradio's own condition for real OAuth: a Space (`SYSTEM=spaces`) whose OAuth is enabled.
    Elsewhere Gradio would sign in a mock user from this machine's Hugging Face token."""
    environ = os.environ if environ is None else environ
    return environ.get("SYSTEM") == "spaces" and bool(environ.get("OAUTH_CLIENT_ID"))


def account_of(profile: Any) -> str | None:
    """The account an OAuth profile (injected by Gradio from the signed session) names."""
    subject = profile.get("sub") if isinstance(profile, dict) else None
    return f"hf:{subject}" if isinstance(subject, str) and subject else None


MAX_LIVE = 10_000  # (account, record) -> server key entries kept; the oldest go first


class AccountCopy:
    def __init__(self, records: Records, preferences: Preferences | None = None):
        self.records = records
        self.preferences = preferences if preferences is not None else Preferences(records.engine)
        # which server conversation holds each signed-in record's latest state: another device of
        # the same account that opens the record in that state takes it over, cache and all
        self._live: dict[tuple[str, str], str] = {}
        self._lock = threading.Lock()

    def live_key(self, account: str | None, chat_id: str) -> str | None:
        with self._lock:
            return self._live.get((account, chat_id)) if account is not None else None

    def note_live(self, account: str | None, chat_id: str, key: str) -> None:
        if account is None:
            return
        with self._lock:
            self._live.pop((account, chat_id), None)
            self._live[(account, chat_id)] = key  # (newest last)
            while len(self._live) > MAX_LIVE:
                del self._live[next(iter(self._live))]

    def keep(self, account: str | None, record: dict[str, Any] | None, key: str | None = None) -> None:
        """Write what the browser is given to `account`'s records (nothing when signed out); `key`:
        the server conversation it was written from."""
        if account is None or record is None or record.get("draft"):
            return
        if key is not None and "data" in record:
            self.note_live(account, record["id"], key)
        try:
            if record.get("deleted"):
                self.records.delete(account, record["id"], record["rev"])
            elif "data" not in record:
                self.records.rename(account, record["id"], record["rev"], record["title"])
            else:
                self.records.put(account, record)
        except StoreError as error:
            gr.Warning(f"{error} This browser still keeps it.")

    def settings(self, account: str | None, limits: Limits) -> Settings | None:
        """The settings the account last kept, checked against this server's limits (None: none
        kept, or they no longer pass)."""
        kept = self.preferences.get(account) if account is not None else None
        if not isinstance(kept, dict):
            return None
        try:
            return Settings.from_values(tuple(kept.get(name) for name in Settings.names()), limits)
        except gr.Error:
            return None

    def keep_setting(self, account: str | None, name: str, value: Any, limits: Limits) -> None:
        """One setting the person changed, kept for the account: merged into what it keeps, the
        whole checked (a value out of range is not kept)."""
        if account is None or name not in Settings.names():
            return

        def checked(merged: dict[str, Any]) -> dict[str, Any]:
            defaults = dataclasses.asdict(Settings())
            values = tuple(merged.get(field, defaults[field]) for field in Settings.names())
            return dataclasses.asdict(Settings.from_values(values, limits))

        try:
            self.preferences.update(account, {name: value}, checked)
        except gr.Error:
            pass

    def claim(self, account: str, records: list[dict[str, Any]]) -> tuple[int, list[str]]:
        """The browser's records (each checked whole, as an Import) kept in `account`. Returns
        how many were kept and what refused the others."""
        kept, refused = 0, []
        for record in records:
            try:
                saved.from_dict(record["data"])
                self.records.put(account, record)
                kept += 1
            except ChatError as error:
                refused.append(f"“{record['title'] or 'a chat'}”: {error}")
        return kept, refused

    def at_load(self, book: Book, revs: dict[str, int]) -> list[dict[str, Any]]:
        """A signed-in page's load: the account's records its browser lacks or holds older (to
        write there, and listed), and which of the browser's chats the account lacks (to offer)."""
        if book.account is None:
            return []
        listed = self.records.listed(book.account)  # (one read of the account's list serves both)
        held = {entry["id"] for entry in listed}
        book.unclaimed = [chat_id for chat_id, _ in book.index if chat_id not in held]  # made before signing in
        missing = self.missing_from(book.account, revs, listed)
        for record in reversed(missing):
            if record.get("deleted"):
                book.forget(record["id"])
            else:
                book.put_first(record["id"], record["title"])
                if record["renamed"]:
                    book.renamed.add(record["id"])
        return missing

    def missing_from(self, account: str, revs: dict[str, int],
                     listed: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
        """The account's records the browser lacks or holds older (`revs`: its record ids and
        revisions, tombstones included), newest first: live ones whole, deleted ones as tombstones.
        `listed`: the account's list, if the caller has just read it."""
        missing = []
        for entry in self.records.listed(account) if listed is None else listed:
            if revs.get(entry["id"], -1) >= entry["rev"]:
                continue
            if entry.get("deleted"):
                missing.append(entry)
            elif (record := self.records.get(account, entry["id"])) is not None:
                record.pop("updated", None)
                missing.append(record)
            if len(missing) >= MAX_SENT_AT_LOAD:
                break
        return missing


class AccountEvents:
    """A signed-in page's own events: the account's settings at load and as they change, and the
    offer to keep this browser's chats in the account."""

    def __init__(self, account_copy: AccountCopy, limits: Limits):
        self.account_copy, self.limits = account_copy, limits

    def settings(self, profile: gr.OAuthProfile | None) -> tuple:
        """The settings the account keeps, over this browser's (before the page says it is ready,
        so nothing the person sets is drawn over)."""
        settings = self.account_copy.settings(account_of(profile), self.limits)
        if settings is None:
            return tuple(gr.skip() for _ in Settings.names())
        return tuple(getattr(settings, name) for name in Settings.names())

    def keeper(self, name: str) -> Callable[..., None]:
        """The event function that keeps setting `name` for the account: one setting an event, so
        two changed at once cannot undo each other (Gradio gives it the profile, by its type)."""
        def keep(profile: gr.OAuthProfile | None, value: Any) -> None:
            self.account_copy.keep_setting(account_of(profile), name, value, self.limits)
        return keep

    def offer_claim(self, book: Any) -> tuple:
        """After a signed-in load: offer to keep this browser's chats (made before signing in, or
        signed out) in the account; asked, not assumed."""
        book = checked_book(book)
        count = len(book.unclaimed) if book.account else 0
        if not count:
            return gr.update(visible=False), None
        chats = "chat" if count == 1 else f"{count} chats"
        return gr.update(visible=True, value=f"Keep this browser's {chats} in your account"), list(book.unclaimed)

    def claim(self, profile: gr.OAuthProfile | None, records: Any, book: Any) -> tuple:
        """The records the page read for `offer_claim`'s ids, kept in the account (the account is
        the session's, whatever the page sent; only ids offered to this page are taken)."""
        book, account = checked_book(book), account_of(profile)
        if account is None or account != book.account:
            gr.Warning("Sign in first: your chats are kept in the account you are signed in with.")
            return gr.skip(), gr.skip()
        offered = set(book.unclaimed)
        taken = [record for record in map(checked_record, records if isinstance(records, list) else [])
                 if record is not None and record["id"] in offered]
        kept, refused = self.account_copy.claim(account, taken)
        book.unclaimed = [chat_id for chat_id in book.unclaimed if chat_id not in {r["id"] for r in taken}]
        for problem in refused[:3]:
            gr.Warning(f"Not kept: {problem}")
        if kept:
            gr.Info(f"{kept} {'chat is' if kept == 1 else 'chats are'} now kept in your account too.")
        return gr.update(visible=False), book


def fingerprint(oauth_info: Any) -> str | None:
    """One sign-in's mark: a hash of the access token it was given (never the token itself)."""
    token = oauth_info.get("access_token") if isinstance(oauth_info, dict) else None
    return hashlib.sha256(token.encode()).hexdigest() if isinstance(token, str) and token else None


class SignedOutSessions:
    """ASGI middleware inside Gradio's session middleware: `/logout` ends the sign-in for good (its
    fingerprint goes to the store, shared by every replica), and a request whose session carries
    an ended sign-in (a cookie copied before its person signed out, and replayed) has it removed
    before anything reads it: it is anonymous."""

    def __init__(self, app: Callable[..., Awaitable[None]], sign_outs: SignOuts):
        self.app, self.sign_outs = app, sign_outs

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        session = scope.get("session") if scope["type"] in ("http", "websocket") else None
        info = session.get("oauth_info") if isinstance(session, dict) else None
        if info is not None and (mark := fingerprint(info)) is not None:
            if scope["path"].rstrip("/").endswith("/logout"):
                expires = info.get("expires_at")
                self.sign_outs.end(mark, float(expires) if isinstance(expires, (int, float)) else time.time() + 86_400)
            elif self.sign_outs.ended(mark):
                session.pop("oauth_info", None)
        await self.app(scope, receive, send)
