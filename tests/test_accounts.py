"""Conversations that follow the person: signing in with a stand-in for Hugging Face's
OpenID provider (tests/oidc_provider.py), the account's records kept on the server, another
browser of the same person finding them, another person finding nothing, and a forged session
cookie signing no one in. Each page of `browser` is a browser of its own (no storage shared)."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request

import pytest

from app_server import AppServer
from oidc_provider import Provider
from test_browser import (browser, open_chat, open_settings, send, start_new_chat, stats_text,  # noqa: F401
                          type_temperature, wait_loaded, wait_reply)
from playwright.sync_api import Page, expect  # noqa: E402


@pytest.fixture(scope="module")
def provider():
    provider = Provider()
    provider.add_user("1001", "alice")
    provider.add_user("1002", "bob")
    yield provider
    provider.close()


@pytest.fixture(scope="module")
def space_app(tmp_path_factory, provider):
    server = AppServer(log_path=tmp_path_factory.mktemp("log") / "app.log", env=provider.environment())
    yield server
    server.close()


def kept_for_account(app: AppServer, account: str, timeout_s: float = 30, **settings) -> None:
    """Wait until the app's store keeps `settings` for `account` (its settings go to the server as
    the person leaves each control, each in a request of its own)."""
    import sqlite3
    import time

    store = str(app.log.name).rsplit("/", 1)[0] + f"/store-{app.port}.sqlite3"
    deadline, kept = time.monotonic() + timeout_s, {}
    while time.monotonic() < deadline:
        with sqlite3.connect(store) as connection:
            row = connection.execute("select settings from preferences where owner = ?", (account,)).fetchone()
        kept = json.loads(row[0]) if row else {}
        if all(kept.get(name) == value for name, value in settings.items()):
            return
        time.sleep(0.2)
    raise AssertionError(f"the account keeps {kept}, not {settings}")


def signed_in(browser, app: AppServer, provider: Provider, user: str) -> Page:
    return sign_in(open_chat(browser, app.url), provider, user)


def sign_in(page: Page, provider: Provider, user: str) -> Page:
    provider.signing_in = user
    page.click("#sign-in")
    expect(page.locator("#sign-in")).to_have_text(f"Sign out ({provider.users[user]['preferred_username']})")
    wait_loaded(page)
    return page


SIGN_IN = "Sign in to keep your chats on every device"


def signs_no_one_in(browser, url: str, cookie: dict) -> None:
    """A browser of its own with only `cookie` opens `url`: no one is signed in, no chat listed."""
    context = browser.new_context(viewport={"width": 1200, "height": 1000})
    context.add_cookies([cookie])
    page = context.new_page()
    page.goto(url)
    wait_loaded(page)
    expect(page.locator("#sign-in")).to_have_text(SIGN_IN)
    expect(page.locator("#chat-list label")).to_have_count(0)
    context.close()


def test_a_person_finds_their_chat_in_a_second_browser_and_no_one_else_does(browser, space_app, provider):
    laptop = open_chat(browser, space_app.url)
    wait_reply(laptop, send(laptop, "What is 3 + 4?"))  # before signing in: this browser's only
    sign_in(laptop, provider, "1001")
    claim = laptop.locator("#claim")
    expect(claim).to_have_text("Keep this browser's chat in your account")  # asked, not assumed
    claim.click()
    expect(claim).to_be_hidden()
    start_new_chat(laptop)
    wait_reply(laptop, send(laptop, "What is 21 + 21?"))
    answer = laptop.locator("#chatbot .message-row.bot-row").last.inner_text()

    # a setting changed on the laptop follows the person too
    open_settings(laptop)
    type_temperature(laptop, "1.3")
    laptop.get_by_role("checkbox", name="Thinking", exact=False).uncheck()
    kept_for_account(space_app, "hf:1001", temperature=1.3, thinking=False)  # (each goes as its own request)

    phone = signed_in(browser, space_app, provider, "1001")
    open_settings(phone)
    expect(phone.locator("#temperature input[type='number']")).to_have_value("1.3")
    expect(phone.get_by_role("checkbox", name="Thinking", exact=False)).not_to_be_checked()
    chats = phone.locator("#chat-list label")
    expect(chats).to_have_count(2)
    expect(phone.locator("#claim")).to_be_hidden()  # nothing of this browser's own to keep
    chats.filter(has_text="21 + 21").click()
    expect(phone.locator("#chatbot .message-row.user-row").first).to_have_text("What is 21 + 21?")
    assert phone.locator("#chatbot .message-row.bot-row").last.inner_text() == answer
    wait_reply(phone, send(phone, "plus 8"))
    expect(phone.locator("#chatbot .message-row.user-row")).to_have_count(2)
    # the phone went on with the laptop's server conversation, its cache and all: no rebuild
    reused, prompt = map(int, re.search(r"Prompt: (\d+) of (\d+) tokens from the cache", stats_text(phone)).groups())
    assert reused > 0.5 * prompt, stats_text(phone)

    # Export all, signed in: every chat of the account, from the server's store
    with phone.expect_download() as download:
        phone.click("#export-all")
    exported = json.loads(open(download.value.path()).read())
    assert sorted(c["title"] for c in exported["conversations"]) == ["What is 21 + 21?", "What is 3 + 4?"]
    sums = next(c for c in exported["conversations"] if "21" in c["title"])
    assert sums["messages"][sums["path"][-2]]["content"] == "plus 8"  # the phone's turn is in it

    # the laptop, reloaded, has the phone's turn too
    laptop.reload()
    wait_loaded(laptop)
    laptop.locator("#chat-list label").filter(has_text="21 + 21").click()
    expect(laptop.locator("#chatbot .message-row.user-row")).to_have_count(2)

    # the phone shares it; a third browser, not signed in, opens the link; the link is the
    # account's: the laptop lists it too, and revokes it
    phone.click("#share")
    expect(phone.locator("#shared-links .shared-link")).to_have_count(1)
    url = phone.locator("#shared-links .shared-link a").first.get_attribute("href")
    third = browser.new_page()
    third.goto(url)
    expect(third.locator(".message.user .text")).to_have_text(["What is 21 + 21?", "plus 8"])
    laptop.reload()
    wait_loaded(laptop)
    expect(laptop.locator("#shared-links .shared-link")).to_have_count(1)
    laptop.locator("#shared-links button.revoke").click()
    expect(laptop.locator("#shared-links .shared-link")).to_have_count(0)
    with pytest.raises(urllib.error.HTTPError):
        urllib.request.urlopen(url)
    third.reload()
    expect(third.get_by_text("This link leads nowhere")).to_be_visible()
    third.close()

    other = signed_in(browser, space_app, provider, "1002")
    expect(other.locator("#shared-links .shared-link")).to_have_count(0)
    expect(other.locator("#chat-list label")).to_have_count(0)
    anonymous = open_chat(browser, space_app.url)
    expect(anonymous.locator("#chat-list label")).to_have_count(0)
    expect(anonymous.locator("#sign-in")).to_have_text(SIGN_IN)

    # a session cookie with one character changed signs no one in
    cookie = next(c for c in laptop.context.cookies() if c["name"] == "session")
    value = cookie["value"]
    signs_no_one_in(browser, space_app.url,
                    {**cookie, "value": value[:-3] + ("A" if value[-3] != "A" else "B") + value[-2:]})

    # signed out, the laptop's cookie as it was before (copied, then replayed) signs no one in
    laptop.click("#sign-in")
    expect(laptop.locator("#sign-in")).to_have_text(SIGN_IN)
    signs_no_one_in(browser, space_app.url, cookie)
    for page in (laptop, phone, other, anonymous):
        page.close()


@pytest.fixture(scope="module")
def postgres_url():
    from postgres import PostgresServer

    server = PostgresServer()
    reason = server.start()
    if reason:
        pytest.skip(reason)
    yield server.fresh_database("replicas")
    server.stop()


def test_two_replicas_on_one_postgresql_store_serve_one_person(browser, provider, postgres_url, tmp_path):
    """docs/deploy.md's two replicas: two app processes on one PostgreSQL database. The person signs
    in through the first, chats, and the second (another origin: the browser's copy there is
    empty) lists the chat from the store; signing out through the second ends the sign-in on both."""
    env = {**provider.environment(), "STORE_URL": postgres_url}
    first = AppServer(log_path=tmp_path / "first.log", env=env)
    second = AppServer(log_path=tmp_path / "second.log", env=env)
    context = browser.new_context(viewport={"width": 1200, "height": 1000})  # (cookies: one host, both ports)
    try:
        page = context.new_page()
        page.goto(first.url)
        wait_loaded(page)
        sign_in(page, provider, "1002")
        wait_reply(page, send(page, "What is 40 + 2?"))
        other = context.new_page()
        other.goto(second.url)
        wait_loaded(other)
        expect(other.locator("#sign-in")).to_have_text("Sign out (bob)")
        expect(other.locator("#chat-list label")).to_have_count(1)
        other.locator("#chat-list label").first.click()
        expect(other.locator("#chatbot .message-row.user-row").first).to_have_text("What is 40 + 2?")
        cookie = next(c for c in context.cookies() if c["name"] == "session")
        other.click("#sign-in")  # signing out through the second replica
        expect(other.locator("#sign-in")).to_have_text(SIGN_IN)
        signs_no_one_in(browser, first.url, cookie)  # ends it on the first too
    finally:
        context.close()
        first.close()
        second.close()
