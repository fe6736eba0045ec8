"""What a model or an imported file wrote, made inert before the chat renders it as Markdown.

The chat renders a reply's Markdown and the HTML inside it in the browser. Whatever the browser's
own sanitizer keeps, this server-side pass leaves no element that can run or navigate to script:
- the lines inside fenced code blocks stay as written (the renderer shows them as text);
- outside them, every tag is read as the browser's tokenizer reads it. A tag of an inert HTML
  element is rewritten with the attributes that stay inert (its links and images only to http,
  https, mailto or a relative address); a tag the page does not know (`List<int>` in prose or
  code) is kept as written when none of its attributes can act; every other tag (script, style,
  forms, frames, media, SVG and MathML, custom elements, comments, `<!`, `<?`) loses its `<` to
  `&lt;` and is shown as text;
- a Markdown link or image, inline or by reference, whose address has another scheme
  (`javascript:`, `data:text/html`, `vbscript:`) gets a `#` before it: a link to nowhere.
Stored history is never changed: this is applied to what is shown.
"""

from __future__ import annotations

import html
import re
from dataclasses import dataclass

from markdown_it import MarkdownIt

INERT_ELEMENTS = frozenset(
    "a abbr b bdi bdo blockquote br caption center cite code col colgroup dd del details dfn div dl dt em "
    "figcaption figure font h1 h2 h3 h4 h5 h6 hr i img ins kbd li mark ol p pre q rp rt ruby s samp small "
    "span strike strong sub summary sup table tbody td tfoot th thead time tr tt u ul var wbr".split())
INERT_ATTRIBUTES = frozenset(
    "title alt lang dir width height align valign colspan rowspan start reversed open abbr scope span "
    "datetime color size face border cellpadding cellspacing".split())
URL_ATTRIBUTES = {"a": "href", "img": "src"}
SAFE_SCHEMES = frozenset({"http", "https", "mailto"})
SAFE_DATA_IMAGE = re.compile(r"data:image/(png|gif|jpeg|webp)[;,]")
# On an element the page does not know, an attribute acts through its name alone: handlers,
# style, identity (the page's script finds its controls by class and id), custom elements,
# namespaces, and every attribute that holds an address somewhere.
ACTING_ATTRIBUTES = re.compile(r"^(on|xmlns|xlink)|^(style|class|id|name|is|slot|form\w*|action|src\w*|href|data|"
                               r"poster|background|ping|cite|codebase|archive|srcdoc|attributename|values|to|"
                               r"from|by|popover\w*|contenteditable|autofocus|tabindex|accesskey)$|href|src")

_WHITESPACE = " \t\n\f\r"
_TAG_START = re.compile(r"<(/?)([A-Za-z])")
_LINK_TARGET = re.compile(r"\]\(|\]:")
_ESCAPED_PUNCTUATION = re.compile(r"\\([!-/:-@\[-`{-~])")
_IGNORED_IN_URLS = re.compile(r"[\x00-\x20\x7f]")
_SCHEME = re.compile(r"([a-z][a-z0-9+.\-]*):")
_LINE_END = re.compile(r"\r\n|\r|\n")


@dataclass
class Tag:
    """A tag as the browser's tokenizer reads it: `end` is the index just past its `>`."""

    name: str
    closing: bool
    attributes: list[tuple[str, str]]
    end: int


def safe_markdown(text: str) -> str:
    """`text` with nothing the chat would render as active content (see the module's docstring)."""
    if "<" not in text and "](" not in text and "]:" not in text:
        return text
    pieces = []
    for start, end, is_code in _regions(text):
        part = text[start:end]
        pieces.append(part if is_code else _inert_tags(_inert_links(part)))
    return "".join(pieces)


def is_safe_url(url: str, image: bool = False) -> bool:
    """Whether a browser reading `url` (entities decoded) goes to http, https, mailto, a relative
    address or, for an image, a raster `data:` image."""
    plain = _IGNORED_IN_URLS.sub("", url).lower()
    if image and SAFE_DATA_IMAGE.match(plain):
        return True
    scheme = _SCHEME.match(plain)
    return scheme is None or scheme.group(1) in SAFE_SCHEMES


def _regions(text: str) -> list[tuple[int, int, bool]]:
    """`text` cut at the lines inside its fenced code blocks: (start, end, is code). A fence's
    opening line is not code (its info string lands in the page as a class)."""
    offsets = [0] + [match.end() for match in _LINE_END.finditer(text)]  # (as markdown-it counts lines)
    if offsets[-1] < len(text):
        offsets.append(len(text))
    fences = sorted(token.map for token in MarkdownIt("commonmark").parse(text)
                    if token.type == "fence" and token.map)
    regions, at = [], 0
    for first, last in fences:
        start, end = offsets[min(first + 1, len(offsets) - 1)], offsets[min(last, len(offsets) - 1)]
        if start > at:
            regions.append((at, start, False))
        regions.append((start, end, True))
        at = end
    if at < len(text):
        regions.append((at, len(text), False))
    return regions


def _inert_tags(text: str) -> str:
    out, at = [], 0
    for match in _TAG_START.finditer(text):
        if match.start() < at:
            continue
        tag = read_tag(text, match.start())
        shown = _shown_tag(text[match.start():tag.end], tag) if tag else None
        out.append(text[at:match.start()])
        out.append(shown or "&lt;")
        at = tag.end if shown else match.start() + 1  # (text shown as text is read on: it holds tags)
    out.append(text[at:])
    # `<!` (comments, CDATA, declarations) and `<?` are never markup here
    return re.sub(r"<(?=[!?])", "&lt;", "".join(out))


def _shown_tag(written: str, tag: Tag) -> str | None:
    """The tag as it is shown: rewritten (an inert element), as written (one the page does not
    know, whose attributes cannot act), or None: shown as text."""
    name = tag.name
    if name in INERT_ELEMENTS:
        if tag.closing:
            return f"</{name}>"
        kept = [(key, value) for key, value in tag.attributes if _keeps(name, key, value)]
        attributes = "".join(f' {key}="{html.escape(value, quote=True)}"' if value else f" {key}"
                             for key, value in kept)
        return f"<{name}{attributes}>"
    known = name in _ACTIVE_ELEMENTS or "-" in name or ":" in name
    if known or any(ACTING_ATTRIBUTES.search(key) or _names_script(value) for key, value in tag.attributes):
        return None
    return written


def _keeps(element: str, key: str, value: str) -> bool:
    if key == URL_ATTRIBUTES.get(element):
        return is_safe_url(value, image=element == "img")
    return key in INERT_ATTRIBUTES


def _names_script(value: str) -> bool:
    plain = _IGNORED_IN_URLS.sub("", value).lower()
    return "script:" in plain or plain.startswith("data:")


def _inert_links(text: str) -> str:
    """Markdown links and images, inline (`](`) or by reference (`]:`), with an address of another
    scheme: a `#` put before it."""
    out, at = [], 0
    for match in _LINK_TARGET.finditer(text):
        start = match.end()
        while start < len(text) and text[start] in " \t\n>" and start - match.end() < 16:  # (`>`: a quote's
            start += 1                                                                  # next line)
        if start < len(text) and text[start] == "<":
            start += 1
        target = html.unescape(_ESCAPED_PUNCTUATION.sub(r"\1", text[start:start + 80]))
        if not is_safe_url(target, image=True):
            out.append(text[at:start] + "#")
            at = start
    out.append(text[at:])
    return "".join(out)


def read_tag(text: str, start: int) -> Tag | None:
    """The tag opening at `text[start]` ("<" then a letter, or "</" then a letter), read by the
    HTML tokenizer's states; None where the text ends inside it (the browser drops such a tag)."""
    closing = text[start + 1] == "/"
    at = start + 2 if closing else start + 1
    name_end = at
    while name_end < len(text) and text[name_end] not in _WHITESPACE + "/>":
        name_end += 1
    name = text[at:name_end].lower()
    attributes: list[tuple[str, str]] = []
    at = name_end
    while at < len(text):
        char = text[at]
        if char in _WHITESPACE or char == "/":
            at += 1
        elif char == ">":
            return Tag(name, closing, attributes, at + 1)
        else:
            key, value, at = _read_attribute(text, at)
            if at < 0:
                return None
            attributes.append((key, value))
    return None


def _read_attribute(text: str, at: int) -> tuple[str, str, int]:
    """One attribute from `text[at]`: its name (lowercase), its value (entities decoded) and where
    reading goes on; -1 where the text ends inside a quoted value."""
    name_end = at + 1  # (a first "=" belongs to the name)
    while name_end < len(text) and text[name_end] not in _WHITESPACE + "/>=":
        name_end += 1
    key = text[at:name_end].lower()
    at = name_end
    while at < len(text) and text[at] in _WHITESPACE:
        at += 1
    if at >= len(text) or text[at] != "=":
        return key, "", at
    at += 1
    while at < len(text) and text[at] in _WHITESPACE:
        at += 1
    if at < len(text) and text[at] in "\"'":
        close = text.find(text[at], at + 1)
        if close < 0:
            return key, "", -1
        return key, html.unescape(text[at + 1:close]), close + 1
    value_end = at
    while value_end < len(text) and text[value_end] not in _WHITESPACE + ">":
        value_end += 1
    return key, html.unescape(text[at:value_end]), value_end


_ACTIVE_ELEMENTS = frozenset(
    "script style iframe frame frameset object embed applet param base basefont link meta form input button "
    "select option optgroup textarea datalist output keygen isindex label fieldset legend portal fencedframe "
    "template slot noscript noembed noframes xmp plaintext listing title html head body svg math area map "
    "image audio video source track picture canvas dialog marquee bgsound blink menu search animate "
    "animatemotion animatetransform set use foreignobject handler listener discard mpath nav".split())
