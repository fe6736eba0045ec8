"""A conversation as JSON-safe data, and the checked way back.

The format is flat (no nesting, however deep the tree), so it parses without recursion:
  {"format": "rewind-chat.conversation", "version": 1,
   "messages": [{"parent": null | index of an earlier message, "role": "system"|"user"|"assistant",
                 "content": str, "shown": index among its children | null,
                 assistant only: "reasoning_content": str, "stopped": bool, "edited": bool,
                 optional "ended": bool, optional "thought_s": seconds it thought}, ...],
   "shown": index among the top-level messages | null,
   "path": [message indices of the shown path], "system_prompt": str | null,
   optional "title": str (the name the list showed; exports carry it)}
`path` and `system_prompt` repeat what the tree says, for readers; restoring checks they agree.
Token ids are not saved: they are rendered again from the text (a continued restored reply goes
on from its re-tokenized text). Saved data comes from browsers and files, so `from_dict` trusts
nothing: every field, size and link is checked, and the first problem is named.
"""

from __future__ import annotations

import json
from typing import Any, NoReturn

from chat.errors import ConversationError
from chat.dialogue.history import MAX_NODES, MAX_SIBLINGS, History, Node, ReplyVersion

FORMAT = "rewind-chat.conversation"
VERSION = 1
COLLECTION = "rewind-chat.conversations"  # "Export all": {"format", "version", "conversations": [each as above]}
MAX_DEPTH = 500  # messages on one path
MAX_MESSAGE_CHARS = 100_000
MAX_TOTAL_CHARS = 2_000_000
MAX_JSON_BYTES = 8 * MAX_TOTAL_CHARS  # escaped text can be several bytes a character
MAX_NESTING = 4  # the object, its messages, a message, the path
_CHILD_ROLES = {"root": ("system", "user"), "system": ("user",), "user": ("assistant",), "assistant": ("user",)}
_REPLY_KEYS = {"reasoning_content", "stopped", "edited", "ended", "thought_s"}
_KEYS = {"parent", "role", "content", "shown", *_REPLY_KEYS}
MAX_THOUGHT_S = 1e6


class SavedConversationError(ConversationError):
    """Saved conversation data that cannot be restored; nothing was created."""


def to_dict(history: History) -> dict[str, Any]:
    nodes = history.nodes()
    index_of = {node.uid: i for i, node in enumerate(nodes)}
    messages = []
    for node in nodes:
        item: dict[str, Any] = {"parent": index_of[node.parent.uid] if node.parent is not history.root else None,
                                "role": node.role, "shown": node.active}
        if node.role == "assistant":
            assert node.reply is not None
            item.update(reply_fields(node.reply))
        else:
            item["content"] = node.content
        messages.append(item)
    return {"format": FORMAT, "version": VERSION, "messages": messages, "shown": history.root.active,
            "path": [index_of[node.uid] for node in history.entries], "system_prompt": history.system_prompt}


def path_only(data: dict[str, Any]) -> dict[str, Any]:
    """The shown path of `to_dict` data as a conversation of its own, without the other branches
    (a shared link's snapshot: what was on screen and nothing else)."""
    messages = [data["messages"][index] for index in data["path"]]
    kept = [{**message, "parent": i - 1 if i else None, "shown": 0 if i < len(messages) - 1 else None}
            for i, message in enumerate(messages)]
    return {"format": FORMAT, "version": VERSION, "messages": kept, "shown": 0 if kept else None,
            "path": list(range(len(kept))), "system_prompt": data.get("system_prompt")}


def reply_fields(reply: ReplyVersion) -> dict[str, Any]:
    """An assistant message's fields besides its place in the tree."""
    item: dict[str, Any] = dict(content=reply.content, reasoning_content=reply.reasoning_content,
                                stopped=reply.stopped, edited=reply.edited)
    if reply.ended:
        item["ended"] = True
    if reply.thought_s is not None:
        item["thought_s"] = round(reply.thought_s, 1)
    return item


def to_dict_as_recorded(history: History, path: list[Node], reply: Node | None,
                        version: ReplyVersion) -> dict[str, Any]:
    """`to_dict(history)` as it will be once `version` is recorded for a planned `path` (`reply`:
    the plan's new node; None for a Continue, which replaces the last reply of `path`), worked out
    on a copy: the tree itself is unchanged."""
    copy = from_dict(to_dict(history))  # the same tree, node for node, in the same order
    same = dict(zip((node.uid for node in history.nodes()), copy.nodes()))
    # a plan's new nodes (copies of kept turns, when older ones were dropped) bring their replies along
    copied = [same.get(node.uid) or copy.node(node.role, node.content, node.reply) for node in path]
    if reply is None:
        copy.record_continuation(copied, version)
    else:
        copy.record_reply(copied, copy.node("assistant"), version)
    return to_dict(copy)


def collection(conversations: list[dict[str, Any]]) -> dict[str, Any]:
    """Several conversations in one file ("Export all"), each in the format above with its title."""
    return {"format": COLLECTION, "version": VERSION, "conversations": conversations}


def collected(data: Any) -> list[dict[str, Any]] | None:
    """The conversations of a collection (each still to be checked with `from_dict`), or None if
    `data` is not one."""
    if not isinstance(data, dict) or data.get("format") != COLLECTION:
        return None
    if data.get("version") != VERSION or not isinstance(data.get("conversations"), list) or set(data) - {
            "format", "version", "conversations"}:
        _fail(f"a collection must be {{format, version: {VERSION}, conversations: [...]}}")
    return data["conversations"]


def nests_deeper(value: Any, depth: int) -> bool:
    """Whether `value` has lists or dicts more than `depth` levels down (found without recursion,
    before anything that recurses, a JSON encoder or a deep copy, meets it). The saved format is
    flat: 4 levels (the object, its messages, a message, its path list) are all it needs."""
    stack = [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, (dict, list)):
            if level > depth:
                return True
            stack.extend((child, level + 1) for child in (item.values() if isinstance(item, dict) else item))
    return False


def loads(text: str | bytes) -> dict[str, Any]:
    """Parse saved JSON text, bounded in size before parsing."""
    if len(text) > MAX_JSON_BYTES:
        raise SavedConversationError(f"saved conversation: more than {MAX_JSON_BYTES} bytes")
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as error:
        raise SavedConversationError(f"saved conversation: not valid JSON ({error})") from None
    return data


def from_dict(data: Any) -> History:
    """The tree `to_dict` described, after checking all of it."""
    items = _checked_envelope(data)
    history = History()
    nodes: list[Node] = []
    depth: list[int] = []
    total_chars = 0
    for i, item in enumerate(items):
        where = f"messages[{i}]"
        if not isinstance(item, dict):
            _fail(f"{where} must be an object")
        if set(item) - _KEYS:
            _fail(f"{where} has unknown field {sorted(set(item) - _KEYS)[0]!r}")
        parent_index = item.get("parent")
        if parent_index is None:
            parent, level = history.root, 1
        elif _is_int(parent_index) and 0 <= parent_index < i:
            parent, level = nodes[parent_index], depth[parent_index] + 1
        else:
            _fail(f"{where}.parent must be null or the index of an earlier message")
        if level > MAX_DEPTH:
            _fail(f"{where} is {level} messages deep, more than {MAX_DEPTH}")
        node = _node(history, item, parent, where)
        reply = node.reply
        total_chars += len(node.content) if reply is None else len(reply.content) + len(reply.reasoning_content)
        if total_chars > MAX_TOTAL_CHARS:
            _fail(f"more than {MAX_TOTAL_CHARS} characters in all")
        history._attach(parent, node)
        nodes.append(node)
        depth.append(level)

    for i, (item, node) in enumerate(zip(items, nodes)):
        node.active = _shown(item.get("shown"), node, f"messages[{i}].shown")
    history.root.active = _shown(data.get("shown"), history.root, "shown")
    index_of = {node.uid: i for i, node in enumerate(nodes)}
    if "path" in data and data["path"] != [index_of[node.uid] for node in history.entries]:
        _fail("path does not follow the shown branches")
    if "system_prompt" in data and data["system_prompt"] != history.system_prompt:
        _fail("system_prompt differs from the shown path's system message")
    return history


def _checked_envelope(data: Any) -> list[Any]:
    """The fields around the messages, checked; the messages' list."""
    if not isinstance(data, dict):
        _fail(f"expected an object, got {type(data).__name__}")
    if nests_deeper(data, MAX_NESTING):
        _fail(f"nested more than {MAX_NESTING} levels deep (the format is flat)")
    if data.get("format") != FORMAT:
        _fail(f"format must be {FORMAT!r}")
    if data.get("version") != VERSION:
        _fail(f"version {data.get('version')!r} is not supported (this app reads version {VERSION})")
    unknown = set(data) - {"format", "version", "messages", "shown", "path", "system_prompt", "title"}
    if unknown:
        _fail(f"unknown field {sorted(unknown)[0]!r}")
    if "title" in data and not isinstance(data["title"], str):
        _fail("title must be text")
    items = data.get("messages")
    if not isinstance(items, list):
        _fail("messages must be a list")
    if len(items) > MAX_NODES:
        _fail(f"{len(items)} messages, more than the {MAX_NODES} a conversation may hold")
    return items


def _node(history: History, item: dict[str, Any], parent: Node, where: str) -> Node:
    """One message, checked against its parent (not attached yet)."""
    role = item.get("role")
    if role not in _CHILD_ROLES[parent.role]:
        place = "at the top" if parent.role == "root" else f"under a {parent.role} message"
        _fail(f"{where}.role must be one of {', '.join(_CHILD_ROLES[parent.role])} {place}, not {role!r}")
    if len(parent.children) >= MAX_SIBLINGS:
        _fail(f"{where}: more than {MAX_SIBLINGS} branches at one message")
    content = _text(item.get("content"), f"{where}.content")
    if role == "assistant":
        reasoning = _text(item.get("reasoning_content", ""), f"{where}.reasoning_content")
        stopped, edited, ended = (item.get(name, False) for name in ("stopped", "edited", "ended"))
        if not all(isinstance(flag, bool) for flag in (stopped, edited, ended)):
            _fail(f"{where}.stopped, .edited and .ended must be true or false")
        thought_s = item.get("thought_s")
        if thought_s is not None and (isinstance(thought_s, bool) or not isinstance(thought_s, (int, float))
                                      or not 0 <= thought_s <= MAX_THOUGHT_S):
            _fail(f"{where}.thought_s must be a number of seconds from 0 to {MAX_THOUGHT_S:g}")
        version = ReplyVersion(content, reasoning, None, None, False, stopped, edited, ended,
                               None if thought_s is None else float(thought_s))
        return history.node("assistant", reply=version)
    if set(item) & _REPLY_KEYS:
        _fail(f"{where}: only replies have {', '.join(sorted(_REPLY_KEYS))}")
    if not content.strip():
        _fail(f"{where}.content is empty")
    return history.node(role, content)


def _shown(value: Any, node: Node, where: str) -> int | None:
    if value is None:
        return None
    if not _is_int(value) or not 0 <= value < len(node.children):
        _fail(f"{where} must be null or the position of one of its {len(node.children)} replies or branches")
    return value


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        _fail(f"{where} must be text")
    if len(value) > MAX_MESSAGE_CHARS:
        _fail(f"{where} is longer than {MAX_MESSAGE_CHARS} characters")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        _fail(f"{where} is not valid text (a lone surrogate)")
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _fail(problem: str) -> NoReturn:
    raise SavedConversationError(f"saved conversation: {problem}")
