"""Share by link, driven in a real browser: a person shares the chat on screen, a
second person (another browser context: no storage in common) reads the link, continues it in a
chat of their own, and the link stops working once its maker revokes it."""

from __future__ import annotations

import http.server
import threading
import urllib.error
import urllib.request

import pytest

from test_browser import browser, demo_app, open_chat, send, wait_reply  # noqa: F401 (fixtures)
from playwright.sync_api import expect  # noqa: E402

from ui import sharing  # noqa: E402


class Recorder(http.server.BaseHTTPRequestHandler):
    hits: list[str] = []

    def do_GET(self):  # noqa: N802
        Recorder.hits.append(self.path)
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_a_shared_link_shows_the_chat_inert_continues_as_a_copy_and_dies_when_revoked(browser, demo_app):
    elsewhere = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    threading.Thread(target=elsewhere.serve_forever, daemon=True).start()
    other = f"http://127.0.0.1:{elsewhere.server_address[1]}"
    typed = (f'What is 12 + 30? <script>window.__ran = 1</script><img src="{other}/leak.png" '
             f'onerror="window.__ran = 2"> ![x]({other}/md.png) \'); DROP TABLE shares; --')
    page = open_chat(browser, demo_app.url)  # (each page of `browser` is a context of its own: no storage shared)
    wait_reply(page, send(page, typed))
    reply = page.locator("#chatbot .message-row.bot-row").last.inner_text()
    page.click("#share")
    link = page.locator("#shared-links .shared-link a").first
    expect(link).to_be_attached()
    url = link.get_attribute("href")
    assert url.startswith(demo_app.url + "share/") and len(url.rsplit("/", 1)[1]) >= 24

    shared = browser.new_page(viewport={"width": 1200, "height": 1000})
    shared.goto(url)
    expect(shared.locator(".message.user .text")).to_have_text(typed)  # as typed: text, not markup
    assert shared.locator("script, img, iframe, form").count() == 0
    assert shared.evaluate("() => window.__ran") is None
    answer = shared.locator(".message.assistant > .text").inner_text()
    assert answer.strip() and answer.strip() in reply
    with urllib.request.urlopen(url) as response:
        policy = response.headers["content-security-policy"]
    assert "default-src 'none'" in policy and "script-src" not in policy
    # Continue in a new chat: the viewer's own copy, in the viewer's own list
    shared.click("a.continue")
    expect(shared.locator("#message textarea")).to_be_visible()
    expect(shared.locator("#chatbot .message-row.user-row").first).to_have_text(typed)
    expect(shared.locator("#chat-list label")).to_have_count(1)
    assert "share=" not in shared.url  # a reload does not copy it again
    wait_reply(shared, send(shared, "plus 8"))
    expect(shared.locator("#chatbot .message-row.user-row")).to_have_count(2)
    expect(page.locator("#chatbot .message-row.user-row")).to_have_count(1)  # the owner's chat is its own
    assert Recorder.hits == []

    # revoked: the link answers 404, and the owner's list no longer has it
    page.locator("#shared-links button.revoke").first.click()
    expect(page.locator("#shared-links .shared-link")).to_have_count(0)
    with pytest.raises(urllib.error.HTTPError) as gone:
        urllib.request.urlopen(url)
    assert gone.value.code == 404
    elsewhere.shutdown()
    page.close()
    shared.close()


def test_a_share_page_escapes_everything(tmp_path):
    nasty = '<script>alert(1)</script><img src=x onerror=alert(2)>"\'&'
    data = {"messages": [{"role": "user", "content": nasty},
                         {"role": "assistant", "content": nasty, "reasoning_content": nasty}],
            "system_prompt": nasty}
    page = sharing.share_page(nasty, data, share_id="abcdefghijklmnopqrstuvwx")
    assert "<script>alert" not in page and "<img src=x" not in page
    # the title twice (<title>, <h1>), the system prompt, the message, the reply and its thinking
    assert page.count("&lt;script&gt;alert(1)&lt;/script&gt;") == 6


def test_a_snapshot_holds_the_path_on_screen_and_nothing_else():
    from chat.dialogue import saved

    def reply(text):
        return {"role": "assistant", "content": text, "reasoning_content": "", "stopped": False, "edited": False}

    data = {"format": saved.FORMAT, "version": 1, "shown": 0, "system_prompt": None, "path": [0, 2, 3, 4],
            "messages": [{"parent": None, "role": "user", "content": "first", "shown": 1},
                         {"parent": 0, "shown": None, **reply("an older version, not on screen")},
                         {"parent": 0, "shown": 0, **reply("the version on screen")},
                         {"parent": 2, "role": "user", "content": "second", "shown": 0},
                         {"parent": 3, "shown": None, **reply("its answer")},
                         {"parent": None, "role": "user", "content": "another branch", "shown": None}]}
    saved.from_dict(data)  # (the tree above is well formed)
    alone = saved.path_only(data)
    history = saved.from_dict(alone)
    assert [node.content if node.reply is None else node.reply.content for node in history.entries] == \
        ["first", "the version on screen", "second", "its answer"]
    assert "older version" not in str(alone) and "another branch" not in str(alone)


def test_a_share_is_titled_from_the_path_it_publishes_unless_the_chat_was_named():
    """The list's title is the chat's first message, which may have been edited away: a share
    titled so published a message it does not hold."""
    from chat.dialogue import saved
    from ui.browser_copy import Book

    data = {"format": saved.FORMAT, "version": 1, "shown": 1, "system_prompt": None, "path": [1],
            "messages": [{"parent": None, "role": "user", "content": "my old secret question", "shown": None},
                         {"parent": None, "role": "user", "content": "What is 2 + 2?", "shown": None}]}
    book = Book()
    book.read({"id": "chat000001", "rev": 1, "title": "my old secret question", "renamed": False, "data": data})
    book.current = "chat000001"
    shared = saved.path_only(data)
    assert sharing.share_title(book, shared) == "What is 2 + 2?"
    book.renamed.add("chat000001")  # (a rename)
    book.put_first("chat000001", "Arithmetic")
    assert sharing.share_title(book, shared) == "Arithmetic"
