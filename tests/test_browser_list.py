"""The list's newer ways in and out, driven in a real browser: "Export all" and its import,
and "Branch off into a new chat"."""

from __future__ import annotations

import json
import re

from test_browser import browser, demo_app, open_chat, send, start_new_chat, wait_loaded, wait_reply  # noqa: F401
from playwright.sync_api import expect  # noqa: E402





def fork_button(row):
    return row.locator("xpath=following-sibling::div[contains(@class, 'message-buttons')][1]"
                       "//button[contains(@class, 'fork-here')]")


def test_export_all_gives_every_chat_and_imports_whole_elsewhere(browser, demo_app, tmp_path):
    """"Export all": not signed in, the page makes the file of every chat its browser
    keeps; another browser imports it and lists them all (their branches kept)."""
    import json

    page = open_chat(browser, demo_app.url)
    wait_reply(page, send(page, "What is 10 + 5?"))
    start_new_chat(page)
    wait_reply(page, send(page, "What is 7 * 3?"))
    expect(page.locator("#chat-list label")).to_have_count(2)
    with page.expect_download() as download:
        page.click("#export-all")
    path = tmp_path / "all.json"
    download.value.save_as(path)
    exported = json.loads(path.read_text())
    assert exported["format"] == "rewind-chat.conversations"
    assert sorted(c["title"] for c in exported["conversations"]) == ["What is 10 + 5?", "What is 7 * 3?"]

    elsewhere = open_chat(browser, demo_app.url)
    with elsewhere.expect_file_chooser() as chooser:
        elsewhere.click("#import")
    chooser.value.set_files(str(path))
    expect(elsewhere.locator("#chat-list label")).to_have_count(2)
    elsewhere.locator("#chat-list label").filter(has_text="7 * 3").click()
    expect(elsewhere.locator("#chatbot .message-row.user-row").first).to_have_text("What is 7 * 3?")
    page.close()
    elsewhere.close()


def test_branch_off_from_a_reply_or_a_message_into_a_new_chat(browser, demo_app):
    """"Branch off into a new chat" from any message: at a reply, the path up to it in
    a new entry of the list (its cache copied: the next turn reuses it); at a message of the
    person, the path before it, with the message in the box."""
    page = open_chat(browser, demo_app.url)
    wait_reply(page, send(page, "What is 2 + 3?"))
    wait_reply(page, send(page, "plus 4"))
    answers = page.locator("#chatbot .message-row.bot-row")
    first_answer = answers.filter(has_text="5").filter(has_not_text="Thinking").first
    button = fork_button(first_answer)
    expect(button).to_have_attribute("aria-label", "Branch off into a new chat")
    button.click()
    expect(page.locator("#chat-list label")).to_have_count(2)
    expect(page.locator("#chatbot .message-row.user-row")).to_have_count(1)
    expect(page.locator("#chat-title input, #chat-title textarea")).to_have_value("What is 2 + 3? (branch)")
    wait_reply(page, send(page, "times 2"))
    reused, prompt = map(int, re.search(r"Prompt: (\d+) of (\d+) tokens from the cache",
                                        page.inner_text("#stats")).groups())
    assert reused > prompt // 2  # the copy of the first chat's cache, not a rebuild
    # the first chat is in the list as it was
    page.locator("#chat-list label").filter(has_text="What is 2 + 3?").filter(has_not_text="(branch)").click()
    expect(page.locator("#chatbot .message-row.user-row")).to_have_count(2)
    # at a message of the person: the path before it, the message in the box
    fork_button(page.locator("#chatbot .message-row.user-row").nth(1)).click()
    expect(page.locator("#chat-list label")).to_have_count(3)
    expect(page.locator("#chatbot .message-row.user-row")).to_have_count(1)
    expect(page.locator("#message textarea")).to_have_value("plus 4")
    page.close()


DROP = """(text) => {
    const data = new DataTransfer();
    data.items.add(new File([text], "chat.json", {type: "application/json"}));
    document.querySelector("#chatbot").dispatchEvent(new DragEvent("drop", {dataTransfer: data, bubbles: true,
                                                                           cancelable: true}));
}"""


def test_a_file_dropped_on_the_page_is_imported(browser, demo_app):
    """Import also by dropping a file on the page; a file that is not a conversation
    is refused with the reason, and the list is left as it was."""
    page = open_chat(browser, demo_app.url)
    exported = {"format": "rewind-chat.conversation", "version": 1, "title": "Dropped in",
                "messages": [{"parent": None, "role": "user", "content": "What is 8 + 1?", "shown": 0},
                             {"parent": 0, "role": "assistant", "content": "8 + 1 = 9.", "reasoning_content": "",
                              "stopped": False, "edited": False, "shown": None}],
                "shown": 0, "path": [0, 1], "system_prompt": None}
    page.evaluate(DROP, "{not json")
    expect(page.get_by_text("That file cannot be imported").first).to_be_visible()
    expect(page.locator("#chat-list label")).to_have_count(0)
    page.evaluate(DROP, json.dumps(exported))
    expect(page.locator("#chat-list label")).to_have_count(1)
    expect(page.locator("#chat-list label").first).to_contain_text("Dropped in")
    expect(page.locator("#chatbot .message-row.user-row").first).to_have_text("What is 8 + 1?")
    page.close()


def test_a_message_sent_right_after_new_chat_goes_to_the_new_chat(browser, demo_app):
    """A message sent a moment after New chat (before its answer came) went to the conversation
    left, and the New chat's answer then drew an empty chat over it. Now it waits for the New
    chat and goes there; the chat left keeps only its own turn."""
    page = open_chat(browser, demo_app.url)
    wait_reply(page, send(page, "What is 1 + 1?"))
    page.click("#new-chat")
    page.fill("#message textarea", "What is 2 + 2?")
    page.press("#message textarea", "Enter")
    users = page.locator("#chatbot .message-row.user-row")
    expect(users).to_have_count(1)
    expect(users.first).to_have_text("What is 2 + 2?")
    expect(page.locator("#stats")).to_contain_text("Prompt:")
    expect(page.locator("#chat-list label")).to_have_count(2)
    page.locator("#chat-list label").filter(has_text="1 + 1").click()
    expect(users.first).to_have_text("What is 1 + 1?")
    expect(users).to_have_count(1)
    page.close()


def test_the_search_box_and_the_thinking_fold_are_named_and_finger_sized_on_a_phone(browser, demo_app):
    """The search box's accessible name was "Textbox"; the Thinking fold's button had none and was
    18 x 18 px on a phone."""
    page = browser.new_page(viewport={"width": 390, "height": 844}, has_touch=True)
    page.goto(demo_app.url)
    wait_loaded(page)
    expect(page.get_by_role("textbox", name="Search chats", exact=True)).to_be_attached()
    wait_reply(page, send(page, "What is 5 * 67?"))  # the demo model thinks first
    fold = page.get_by_role("button", name="Show or hide the thinking", exact=True)
    expect(fold.first).to_be_visible()
    box = fold.first.bounding_box()
    assert box["width"] >= 40 and box["height"] >= 40, box
    assert page.locator('#chatbot button[aria-label=""]').count() == 0
    entry = page.locator("#chat-list input[type=radio]").first  # under its "Today" heading, named by itself
    expect(page.locator("#chat-list label").first).to_have_attribute("data-group", "Today")
    expect(entry).to_have_accessible_name(re.compile(r"^What is 5 \* 67\?"))
    page.close()
