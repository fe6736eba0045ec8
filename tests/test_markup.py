"""The server-side pass over what a model or an imported file wrote (ui/markup.py), read back with
an independent HTML parser: no script-capable address and no active element survive, code stays
as written, and ordinary Markdown and HTML pass unchanged."""

from __future__ import annotations

import html.parser

import pytest
from hypothesis import given, settings, strategies as st

from ui.markup import is_safe_url, read_tag, safe_markdown
from ui.views import chatbot_messages, reply_messages

ACTIVE = {"script", "style", "iframe", "object", "embed", "form", "input", "button", "svg", "math", "base",
          "meta", "link", "textarea", "template", "animate", "set", "use", "foreignobject", "gradio-app"}


class Elements(html.parser.HTMLParser):
    """Every element and attribute the browser would build from the text (Python's own parser)."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.found: list[tuple[str, list[tuple[str, str | None]]]] = []

    def handle_starttag(self, tag, attrs):
        self.found.append((tag, attrs))

    handle_startendtag = handle_starttag


def elements(text: str) -> list[tuple[str, list[tuple[str, str | None]]]]:
    parser = Elements()
    parser.feed(text)
    parser.close()
    return parser.found


def assert_inert(text: str) -> None:
    for tag, attributes in elements(text):
        assert tag not in ACTIVE and "-" not in tag, (tag, text)
        for name, value in attributes:
            assert not name.startswith("on") and name not in ("style", "class", "id", "srcdoc"), (name, text)
            if value is not None and name in ("href", "src", "xlink:href", "action", "formaction", "data"):
                assert is_safe_url(value, image=True), (value, text)


ATTACKS = [
    '<svg><a href="javascript:alert(1)"><rect width="9" height="9"/><text>Show the worked steps</text></a></svg>',
    '<svg><a xlink:href="javascript:alert(1)">x</a></svg>',
    '<math><maction actiontype="statusline" xlink:href="javascript:alert(1)">m</maction></math>',
    '<a href="jav&#x09;ascript:alert(1)">a</a><a href=" JAVASCRIPT:alert(1)">b</a><a href=javascript&colon;x>c</a>',
    '<a href="data:text/html,&lt;script&gt;alert(1)&lt;/script&gt;">d</a><a href="vbscript:msgbox">e</a>',
    '<img src=x onerror=alert(1)><img src="javascript:alert(1)"><img/src="x"/onerror="alert(1)">',
    '<div onclick="alert(1)" style="position:fixed">x</div><b class="branch-step bs-0-1">y</b>',
    '<iframe srcdoc="<script>alert(1)</script>"></iframe><object data="javascript:alert(1)"></object>',
    '<form action="javascript:alert(1)"><button formaction="javascript:alert(1)">b</button></form>',
    '<svg><animate attributeName="href" values="javascript:alert(1)"/></svg><svg><set attributeName="onmouseover" to="alert(1)"/></svg>',
    '<script>alert(1)</script><style>*{display:none}</style><base href="javascript:/"><meta http-equiv="refresh">',
    '<gradio-app src="x"></gradio-app><x onmouseover=alert(1)>x</x><t is="a" href="javascript:alert(1)">t</t>',
    '<a title="x" href="javascript:alert(1)"\n\nfoo>split</a><a href=\'javascript:alert(1)\'>single</a>',
    '<!--<a href="javascript:alert(1)">--><![CDATA[<a href="javascript:alert(1)">]]><?x <a href="javascript:1">?>',
    '<noscript><p title="</noscript><img src=x onerror=alert(1)>"></noscript>',
    '<details open ontoggle=alert(1)><summary>s</summary></details><a href="#" ping="http://x">p</a>',
]


@pytest.mark.parametrize("attack", ATTACKS)
def test_no_attack_keeps_an_active_element_or_a_script_address(attack):
    assert_inert(safe_markdown(attack))
    assert_inert(safe_markdown(f"Some prose, then {attack} and more."))


@pytest.mark.parametrize("link", [
    "[x](javascript:alert(1))", "[x]( <javascript:alert(1)>)", "[x](jav&#97;script:alert(1))",
    "[x](javascript\\:alert(1))", "![x](data:text/html,<script>alert(1)</script>)", "[x](JAVASCRIPT:alert(1))",
    "[x][r]\n\n[r]: javascript:alert(1)", "> [x][r]\n>\n> [r]:\n> javascript:alert(1)", "<javascript:alert(1)>",
])
def test_a_markdown_link_to_script_goes_nowhere(link):
    shown = safe_markdown(link)
    assert "](javascript" not in shown.lower() and "]: javascript" not in shown.lower()
    assert "<javascript" not in shown.lower()
    for target in ("javascript", "jav&#97;script", "data:text"):
        at = shown.lower().find(target)
        assert at < 0 or shown[at - 1] in "#;", shown  # a fragment (`#`), or text (`&lt;`)


@pytest.mark.parametrize("text", [
    "Plain **bold**, `code`, [a link](https://example.com/a?b=1) and ![img](data:image/png;base64,AAAA).",
    "A table:\n\n| a | b |\n|---|---|\n| 1 | 2 |\n\nand $x^2$ and \\(y\\).",
    '<b>bold</b> <sub>low</sub> <details open><summary>more</summary>text</details> <a href="/rel">rel</a>',
    "Generics: `List<int>`, `Map<String, Integer>` and a < b > c, 3 <4.",
    "```html\n<script src=\"app.js\"></script>\n<a href=\"javascript:void(0)\" onclick=\"go()\">x</a>\n```\nDone.",
    "~~~\n<svg><a href=\"javascript:x\"></a></svg>\n~~~",
])
def test_ordinary_markdown_and_code_pass_as_written(text):
    assert safe_markdown(text) == text


def test_an_inert_element_keeps_its_inert_attributes_and_loses_the_rest():
    assert safe_markdown('<a href="https://x.org/?a=1&amp;b=2" onclick="go()" title="T">x</a>') == \
        '<a href="https://x.org/?a=1&amp;b=2" title="T">x</a>'
    assert safe_markdown('<span style="color:red" class="continuable">x</span>') == "<span>x</span>"


def test_code_outside_a_fence_that_would_act_is_shown_as_text():
    assert safe_markdown("`<script>alert(1)</script>`") == "`&lt;script>alert(1)&lt;/script>`"


def test_a_tag_is_read_as_the_browser_tokenizes_it():
    text = '<a "x=1" title=\'q>w\' href=/r >'
    tag = read_tag(text, 0)
    assert tag.name == "a" and tag.end == len(text)
    assert tag.attributes == [('"x', ""), ("1\"", ""), ("title", "q>w"), ("href", "/r")] or \
        dict(tag.attributes)["title"] == "q>w"
    assert read_tag('<a href="unterminated>', 0) is None


@settings(max_examples=600, deadline=None, derandomize=True)
@given(st.lists(st.sampled_from([
    "<", ">", "/", "=", '"', "'", " ", "\n", "`", "a", "svg", "href", "javascript:", "java\tscript:", "&#106;",
    "on", "click", "[", "]", "(", ")", ":", "!", "#", "<a ", "<svg>", "<img ", "src=", "x", "```", "-->", "<!--",
]), max_size=40))
def test_any_mix_of_markup_pieces_comes_out_inert(pieces):
    text = "".join(pieces)
    assert_inert(safe_markdown(text))


def test_the_chat_shows_replies_and_thoughts_through_it_and_stores_them_untouched():
    attack = '<svg><a href="javascript:alert(1)">go</a></svg>'
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": attack, "reasoning_content": attack}]
    shown, _ = chatbot_messages(messages, {})
    assert all("javascript:" not in message["content"] or "&lt;svg>" in message["content"] for message in shown)
    for message in shown[1:]:
        assert_inert(message["content"])
    assert messages[1]["content"] == attack  # what the model is given next turn is what it wrote
    for message in reply_messages(attack, attack, None):
        assert_inert(message["content"])
