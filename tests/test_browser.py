"""A real browser (Chromium + Playwright) drives the UI like a person; saves a screenshot."""

import json
import os
import re
import shutil
import time
import urllib.request
from pathlib import Path

import pytest

from app_server import AppServer

CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"
if not Path(CHROMIUM).exists():
    if os.environ.get("CI"):  # CI installs it: a missing browser there is a broken CI, not a skip
        pytest.fail(f"{CHROMIUM} is missing; .ci/run must install Debian's chromium", pytrace=False)
    pytest.skip("Chromium is not installed (CI installs it)", allow_module_level=True)

from playwright.sync_api import Page, expect, sync_playwright  # noqa: E402
from playwright.sync_api import TimeoutError as PlaywrightTimeout  # noqa: E402

from ui import page_assets, views  # noqa: E402

# Every `expect` waits for its condition up to 30 s, not Playwright's 5: on a busy machine a reload
# and its first view took longer than 5 s. A condition that holds returns at once.
expect.set_options(timeout=30_000)

XSS_REPLY = ("<think>\nChecking the markup.\n</think>\n\n"
             'Here: <img src=x onerror="window.__xss=1"> and <script>window.__xss=2</script> done.')


@pytest.fixture(scope="module")
def browser():
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--no-first-run"])
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def demo_app(tmp_path_factory):
    server = AppServer(log_path=tmp_path_factory.mktemp("log") / "app.log")
    yield server
    server.close()


def open_chat(browser, url: str) -> Page:
    page = browser.new_page(viewport={"width": 1200, "height": 1000})
    page.goto(url)
    wait_loaded(page)
    return page


def wait_loaded(page: Page) -> None:
    """The page's load event has run (it says so in the message box's placeholder)."""
    page.wait_for_selector("#message textarea")
    expect(page.locator("#message textarea")).to_have_attribute("placeholder", views.READY)


def send(page: Page, text: str) -> str:
    """Type and press Enter; returns the stats line from before, for `wait_reply`."""
    before = stats_text(page)
    page.fill("#message textarea", text)
    page.press("#message textarea", "Enter")
    return before


def open_settings(page: Page) -> None:
    """Open the Settings panel, in the sidebar: unfolded first where it is folded away
    (a phone)."""
    folded = page.locator(".sidebar:not(.open) button[aria-label='Toggle Sidebar']")
    if folded.count():
        folded.first.click()
        page.wait_for_function(SIDEBAR_AT_REST)
    page.get_by_text("Settings", exact=True).click()


def fold_sidebar(page: Page) -> None:
    """On a phone, fold the sidebar away again (it covers the chat while open)."""
    opened = page.locator(".sidebar.open button[aria-label='Toggle Sidebar']")
    if page.viewport_size["width"] <= 700 and opened.count():
        opened.first.click()
        page.wait_for_function(SIDEBAR_AT_REST)


def start_new_chat(page: Page) -> None:
    """New chat, and wait until its event has answered (no chat of the list is the shown one and
    the chat is empty): a message sent before then raced the New chat's own outputs, which could
    draw an empty chat over its reply. A page that shows no chat yet is left as it is."""
    shown = "#chat-list input:checked"
    if page.locator(shown).count() == 0 and page.locator("#chatbot .message-row.user-row").count() == 0:
        return
    page.click("#new-chat")
    expect(page.locator(shown)).to_have_count(0)
    expect(page.locator("#chatbot .message-row.user-row")).to_have_count(0)


def set_max_new_tokens(page: Page, tokens: int) -> None:
    """Type it in the slider's box until the page has taken it: its input event kept it in the
    browser and the slider shows it. Under a loaded machine a value typed as the panel first opens
    was seen put back to the default (a re-render of the component in Gradio, not this app's
    settings restore, which ends before the page says it is ready)."""
    box = page.locator("#max-new-tokens input[type='number']")
    slider = page.locator("#max-new-tokens input[type='range']")
    for _ in range(3):
        box.fill(str(tokens))
        box.press("Enter")
        try:
            page.wait_for_function("([key, value]) => JSON.parse(localStorage.getItem(key) || '{}')"
                                   ".max_new_tokens === value", arg=[page_assets.SETTINGS_KEY, tokens],
                                   timeout=10_000)
            expect(slider).to_have_value(str(tokens), timeout=5_000)
            return
        except (AssertionError, PlaywrightTimeout):
            continue
    raise AssertionError(f"max new tokens {tokens} was never taken; kept: {kept_settings(page)}")


REPLY_ENDED = """(previous) => {
    const stats = document.querySelector("#stats");
    const text = stats ? stats.innerText.trim() : "";
    const stop = document.querySelector("#stop");
    const streaming = stop !== null && stop.offsetParent !== null;
    const pending = document.querySelector('#chatbot [aria-label="Loading response"]') !== null;
    return text.startsWith("Prompt:") && text !== previous.trim() && !streaming && !pending;
}"""


def wait_reply(page: Page, previous_stats: str, timeout_ms: int = 60_000) -> None:
    """Until the reply has ended: one check of the page, so that no moment between two events of
    an action's chain (the old line shown again between them) or of a slow stream can pass for
    the end. The stats line is a finished reply's ("Prompt: ..."), not `previous_stats`; Stop is
    hidden and no message is pending."""
    page.wait_for_function(REPLY_ENDED, arg=previous_stats, timeout=timeout_ms)


def stats_text(page: Page) -> str:
    return page.inner_text("#stats")


def messages(page: Page, role: str):
    return page.locator(f"#chatbot .message-row.{role}-row")


def expect_warning(page: Page, text: str) -> None:
    expect(page.get_by_text(text).first).to_be_visible(timeout=10_000)


def test_a_person_chats_retries_undoes_edits_and_stops(browser, demo_app):
    page = open_chat(browser, demo_app.url)
    wait_reply(page, send(page, "Hello from a real browser!"))
    expect(page.locator("#chatbot")).to_contain_text("Hello from a real browser!")
    assert page.locator("#message textarea").input_value() == ""

    before = stats_text(page)
    page.click("#chatbot button[aria-label='Retry']")
    wait_reply(page, before)
    expect(switcher(page).last).to_contain_text("2 / 2")  # one control for branches: in the chat
    expect(page.locator("#stats")).to_contain_text("0 computed")  # the first token from the logits kept
    switcher(page).last.get_by_role("button", name="Previous branch").click()
    expect(switcher(page).last).to_contain_text("1 / 2")
    expect(page.locator("#stats")).to_contain_text("without running the model")

    page.click("#chatbot button[aria-label='Undo']")
    expect(page.locator("#message textarea")).to_have_value("Hello from a real browser!")
    expect(page.locator("#chatbot")).not_to_contain_text("Hello from a real browser!")

    wait_reply(page, send(page, "A question to edit."))
    before = stats_text(page)
    expect(switcher(page).first).to_contain_text("2 / 2")  # the undone message is a branch of this one
    page.locator("#chatbot button[aria-label='Edit']:visible").first.click()
    page.fill("#chatbot textarea.edit-textarea", "The edited question.")
    page.click("#chatbot button[aria-label='Submit']")
    wait_reply(page, before)
    expect(page.locator("#chatbot")).to_contain_text("The edited question.")
    expect(page.locator("#chatbot")).not_to_contain_text("A question to edit.")
    expect(switcher(page).first).to_contain_text("3 / 3")  # nothing lost: three branches at that message

    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "chat.png"), full_page=True)
    page.close()


@pytest.fixture(scope="module")
def endless_app(tmp_path_factory, base_tokenizer):
    """A tiny random model with its end token off: a reply runs until it is stopped."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from tiny_models import save_endless_model

    folder = tmp_path_factory.mktemp("endless-model")
    save_endless_model(folder, base_tokenizer)
    server = AppServer("--model", str(folder), "--max-new-tokens", "2000",
                       log_path=tmp_path_factory.mktemp("l") / "app.log")
    yield server
    server.close()


def test_stop_and_escape_end_a_long_reply(browser, endless_app):
    page = open_chat(browser, endless_app.url)
    page.get_by_text("Settings", exact=True).click()  # open the accordion
    set_max_new_tokens(page, 900)  # long, and room in the 2,048-token context for a Continue after two
    expect(page.locator("#send")).to_be_visible()
    expect(page.locator("#stop")).to_be_hidden()
    before = send(page, "Now a long answer, which I will stop.")
    expect(page.locator("#stats")).to_contain_text("generating")
    expect(page.locator("#send")).to_be_hidden()  # one button: Send became Stop
    expect(page.locator("#message textarea")).to_have_attribute("placeholder", re.compile("sends it when this reply ends"))
    page.click("#stop")
    wait_reply(page, before)
    expect(page.locator("#stats")).to_contain_text("stopped")
    expect(page.locator("#chatbot")).to_contain_text("Now a long answer, which I will stop.")
    expect(page.locator("#send")).to_be_visible()
    expect(page.locator("#stop")).to_be_hidden()
    before = send(page, "Another long one, stopped with Escape.")
    expect(page.locator("#stats")).to_contain_text("generating")
    page.keyboard.press("Escape")
    wait_reply(page, before)
    expect(page.locator("#stats")).to_contain_text("stopped")
    # A stopped reply can go on: Continue is enabled, and extends it in the same turn
    expect(page.locator("#continue")).to_be_enabled()
    user_messages = messages(page, "user").count()
    before = stats_text(page)
    page.click("#continue")
    expect(page.locator("#stats")).to_contain_text("generating")
    page.click("#stop")
    wait_reply(page, before)
    assert messages(page, "user").count() == user_messages
    page.close()


def test_the_demo_thinks_answers_and_regenerates(browser, demo_app):
    """The trained demo in a real browser: a sum answered after a thinking block, then a
    regenerated version (sampled at the app's default temperature). Saves the README screenshot."""
    page = open_chat(browser, demo_app.url)
    wait_reply(page, send(page, "What is 47 + 38?"))
    expect(page.locator("#chatbot")).to_contain_text("Thinking")  # the reasoning, collapsible
    expect(page.locator("#chatbot")).to_contain_text("85")
    before = stats_text(page)
    page.click("#chatbot button[aria-label='Retry']")
    wait_reply(page, before)
    expect(switcher(page).last).to_contain_text("2 / 2")
    expect(messages(page, "bot").last).to_contain_text(re.compile(r"\d"))  # a well-formed answer again
    # a thinking block has no Edit pencil (its edit was always refused, the typed text lost); the answer has
    under_thinking = page.locator("#chatbot .message-row:has(.thought-group) + .message-buttons")
    expect(under_thinking).not_to_have_count(0)
    expect(under_thinking.locator("button[aria-label='Edit']:visible")).to_have_count(0)
    expect(messages(page, "bot").last.locator("xpath=following-sibling::div[1]")
           .locator("button[aria-label='Edit']")).to_be_visible()
    page.locator("#chatbot").get_by_text("Thinking").first.click()  # open the first reply's thinking
    page.wait_for_timeout(500)
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "readme-desktop.png"), full_page=True)  # docs/screenshot-desktop.png
    # A reply the model ended cannot be continued: Continue is off (it stayed on, then
    # said "Error: ... nothing to continue"); the library refuses it too (tests/test_versions_continue.py)
    expect(page.locator("#continue")).to_be_disabled()
    page.close()


SIDEBAR_AT_REST = """() => { const sidebar = document.querySelector(".sidebar");
    return sidebar !== null && sidebar.getAnimations({subtree: true}).length === 0; }"""


def test_on_a_phone_a_retry_keeps_everything_in_view_and_the_list_folds_away(browser, demo_app):
    """390×844: after a Retry the version label took the width and pushed Send below
    the screen; the branch controls were 19×21 px; the list stayed open over the chat after a pick
    and its toggle sat half off-screen. Saves the README's phone screenshot."""
    width, height = 390, 844
    page = browser.new_page(viewport={"width": width, "height": height}, has_touch=True)
    page.goto(demo_app.url)
    page.wait_for_selector("#message textarea")
    toggle = page.locator("button[aria-label='Toggle Sidebar']")

    def in_view(locator) -> bool:
        box = locator.bounding_box()
        return box is not None and box["x"] >= 0 and box["y"] >= 0 and box["x"] + box["width"] <= width \
            and box["y"] + box["height"] <= height

    def overlaps(first, second) -> bool:
        a, b = first.bounding_box(), second.bounding_box()
        return a["x"] < b["x"] + b["width"] and b["x"] < a["x"] + a["width"] and \
            a["y"] < b["y"] + b["height"] and b["y"] < a["y"] + a["height"]

    page.wait_for_selector("#sidebar[data-folded='1']", state="attached")  # the page's script folded it
    expect(page.locator(".sidebar")).not_to_have_class(re.compile(r"\bopen\b"))  # folded away at first
    page.wait_for_function(SIDEBAR_AT_REST)  # mid-slide the toggle crosses the title
    expect(toggle).to_be_in_viewport(ratio=1.0)
    assert not overlaps(toggle, page.locator("#header p")) and min(toggle.bounding_box()["width"],
                                                                    toggle.bounding_box()["height"]) >= 40
    wait_reply(page, send(page, "What is 10 + 10?"))
    before = stats_text(page)
    page.click("#chatbot button[aria-label='Retry']")
    wait_reply(page, before)
    expect(switcher(page).last).to_contain_text("2 / 2")
    assert in_view(page.locator("#send")) and in_view(page.locator("#message textarea"))
    assert page.evaluate("document.documentElement.scrollWidth") <= width  # nothing past the right edge
    buttons = switcher(page).last.get_by_role("button")
    expect(buttons).to_have_count(2)
    for button in buttons.all():  # (the chat may have scrolled them out of its own view)
        button.scroll_into_view_if_needed()
        assert in_view(button)
    assert all(min(box["width"], box["height"]) >= 40 for box in (button.bounding_box() for button in buttons.all()))
    # Finger-sized: a reply's Thinking expander was 18 px; and ⑂, branch off
    for selector in ("#chatbot .thought-group .title", "#chatbot button.fork-here"):
        box = page.locator(selector).first.bounding_box()
        assert box is not None and min(box["width"], box["height"]) >= 40, (selector, box)
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "readme-phone.png"))  # docs/screenshot-phone.png

    for pick in (lambda: page.click("#new-chat"),
                 lambda: page.locator("#chat-list label").filter(has_text="What is 10 + 10?").click()):
        toggle.click()
        expect(page.locator(".sidebar")).to_have_class(re.compile(r"\bopen\b"))
        page.wait_for_function(SIDEBAR_AT_REST)
        expect(toggle).to_be_in_viewport(ratio=1.0)
        expect(page.locator("#new-chat")).to_be_in_viewport(ratio=1.0)
        assert not overlaps(toggle, page.locator("#new-chat"))
        heights = {button.inner_text(): button.bounding_box()["height"] for button in
                   page.locator("#sidebar button:visible").all()}  # the list's buttons were 26 px
        assert len(heights) >= 5 and all(height >= 40 for height in heights.values()), heights
        pick()
        expect(page.locator(".sidebar")).not_to_have_class(re.compile(r"\bopen\b"))  # the chat is in view
    expect(page.locator("#chatbot")).to_contain_text("What is 10 + 10?")
    page.close()


def kept_settings(page: Page) -> dict:
    """The settings this browser keeps (localStorage), as the page's script wrote them."""
    return page.evaluate("(key) => JSON.parse(localStorage.getItem(key) || '{}')", page_assets.SETTINGS_KEY)


def type_temperature(page: Page, value: str) -> None:
    """Type a temperature into the open Settings panel until the page has taken it (its input
    event saved it in the browser). A busy machine can drop what is typed while the panel's
    controls are still being drawn; what the tests check is what happens once it was taken."""
    temperature = page.locator("#temperature input[type='number']")
    expect(temperature).to_have_value("0.7")  # the panel is drawn with what the restore read
    for _ in range(3):
        temperature.fill(value)
        temperature.press("Enter")
        try:
            page.wait_for_function("([key, value]) => JSON.parse(localStorage.getItem(key) || '{}')"
                                   ".temperature === value", arg=[page_assets.SETTINGS_KEY, float(value)],
                                   timeout=10_000)
            return
        except PlaywrightTimeout:
            continue
    raise AssertionError(f"the temperature {value} was never taken; kept: {kept_settings(page)}")


def type_system_prompt(page: Page, text: str) -> None:
    """Type a system prompt into the open Settings panel until it stays there and the page has
    drawn its note, as `type_temperature` does for its box: a run of the whole file saw what was
    typed as the panel opened put back to the drawn value (the box read the old prompt after)."""
    box, note = page.locator("#system-prompt textarea"), page.locator("#prompt-note")
    for attempt in range(3):
        if attempt:  # the same text again is no change: the page's note would not be drawn again
            box.fill("")
        box.fill(text)
        try:
            expect(note).to_contain_text("Not applied yet", timeout=10_000)
            expect(box).to_have_value(text, timeout=1_000)
            return
        except AssertionError:
            continue
    raise AssertionError(f"the system prompt {text!r} was never taken: the box holds {box.input_value()!r}, "
                         f"the note says {note.inner_text()!r}")


def test_the_settings_and_the_theme_survive_a_reload(browser, demo_app):
    """Thinking, temperature... and light/dark were back to their defaults after a reload."""
    page = open_chat(browser, demo_app.url)
    open_settings(page)
    for _ in range(3):  # under load the panel's first draw was seen to put the typed value back
        type_temperature(page, "1.3")
        page.get_by_role("checkbox", name="Thinking", exact=False).uncheck()
        try:
            page.wait_for_function(  # both changes are kept in the browser before the reload
                "() => { const kept = JSON.parse(localStorage.getItem(%s) || '{}');"
                " return kept.temperature === 1.3 && kept.thinking === false; }" % json.dumps(page_assets.SETTINGS_KEY),
                timeout=10_000)
            break
        except PlaywrightTimeout:
            continue
    else:
        raise AssertionError(f"the settings were never both kept: {kept_settings(page)}")
    dark = page.evaluate("document.body.classList.contains('dark')")
    page.click("#dark-mode")
    page.wait_for_function("(was) => document.body.classList.contains('dark') !== was", arg=dark)
    page.reload()
    page.wait_for_selector("#message textarea")
    open_settings(page)
    expect(page.locator("#temperature input[type='number']")).to_have_value("1.3")
    expect(page.get_by_role("checkbox", name="Thinking", exact=False)).not_to_be_checked()
    page.wait_for_function("(was) => document.body.classList.contains('dark') !== was", arg=dark)
    page.close()


SLOW_SETTINGS_RESTORE = """(() => {
    let settings;  // the page's own script defines it: what its restore reads comes back 1.5 s later
    Object.defineProperty(window, "rewindSettings", {configurable: true, get: () => settings, set: (value) => {
        const restore = value.restore.bind(value);
        value.restore = (spec, values) => {
            const read = restore(spec, values);
            return new Promise((resolve) => setTimeout(() => {
                resolve(read);
                setTimeout(() => { window.settingsRestored = true; }, 0);
            }, 1500));
        };
        settings = value;
    }});
})();"""


def test_a_setting_changed_once_the_page_is_ready_is_kept(browser, demo_app):
    """The settings kept in the browser come back before the page says it is ready (the message
    box's placeholder): a setting changed from then on is not drawn over by the values the restore
    read at load, even when restoring takes its time. (A late restore had put the temperature back
    to 0.7 under a running test.)"""
    page = browser.new_page(viewport={"width": 1200, "height": 1000})
    page.add_init_script(SLOW_SETTINGS_RESTORE)
    page.goto(demo_app.url)
    wait_loaded(page)
    open_settings(page)
    type_temperature(page, "1.3")
    page.wait_for_function("() => window.settingsRestored === true")
    expect(page.locator("#temperature input[type='number']")).to_have_value("1.3")
    page.close()


def test_an_example_starts_a_conversation(browser, demo_app):
    page = open_chat(browser, demo_app.url)
    before = stats_text(page)
    page.get_by_text("What is 7 * 46?").click()
    wait_reply(page, before)
    expect(messages(page, "user")).to_have_count(1)
    expect(page.locator("#chatbot")).to_contain_text("What is 7 * 46?")
    page.close()


def test_closing_the_tab_frees_its_conversation(browser, demo_app):
    import time

    from gradio_client import Client

    status = Client(demo_app.url, verbose=False)
    opened_before = -1
    while opened_before != status.predict(api_name="/status")["conversations"]:  # earlier tabs settle
        opened_before = status.predict(api_name="/status")["conversations"]
        time.sleep(2.5)
    page = open_chat(browser, demo_app.url)
    page.wait_for_timeout(1000)
    assert status.predict(api_name="/status")["conversations"] == opened_before  # a page load makes none
    wait_reply(page, send(page, "Remember me for a moment."))
    assert status.predict(api_name="/status")["conversations"] == opened_before + 1
    page.close()
    deadline = time.monotonic() + 30
    while status.predict(api_name="/status")["conversations"] > opened_before and time.monotonic() < deadline:
        time.sleep(0.5)
    assert status.predict(api_name="/status")["conversations"] == opened_before


def test_the_list_tells_chats_apart_groups_them_by_day_and_searches_their_messages(browser, demo_app):
    """Titles were the first message only (six alike in a row), with no date, no
    preview and no search."""
    page = open_chat(browser, demo_app.url)
    for text in ("What is 12 + 30?", "What is 12 + 30?", "Tell me about lighthouses please."):
        start_new_chat(page)
        wait_reply(page, send(page, text))
    labels = page.locator("#chat-list label")
    expect(labels).to_have_count(3)
    page.wait_for_function("""() => [...document.querySelectorAll('#chat-list label')].every((label) =>
        label.dataset.for === label.querySelector('input').value && label.dataset.preview)""")  # each drawn for its entry
    expect(labels.nth(1)).to_have_text("What is 12 + 30? (2)")  # newest first, numbered from the oldest
    expect(labels.nth(2)).to_have_text("What is 12 + 30?")
    expect(labels.first).to_have_attribute("data-group", "Today")  # the day's heading, over its first entry
    expect(labels.nth(1)).to_have_attribute("data-group", "")
    expect(labels.first).to_have_attribute("data-when", re.compile(r"\d{1,2}:\d\d"))
    previews = [labels.nth(i).get_attribute("data-preview") for i in range(3)]  # a line of each last message
    assert all(previews) and previews[0] != "Tell me about lighthouses please."  # the reply's, not the question's
    search = page.locator("#chat-search input, #chat-search textarea").first
    search.fill("LIGHTHOUSE")  # a title, any case
    expect(page.locator("#chat-list label:visible")).to_have_count(1)
    query = previews[0][:10].lower()  # words of a reply: each chat holds its question (the title) and reply
    titles = labels.all_inner_texts()
    search.fill(query)
    expect(page.locator("#chat-list label:visible")).to_have_count(
        sum(query in (title + "\n" + preview).lower() for title, preview in zip(titles, previews)))
    expect(labels.first).to_be_visible()
    search.fill("")
    expect(page.locator("#chat-list label:visible")).to_have_count(3)
    page.close()


def test_what_a_person_types_is_shown_as_typed(browser, demo_app):
    """HTML, Markdown and math in a person's message showed as "bold code link" and
    a broken image. Now its characters show as typed, and nothing of it is an element that could
    run or fetch: no image, no link, no formula."""
    page = open_chat(browser, demo_app.url)
    typed = "<img src=x onerror=alert(1)> **bold** [link](javascript:alert(1)) `code` $x$ and 3 * 4 = 12"
    wait_reply(page, send(page, typed))
    bubble = messages(page, "user").last
    expect(bubble).to_have_text(typed)
    for element in ("img", "a", "strong", "code", ".katex"):
        expect(bubble.locator(element)).to_have_count(0)
    page.close()


def test_bad_input_warns_and_leaves_the_conversation_intact(browser, demo_app):
    page = open_chat(browser, demo_app.url)
    tracebacks = Path(demo_app.log.name).read_text().count("Traceback")
    for button in ("#continue", "#export-json", "#export-markdown", "#delete"):  # nothing to act on yet
        expect(page.locator(button)).to_be_disabled()
    page.fill("#message textarea", "   ")  # an empty box sends nothing, as in other chat apps
    expect(page.locator("#send")).to_be_disabled()
    page.press("#message textarea", "Enter")
    page.locator("#send").click(force=True)
    page.fill("#message textarea", "")
    page.fill("#message textarea", "Now a message.")
    expect(page.locator("#send")).to_be_enabled()
    page.fill("#message textarea", "")
    expect(page.locator(".toast-body", has_text="the message is empty")).to_have_count(0)
    expect(messages(page, "user")).to_have_count(0)
    wait_reply(page, send(page, "First real message."))
    def shown():  # the messages, not whether the thinking block happens to be open or folded
        return messages(page, "user").all_inner_texts(), messages(page, "bot").count(), \
            messages(page, "bot").last.inner_text().strip().splitlines()[-1]  # the answer's last line

    before = shown()

    for button in ("#export-json", "#export-markdown", "#delete"):
        expect(page.locator(button)).to_be_enabled()
    expect(page.locator("#continue")).to_be_disabled()  # the reply had ended: nothing to continue
    # a refusal is one toast: no "Error" badge over the chat, the input, the stats or the settings
    expect(page.locator("[data-testid='status-tracker'] .error >> visible=true")).to_have_count(0)
    assert Path(demo_app.log.name).read_text().count("Traceback") == tracebacks  # routine: no traceback
    send(page, "word " * 3900)  # under the size limit, over the context
    expect_warning(page, "too long for this model by about")  # in a user's words
    expect_warning(page, "lower “Max new tokens” in Settings, or start a new chat.")
    assert shown() == before
    assert page.locator("#message textarea").input_value().startswith("word word")  # kept for fixing

    page.fill("#message textarea", "Double submit.")
    page.press("#message textarea", "Enter")
    before = stats_text(page)
    page.press("#message textarea", "Enter")  # a second submit while the first streams
    wait_reply(page, before)
    page.wait_for_timeout(1500)
    assert page.locator("#chatbot").inner_text().count("Double submit.") == 1
    page.close()


def test_model_output_markup_does_not_run(browser, tmp_path_factory, base_tokenizer):
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from tiny_models import scripted_reply_model

    folder = tmp_path_factory.mktemp("scripted-model")
    tokenizer = base_tokenizer
    scripted_reply_model(tokenizer, XSS_REPLY).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    server = AppServer("--model", str(folder), log_path=tmp_path_factory.mktemp("l") / "app.log")
    try:
        page = open_chat(browser, server.url)
        dialogs = []
        page.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.dismiss()))
        wait_reply(page, send(page, "Show me some markup."))
        expect(page.locator("#chatbot")).to_contain_text("done.")
        expect(page.locator("#chatbot")).to_contain_text("Thinking")  # the reasoning, collapsible
        page.wait_for_timeout(1000)
        assert page.evaluate("window.__xss") is None
        assert dialogs == []
        assert page.locator("#chatbot script").count() == 0
        assert page.locator("#chatbot img[onerror]").count() == 0
        page.screenshot(path=str(ARTIFACTS / "markup.png"), full_page=True)
        page.close()
    finally:
        server.close()
    shutil.rmtree(folder, ignore_errors=True)


def test_rendered_messages_reach_no_other_origin(browser, demo_app):
    """A message with an image, an <img> and a form pointing at another origin: the browser
    fetches nothing from there and submits nothing there (the page's Content-Security-Policy)."""
    import http.server
    import threading

    hits: list[str] = []

    class Recorder(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            hits.append(self.path)
            self.send_response(200)
            self.end_headers()

        do_POST = do_GET  # noqa: N815

        def log_message(self, *args):
            pass

    elsewhere = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    threading.Thread(target=elsewhere.serve_forever, daemon=True).start()
    other = f"http://127.0.0.1:{elsewhere.server_address[1]}"
    try:
        page = open_chat(browser, demo_app.url)
        message = (f"![leak]({other}/markdown.png?secret=1) <img src=\"{other}/img.png?secret=2\"> "
                   f"<form action=\"{other}/form\" method=\"post\"><input name=\"password\" value=\"p\">"
                   f"<button id=\"leak-submit\" type=\"submit\">go</button></form>")
        wait_reply(page, send(page, message))
        submit = page.locator("#chatbot #leak-submit, #chatbot form button")
        if submit.count():  # sanitizing kept the form: a click must still send nothing
            submit.first.click(force=True, no_wait_after=True, timeout=5000)
        page.wait_for_timeout(1500)
        assert hits == []
        page.close()
    finally:
        elsewhere.shutdown()


def test_on_a_phone_the_input_and_its_button_stay_in_view(browser, endless_app):
    width, height = 390, 844
    page = browser.new_page(viewport={"width": width, "height": height}, has_touch=True)
    page.goto(endless_app.url)
    wait_loaded(page)
    open_settings(page)
    set_max_new_tokens(page, 2000)
    fold_sidebar(page)
    page.evaluate("window.scrollTo(0, 0)")

    def in_view(selector: str) -> bool:
        box = page.locator(selector).bounding_box()
        return box is not None and box["x"] >= 0 and box["y"] >= 0 and box["x"] + box["width"] <= width \
            and box["y"] + box["height"] <= height

    assert in_view("#message textarea") and in_view("#send")
    expect(page.locator("#max-new-tokens input[type='number']")).to_have_value("2000")
    before = send(page, "A long reply on a small screen.")
    expect(page.locator("#stop")).to_be_visible()
    assert in_view("#message textarea") and in_view("#stop")  # during the reply
    expect(messages(page, "bot").last).to_be_visible()  # the reply grows the chat
    if page.locator("#stop").is_visible():  # still streaming: still in view, then stopped
        assert in_view("#message textarea") and in_view("#stop")
        page.click("#stop")
    wait_reply(page, before)
    assert in_view("#message textarea") and in_view("#send")
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "phone.png"))
    page.close()


def switcher(page: Page):
    return page.locator("#chatbot .branch-nav")


def export_json(page: Page, path: Path, name: str | None = None) -> Path:
    """Export JSON, as a person does: one click, and the browser downloads the file (no "Download" box at the sidebar's
    foot to be clicked again); `name`: the file's name it must have."""
    with page.expect_download() as download:
        page.click("#export-json")
    if name is not None:
        assert download.value.suggested_filename == name
    download.value.save_as(path)
    return path


def test_branches_the_list_and_a_reload_lose_nothing(browser, demo_app, tmp_path):
    """In a real browser: a new reply to an earlier message keeps the later turns on the
    old branch, ‹ › switches back, a reload shows the same branch and list, New chat keeps the old
    conversation, and an exported file imports as the same conversation."""
    page = open_chat(browser, demo_app.url)
    wait_reply(page, send(page, "What is 47 + 38?"))
    wait_reply(page, send(page, "and plus 7?"))
    before = stats_text(page)
    page.click("#chatbot button.br-2")  # ↻ under the first reply: a new sibling of it
    wait_reply(page, before)
    expect(page.locator("#chatbot")).not_to_contain_text("and plus 7?")
    expect(switcher(page).first).to_contain_text("2 / 2")
    page.click("#chatbot button.bs-2-0")  # ‹ : the first reply and the turn after it
    expect(page.locator("#chatbot")).to_contain_text("and plus 7?")
    expect(page.locator("#stats")).to_contain_text("without running the model")
    expect(switcher(page).first).to_contain_text("1 / 2")

    page.reload()
    page.wait_for_selector("#message textarea")
    expect(page.locator("#chatbot")).to_contain_text("and plus 7?")  # the shown branch, kept by the browser
    expect(switcher(page).first).to_contain_text("1 / 2")
    expect(page.locator("#chat-list")).to_contain_text("What is 47 + 38?")
    expect(page.locator("#chat-title input, #chat-title textarea").first).to_have_value("What is 47 + 38?")
    before = stats_text(page)
    page.click("#chatbot button.bs-2-1")  # switching works on the rebuilt conversation too
    expect(page.locator("#chatbot")).not_to_contain_text("and plus 7?")

    start_new_chat(page)
    wait_reply(page, send(page, "What is 7 * 46?"))
    expect(page.locator("#chat-list label")).to_have_count(2)
    page.locator("#chat-list label").filter(has_text="What is 47 + 38?").click()
    expect(page.locator("#chatbot")).to_contain_text("What is 47 + 38?")
    expect(page.locator("#chatbot")).not_to_contain_text("What is 7 * 46?")

    # The file of the chat shown, named from its title, not of the one shown before
    exported = export_json(page, tmp_path / "conversation.json", name="What-is-47-38.json")
    assert json.loads(exported.read_text())["title"] == "What is 47 + 38?"
    with page.expect_file_chooser() as chooser:
        page.click("#import")
    chooser.value.set_files(str(exported))
    expect(page.locator("#chat-list label")).to_have_count(3)
    expect(page.locator("#chatbot")).to_contain_text("What is 47 + 38?")
    expect(switcher(page).first).to_contain_text("2 / 2")
    page.screenshot(path=str(ARTIFACTS / "branches.png"), full_page=True)
    page.close()


def test_new_chat_during_a_reply_keeps_it_in_the_list(browser, endless_app):
    page = open_chat(browser, endless_app.url)
    open_settings(page)
    set_max_new_tokens(page, 2000)
    send(page, "A long reply I leave for a new chat.")
    expect(page.locator("#stats")).to_contain_text("generating")
    page.click("#new-chat")
    expect(messages(page, "user")).to_have_count(0)
    expect(page.locator("#send")).to_be_visible()
    entry = page.locator("#chat-list label").filter(has_text="A long reply I leave")
    expect(entry).to_have_count(1)
    entry.click()
    expect(page.locator("#chatbot")).to_contain_text("A long reply I leave for a new chat.")
    expect(messages(page, "bot")).not_to_have_count(0)  # the partial reply, kept
    expect(page.locator("#chatbot")).to_contain_text("stopped")
    page.close()


def test_two_tabs_keep_both_conversations_through_reloads(browser, demo_app):
    """A new chat in each of two tabs of one browser; each tab's reload shows its own,
    the list in both has both (the other tab's appears without a reload), nothing is overwritten."""
    context = browser.new_context(viewport={"width": 1200, "height": 1000})
    first, second = context.new_page(), context.new_page()
    for page in (first, second):
        page.goto(demo_app.url)
        page.wait_for_selector("#message textarea")
    wait_reply(first, send(first, "What is 10 + 10?"))
    wait_reply(second, send(second, "What is 20 + 20?"))
    expect(first.locator("#chat-list")).to_contain_text("What is 20 + 20?")  # told by the browser, no reload
    for page, own, other in ((first, "10 + 10", "20 + 20"), (second, "20 + 20", "10 + 10")):
        page.reload()
        page.wait_for_selector("#message textarea")
        expect(page.locator("#chatbot")).to_contain_text(f"What is {own}?")
        expect(page.locator("#chatbot")).not_to_contain_text(other)
        expect(page.locator("#chat-list label")).to_have_count(2)
    wait_reply(first, send(first, "and plus 7?"))  # a reloaded tab goes on with its own conversation
    second.reload()
    second.wait_for_selector("#message textarea")
    expect(second.locator("#chatbot")).not_to_contain_text("and plus 7?")
    second.locator("#chat-list label").filter(has_text="What is 10 + 10?").click()
    expect(second.locator("#chatbot")).to_contain_text("and plus 7?")
    context.close()


DRAFTED_REPLY = """(message) => {
    for (let i = 0; i < localStorage.length; i++) {
        const key = localStorage.key(i);
        if (!key.startsWith("rewind-chat:chat:")) continue;
        const record = window.rewindCopy.record(key.slice("rewind-chat:chat:".length));  // with the reply so far
        if (!record.draft || !record.data) continue;
        const path = record.data.path.map((at) => record.data.messages[at]);
        const last = path[path.length - 1];
        if (path.some((m) => m.content === message) && last.role === "assistant" && last.content.trim()) {
            return last.content;
        }
    }
    return null;
}"""


def test_a_reload_during_a_reply_keeps_the_message_and_what_was_written(browser, endless_app):
    """The message is in the browser's copy before its reply streams and the reply so
    far is kept while it streams, so a reload mid-reply shows both (as a stopped reply)."""
    page = open_chat(browser, endless_app.url)
    open_settings(page)
    set_max_new_tokens(page, 6)
    wait_reply(page, send(page, "A short first turn."))
    # the whole conversation fits the model's 2,048 positions, no turn dropped (which would make the
    # long message a new first one), even had the first reply run to the default 256 tokens
    set_max_new_tokens(page, 1400)
    send(page, "A long reply I reload during.")
    written = page.wait_for_function(DRAFTED_REPLY, arg="A long reply I reload during.", timeout=60_000).json_value()
    page.reload()
    page.wait_for_selector("#message textarea")
    chat = page.locator("#chatbot")
    expect(chat).to_contain_text("A short first turn.")
    expect(chat).to_contain_text("A long reply I reload during.")
    expect(messages(page, "user")).to_have_count(2)
    expect(chat).to_contain_text("stopped")
    kept = page.evaluate("() => window.rewindCopy.record(sessionStorage.getItem('rewind-chat:current'))")
    reply = kept["data"]["messages"][kept["data"]["path"][-1]]
    assert reply["stopped"] and reply["content"].startswith(written[:20])
    expect(page.locator("#chat-list")).to_contain_text("A short first turn.")
    page.close()


MERGES = """() => {
    const copy = window.rewindCopy, key = (id) => "rewind-chat:chat:" + id;
    const get = (id) => JSON.parse(localStorage.getItem(key(id)));
    const data = (text) => ({format: "rewind-chat.conversation", version: 1, shown: 0, path: [0],
                             messages: [{parent: null, role: "user", content: text, shown: null}]});
    const text = (id) => get(id).data.messages[0].content;
    const record = (id, rev, content, draft) => ({id, rev, title: content, renamed: false, data: data(content), draft});
    const seen = {};
    copy.apply({records: [record("conversation1", 1, "one", false)], current: "conversation1"});
    localStorage.setItem(key("conversation1"),  // another tab wrote revision 2 meanwhile
                         JSON.stringify({...get("conversation1"), rev: 2, tab: "another-tab", data: data("theirs")}));
    copy.apply({records: [record("conversation1", 2, "mine", false)], current: "conversation1"});
    seen.theirs = text("conversation1");
    seen.current = sessionStorage.getItem("rewind-chat:current");
    seen.mine = text(seen.current);
    seen.moved = copy.probe().moved;
    copy.apply({records: [record("conversation1", 2, "a draft", true)], current: seen.current});
    seen.afterDraft = text("conversation1");
    copy.apply({records: [record("conversation2", 1, "draft", true)], current: "conversation2"});
    copy.apply({records: [record("conversation2", 1, "final", false)], current: "conversation2"});
    seen.final = text("conversation2");
    copy.apply({records: [{id: "conversation2", rev: 2, deleted: true}], current: null});
    copy.apply({records: [record("conversation2", 2, "late", false)], current: null});
    seen.deleted = get("conversation2").deleted === true;
    copy.apply({records: [{id: seen.current, rev: 2, title: "Renamed", renamed: true}], current: seen.current});
    seen.renamed = [get(seen.current).title, text(seen.current)];
    seen.listed = copy.withList().index.map((entry) => entry[1]).sort();
    return seen;
}"""


def test_the_browsers_copy_merges_by_record_and_never_overwrites_another_tabs(browser, demo_app):
    """The page's script itself (ui/browser_copy.py): another tab's newer record is kept and this
    tab goes on with a copy; a draft displaces nothing but its own; a tombstone stays; a rename
    keeps the stored data."""
    page = open_chat(browser, demo_app.url)
    seen = page.evaluate(MERGES)
    assert seen["theirs"] == "theirs" and seen["mine"] == "mine" and seen["current"] != "conversation1"
    assert seen["moved"] == {"conversation1": seen["current"]}
    assert seen["afterDraft"] == "theirs" and seen["final"] == "final" and seen["deleted"]
    assert seen["renamed"] == ["Renamed", "mine"] and seen["listed"] == ["Renamed", "one"]
    page.close()


def test_a_changed_system_prompt_shows_as_pending_until_the_next_message(browser, demo_app):
    """After the system prompt was changed, Retry answered with the old one while the box
    showed the new one. The page now says the new one is not applied until the next message."""
    page = open_chat(browser, demo_app.url)
    wait_reply(page, send(page, "What is 10 + 10?"))
    open_settings(page)
    note = page.locator("#prompt-note")
    expect(note).not_to_contain_text("Not applied yet")
    type_system_prompt(page, "You answer in one line.")
    expect(note).to_contain_text("Not applied yet")
    before = stats_text(page)
    page.click("#chatbot button[aria-label='Retry']")
    wait_reply(page, before)
    expect(note).to_contain_text("Not applied yet")  # Retry kept the conversation's own prompt
    wait_reply(page, send(page, "What is 20 + 20?"))
    expect(note).not_to_contain_text("Not applied yet")  # the next message applied it (a new branch)
    expect(page.get_by_text("The system prompt changed").first).to_be_visible()
    page.fill("#system-prompt textarea", "You are a helpful assistant.")  # the old branch's: pending again
    expect(note).to_contain_text("Not applied yet")
    page.close()


MISPLACED_WAITING = """() => [...document.querySelectorAll('#chatbot [aria-label="Loading response"]')]
    .filter((bubble) => bubble.offsetParent !== null)  // shown
    .filter((bubble) => {
        const box = bubble.closest('.message-wrap > *');
        const before = box && box.previousElementSibling;
        return !box || box.nextElementSibling !== null || !before || !before.matches('.message-buttons-right, .user-row');
    }).length"""


def test_the_waiting_bubble_shows_only_after_the_new_message(browser, demo_app):
    """While a reply streamed, an earlier reply sometimes showed Gradio's "•••" bubble
    (its node is reused as the list grows and landed between the first reply's thinking and
    answer). Every moment of a second turn is looked at: a shown waiting bubble is the last thing
    in the chat, right after the user's new message."""
    page = open_chat(browser, demo_app.url)
    wait_reply(page, send(page, "What is 10 + 10?"))
    before = send(page, "What is 20 + 20?")
    misplaced, looks = 0, 0
    while not page.evaluate(REPLY_ENDED, before):
        misplaced, looks = misplaced + page.evaluate(MISPLACED_WAITING), looks + 1
    assert looks > 1 and misplaced == 0
    expect(messages(page, "user")).to_have_count(2)
    page.close()


def test_enter_during_a_reply_keeps_it_and_sends_the_message_when_it_ends(browser, endless_app):
    """Enter pressed while a reply streamed turned it into an empty "stopped" bubble
    and rebuilt the cache. Now the reply goes on, the message waits in the box (a line says so)
    and is sent as the reply ends, here by Stop."""
    page = open_chat(browser, endless_app.url)
    open_settings(page)
    set_max_new_tokens(page, 1000)
    send(page, "A long reply to type ahead during.")
    written = page.wait_for_function(DRAFTED_REPLY, arg="A long reply to type ahead during.",
                                     timeout=60_000).json_value()
    page.fill("#message textarea", "Typed ahead.")
    page.press("#message textarea", "Enter")
    expect(page.locator("#waiting-note")).to_contain_text("Sent when this reply ends")
    expect(page.locator("#message textarea")).to_have_value("Typed ahead.")
    expect(messages(page, "user")).to_have_count(1)
    page.wait_for_function("(n) => document.querySelector('#chatbot').innerText.length > n",
                           arg=len(page.inner_text("#chatbot")) + 10, timeout=60_000)  # it goes on
    expect(page.locator("#stop")).to_be_visible()
    page.click("#stop")
    expect(messages(page, "user")).to_have_count(2)  # sent as the reply ended
    expect(messages(page, "user").last).to_contain_text("Typed ahead.")
    expect(page.locator("#waiting-note")).to_be_hidden()
    expect(page.locator("#stats")).to_contain_text("generating")
    before = stats_text(page)
    page.click("#stop")
    wait_reply(page, before)
    assert "rebuilt" not in stats_text(page)
    expect(page.locator("#chatbot")).to_contain_text(written[:10].strip())  # the first reply, kept
    page.close()


SHOWN_REPLY = """(message) => {
    const rows = [...document.querySelectorAll("#chatbot .message-row")];
    const asked = rows.findIndex((row) => row.classList.contains("user-row") && row.innerText.includes(message));
    const reply = asked >= 0 ? rows.slice(asked + 1).find((row) => row.classList.contains("bot-row")) : null;
    const text = reply ? reply.innerText.trim() : "";
    return text.length >= 3 ? text : null;
}"""


def test_a_reload_as_a_reply_begins_keeps_what_was_on_screen(browser, endless_app):
    """The draft was written once a second, so a reload in a reply's first second
    (all of a demo reply) showed an empty "stopped" bubble. The draft now follows each update of
    the chat: a reload just after the first words keeps them."""
    page = open_chat(browser, endless_app.url)
    open_settings(page)
    set_max_new_tokens(page, 1000)
    send(page, "Reload me as I begin.")
    shown = page.wait_for_function(SHOWN_REPLY, arg="Reload me as I begin.", timeout=60_000).json_value()
    page.reload()
    page.wait_for_selector("#message textarea")
    expect(page.locator("#chatbot")).to_contain_text("stopped")
    kept = page.wait_for_function(SHOWN_REPLY, arg="Reload me as I begin.", timeout=30_000).json_value()
    assert kept.startswith(shown[:3]), (shown, kept)
    page.close()


def test_a_typed_system_prompt_survives_a_reload_and_an_import_brings_its_own(browser, demo_app, tmp_path):
    """A system prompt typed and not applied yet was lost on reload. An
    import kept the box's prompt, so the next message forked the imported conversation."""
    page = open_chat(browser, demo_app.url)
    open_settings(page)
    page.fill("#system-prompt textarea", "You are a helpful assistant.")
    wait_reply(page, send(page, "What is 10 + 10?"))
    exported = export_json(page, tmp_path / "conversation.json")

    page.fill("#system-prompt textarea", "You are terse.")
    expect(page.locator("#prompt-note")).to_contain_text("Not applied yet")
    page.reload()
    wait_loaded(page)
    expect(page.locator("#chatbot")).to_contain_text("What is 10 + 10?")
    open_settings(page)
    expect(page.locator("#system-prompt textarea")).to_have_value("You are terse.")  # still pending
    expect(page.locator("#prompt-note")).to_contain_text("Not applied yet")

    with page.expect_file_chooser() as chooser:
        page.click("#import")
    chooser.value.set_files(str(exported))
    expect(page.locator("#chat-list label")).to_have_count(2)
    expect(page.locator("#system-prompt textarea")).to_have_value("You are a helpful assistant.")  # its own
    expect(page.locator("#prompt-note")).not_to_contain_text("Not applied yet")
    wait_reply(page, send(page, "plus 8"))
    expect(page.locator("#chatbot")).to_contain_text("What is 10 + 10?")  # the imported turn stays in view
    expect(page.get_by_text("The system prompt changed")).to_have_count(0)
    page.close()


def test_one_new_chat_starts_a_new_chat_and_keeps_the_last_in_the_list(browser, demo_app):
    """Three controls started a new chat ("Start a new chat", "New chat", the chat's
    trash icon). One is left, at the top of the list; the chat has no trash icon. And the
    trash icon blanked the view only (the list still marked the conversation, the next message
    went on with it, a reload brought it back): New chat starts one for good."""
    page = open_chat(browser, demo_app.url)
    wait_reply(page, send(page, "What is 12 + 12?"))
    expect(page.get_by_role("button", name="New chat", exact=True)).to_have_count(1)
    expect(page.get_by_role("button", name="Start a new chat")).to_have_count(0)
    expect(page.locator("#chatbot button[aria-label='Clear']")).to_be_hidden()
    expect(page.locator("#chat-list input:checked")).to_have_count(1)
    start_new_chat(page)
    expect(page.locator("#chat-list")).to_contain_text("What is 12 + 12?")  # kept in the list
    wait_reply(page, send(page, "What is 3 + 4?"))
    expect(messages(page, "user")).to_have_count(1)
    page.reload()
    wait_loaded(page)
    expect(page.locator("#chatbot")).to_contain_text("What is 3 + 4?")
    expect(page.locator("#chatbot")).not_to_contain_text("What is 12 + 12?")
    page.close()


def test_the_chat_fills_the_window_with_the_box_at_its_foot(browser, demo_app):
    """The chat area was 520 px at any window size, with white space under it. Now,
    on a desktop and on a phone, the chat takes what the window leaves and the box and the line
    under it end inside the window."""
    for width, height in ((1280, 900), (1280, 1300), (390, 844)):
        page = browser.new_page(viewport={"width": width, "height": height})
        page.goto(demo_app.url)
        wait_loaded(page)
        wait_reply(page, send(page, "What is 2 + 2?"))
        page.wait_for_function("""(height) => {
            const chat = document.querySelector("#chatbot").getBoundingClientRect();
            const box = document.querySelector("#input-row").getBoundingClientRect();
            const line = document.querySelector("#stats").getBoundingClientRect();
            return line.bottom <= height && height - line.bottom < 40 && box.top > chat.bottom
                && chat.height > 0.55 * height;
        }""", arg=height)
        if width < 700:  # scrolled to the end, the list's floating toggle covers neither the chat nor the box
            page.evaluate("window.scrollTo(0, document.scrollingElement.scrollHeight)")
            page.wait_for_function(SIDEBAR_AT_REST)
            toggle = page.locator("button[aria-label='Toggle Sidebar']").first.bounding_box()
            for part in ("#chatbot", "#input-row"):
                box = page.locator(part).bounding_box()
                assert not (toggle["x"] < box["x"] + box["width"] and box["x"] < toggle["x"] + toggle["width"]
                            and toggle["y"] < box["y"] + box["height"] and box["y"] < toggle["y"] + toggle["height"]), \
                    (part, toggle, box)
        page.close()


SMALLEST_CONTROL = """() => {
    const names = ["Copy message", "Retry", "Undo", "Edit", "Continue", "New chat", "Light / dark"];
    const sizes = [];
    for (const button of document.querySelectorAll("button")) {
        const name = (button.getAttribute("aria-label") || button.innerText || "").trim();
        const box = button.getBoundingClientRect();
        if (names.includes(name) && box.width > 0) sizes.push([name, Math.min(box.width, box.height)]);
    }
    return sizes;
}"""


def test_controls_are_named_and_finger_sized_and_the_list_takes_enter_and_cancel(browser, endless_app):
    """The message box was announced as "Textbox", two buttons were both "New
    chat", a stopped reply was read as "<sub>stopped</sub>", the message buttons were 18 px on a
    phone; Enter in the name box did nothing and Delete's confirmation had no Cancel."""
    page = browser.new_page(viewport={"width": 390, "height": 844}, has_touch=True, is_mobile=True)
    page.goto(endless_app.url)
    wait_loaded(page)
    expect(page.get_by_role("textbox", name="Message")).to_have_count(1)
    expect(page.get_by_role("button", name="New chat", exact=True)).to_have_count(1)
    before = send(page, "A reply I stop.")
    expect(page.locator("#stats")).to_contain_text("generating")
    page.click("#stop")
    wait_reply(page, before)
    stopped = page.locator("#chatbot [aria-label*='stopped']").first
    expect(stopped).to_be_attached()
    assert "<" not in stopped.get_attribute("aria-label")
    expect(page.locator("#continue")).to_be_enabled()  # (the page enables it under a stopped reply; shown then)
    sizes = page.evaluate(SMALLEST_CONTROL)
    assert {name for name, _ in sizes} >= {"Copy message", "Retry", "Undo", "Continue"}, sizes
    assert all(size >= 40 for _, size in sizes), sizes

    chip = page.locator("#chatbot .icon-button-wrapper.top-panel").first
    assert chip.evaluate("(e) => getComputedStyle(e).backgroundColor") not in ("rgba(0, 0, 0, 0)", "transparent")

    page.set_viewport_size({"width": 1200, "height": 1000})
    footer = page.evaluate("() => [...document.querySelector('footer').children]"
                           ".filter((e) => e.getClientRects().length > 0).map((e) => e.textContent.trim())")
    assert footer and footer[-1] != "·", footer  # no stray separator at the end
    folded = page.locator(".sidebar:not(.open) button[aria-label='Toggle Sidebar']")
    if folded.count():  # (folded away on the phone)
        folded.first.click()
    name = page.locator("#chat-title textarea, #chat-title input").first
    name.fill("Renamed with Enter")
    name.press("Enter")
    expect(page.locator("#chat-list")).to_contain_text("Renamed with Enter")
    page.click("#delete")
    expect(page.locator("#cancel-delete")).to_be_visible()
    page.click("#cancel-delete")
    expect(page.locator("#confirm-delete")).to_be_hidden()
    expect(page.locator("#cancel-delete")).to_be_hidden()
    expect(page.locator("#chat-list")).to_contain_text("Renamed with Enter")  # nothing deleted
    page.close()


def test_the_reply_is_prepared_while_the_message_is_typed(browser, demo_app):
    """Typed key by key, the message is prefilled as it is typed (asked again while typing
    goes on, not only once it pauses: typed without a pause, a message was never prepared), the
    logits after it kept; Send then computes no prompt token. The switch in Settings is kept in
    the browser."""
    page = open_chat(browser, demo_app.url)
    wait_reply(page, send(page, "What is 12 + 30?"))
    status = lambda: json.loads(urllib.request.urlopen(demo_app.url + "status", timeout=30).read())  # noqa: E731
    before = status()["batch"]["prepared"]
    page.locator("#message textarea").press_sequentially("And then what is 47 + 38, step by step?", delay=15)
    # the last ask taken by the server (its draft in the table): then its draft's end is awaited
    page.wait_for_function("() => !window.rewindPrepare.pending && window.rewindPrepare.taken > 0 "
                           "&& window.rewindPrepare.taken === window.rewindPrepare.asked", timeout=60_000)
    assert page.evaluate("() => window.rewindPrepare.asked") >= 2  # while typing went on (0.6 s at least)
    deadline = time.monotonic() + 60
    while status()["batch"]["prepared"] <= before or status()["batch"]["preparing"]:
        assert time.monotonic() < deadline, "the message was never prepared"
        time.sleep(0.05)
    previous = stats_text(page)
    page.press("#message textarea", "Enter")
    wait_reply(page, previous)
    assert "0 computed" in stats_text(page), stats_text(page)  # its first token from the logits kept
    open_settings(page)
    page.locator("#prepare-toggle input").uncheck()
    page.wait_for_function("() => localStorage.getItem('rewind-chat:prepare-while-typing') === 'off'")
    page.reload()
    wait_loaded(page)
    open_settings(page)
    expect(page.locator("#prepare-toggle input")).not_to_be_checked()
    page.close()


def test_a_long_paste_scrolls_inside_the_box_and_says_it_is_over_the_limit(browser, demo_app):
    """A 200,000-character paste grew the box without bound (Send and the buttons left
    the screen) and the limit was said only after Send."""
    page = open_chat(browser, demo_app.url)
    page.fill("#message textarea", "x" * 200_000)
    note = page.locator("#over-limit-note")
    expect(note).to_contain_text("200,000 characters, over the limit of 20,000")
    assert page.locator("#message textarea").bounding_box()["height"] <= 300
    send_box = page.locator("#send").bounding_box()
    assert send_box is not None and send_box["y"] + send_box["height"] <= 1000  # still in the window
    expect(page.locator("#send")).to_be_disabled()
    page.press("#message textarea", "Enter")
    expect(messages(page, "user")).to_have_count(0)
    page.fill("#message textarea", "What is 2 + 3?")
    expect(note).to_have_text("")
    expect(page.locator("#send")).to_be_enabled()
    page.close()


def test_a_message_sent_right_after_another_is_kept_and_sent_after_it(browser, demo_app):
    """A second message put in the box within ~150 ms of the first one's Enter, then
    Enter: one of the two was gone (the server read the box when its step ran, and the first
    reply emptied it). Now the first is what the box held at its Enter, and the second waits
    and is sent when the first reply ends."""
    page = open_chat(browser, demo_app.url)
    before = stats_text(page)
    page.fill("#message textarea", "What is 12 + 30?")
    page.press("#message textarea", "Enter")
    page.fill("#message textarea", "What is 47 + 38?")
    page.press("#message textarea", "Enter")
    expect(messages(page, "user")).to_have_count(2, timeout=60_000)
    wait_reply(page, before)
    page.wait_for_function("() => !document.querySelector('#stop') || document.querySelector('#stop').offsetParent === null")
    expect(messages(page, "user").nth(0)).to_contain_text("What is 12 + 30?")
    expect(messages(page, "user").nth(1)).to_contain_text("What is 47 + 38?")
    expect(page.locator("#message textarea")).to_have_value("")
    page.close()
