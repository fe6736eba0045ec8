"""Hostile markup in a reply, driven in a real browser: an imported chat whose replies hold script
links in every namespace is shown, each of its links and boxes clicked, then shared, opened by a
visitor through the link, continued into their list and clicked again. Nothing runs."""

from __future__ import annotations

import json
import urllib.request

from test_browser import browser, demo_app, open_chat  # noqa: F401 (fixtures)
from playwright.sync_api import Page, expect  # noqa: E402

from test_browser_list import DROP  # noqa: E402

RAN = "console.log('hostile-script-ran')"  # (a console line outlives a navigation)
PAYLOADS = [
    f'<svg width="220" height="40"><a href="javascript:{RAN}"><rect width="220" height="40" fill="#ccd"/>'
    f'<text x="8" y="25">Show the worked steps</text></a></svg>',
    f'<svg><a xlink:href="javascript:{RAN}"><text x="8" y="25">xlink step</text></a></svg>',
    f'<math><mtext><a href="javascript:{RAN}">math step</a></mtext></math>',
    f'<math href="javascript:{RAN}"><mi>x</mi></math>',
    f'<a href="jav&#x09;ascript:{RAN}">html step</a> <a href=" JAVASCRIPT:{RAN}">upper step</a>',
    f'[markdown step](javascript:{RAN}) [pointy step](<javascript:{RAN}>) [ref step][r]\n\n[r]: javascript:{RAN}',
    '<a href="data:text/html,<script>alert(1)</script>">data step</a> [data md](data:text/html;base64,PHNjcmlwdD4=)',
    f'<img src=x onerror="{RAN}"> <div onclick="{RAN}">div step</div> <b onmouseover="{RAN}">hover step</b>',
    f'<iframe srcdoc="<script>{RAN}</script>"></iframe><form action="javascript:{RAN}">'
    f'<button>form step</button></form><button formaction="javascript:{RAN}">formaction step</button>',
    f'<svg><animate attributeName="href" values="javascript:{RAN}"/><a><text y="20">animated step</text></a></svg>',
    f'<details open ontoggle="{RAN}"><summary>toggle step</summary>x</details>',
]


def hostile_chat() -> dict:
    messages = [{"parent": None, "role": "user", "content": "Show the worked steps.", "shown": 0}]
    for number, payload in enumerate(PAYLOADS):
        messages.append({"parent": len(messages) - 1, "role": "assistant", "content": f"Step {number}: {payload}",
                         "reasoning_content": payload if number == 0 else "", "stopped": False, "edited": False,
                         "shown": 0})
        if number < len(PAYLOADS) - 1:
            messages.append({"parent": len(messages) - 1, "role": "user", "content": f"next {number}", "shown": 0})
    messages[-1]["shown"] = None
    return {"format": "rewind-chat.conversation", "version": 1, "title": "Worked steps", "messages": messages,
            "shown": 0, "path": list(range(len(messages))), "system_prompt": None}


def click_everything(page: Page) -> None:
    """Every link, box, summary and button the replies drew, clicked where it is drawn."""
    dialogs: list[str] = []
    ran: list[str] = []
    page.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.dismiss()))
    page.on("console", lambda message: ran.append(message.text) if "hostile-script-ran" in message.text else None)
    bot = page.locator("#chatbot .message-row.bot-row")
    expect(bot.filter(has_text="Step 10")).to_have_count(1)
    for fold in page.locator("#chatbot button").filter(has_text="Thinking").all():
        fold.click()  # the thought holds a payload too
    targets = page.locator("#chatbot .bot-row a, #chatbot .bot-row rect, #chatbot .bot-row text, "
                           "#chatbot .bot-row summary, #chatbot .bot-row div[onclick], #chatbot .bot-row form button")
    clicked = 0
    for target in targets.all():
        box = target.bounding_box()
        if box and box["width"] > 0 and box["height"] > 0:
            target.click(force=True, no_wait_after=True, timeout=5000)
            clicked += 1
    assert clicked >= 8  # the links' texts are still drawn
    page.locator("#chatbot .bot-row").filter(has_text="hover step").first.hover()
    page.evaluate("() => new Promise((done) => setTimeout(done, 0))")  # (a click's script has run by then)
    assert ran == [] and dialogs == []
    attributes = page.evaluate("""() => [...document.querySelectorAll('#chatbot *')].flatMap((node) =>
        [...node.attributes].map((attribute) => [attribute.name, attribute.value.replace(/\\s/g, '').toLowerCase()]))""")
    assert not [(name, value) for name, value in attributes
                if name.startswith("on") or value.startswith(("javascript:", "data:text"))]
    assert page.locator("#chatbot .bot-row svg a, #chatbot .bot-row math, #chatbot .bot-row iframe, "
                        "#chatbot .bot-row form").count() == 0


def test_script_links_in_every_namespace_stay_inert_on_the_page_and_through_a_share(browser, demo_app):
    page = open_chat(browser, demo_app.url)
    page.evaluate(DROP, json.dumps(hostile_chat()))
    expect(page.locator("#chat-list label")).to_have_count(1)
    click_everything(page)
    expect(page.locator("#chatbot")).to_contain_text("Show the worked steps")  # shown as text

    page.click("#share")
    link = page.locator("#shared-links .shared-link a").first
    expect(link).to_be_attached()
    visitor = browser.new_page(viewport={"width": 1200, "height": 1000})  # a context of its own
    visitor.goto(link.get_attribute("href"))
    visitor.click("a.continue")
    expect(visitor.locator("#chat-list label")).to_have_count(1)
    click_everything(visitor)
    page.close()
    visitor.close()


def test_the_page_runs_scripts_by_nonce_never_inline(demo_app):
    with urllib.request.urlopen(demo_app.url, timeout=30) as response:
        policy = response.headers["content-security-policy"]
        page = response.read().decode()
    script_src = next(part for part in policy.split(";") if part.strip().startswith("script-src"))
    assert "'unsafe-inline'" not in script_src
    nonce = script_src.split("'nonce-", 1)[1].split("'", 1)[0]
    tags = page.count("<script")
    assert tags and page.count(f'<script nonce="{nonce}"') == tags
    with urllib.request.urlopen(demo_app.url, timeout=30) as again:
        assert nonce not in again.headers["content-security-policy"]  # a fresh one for every page
