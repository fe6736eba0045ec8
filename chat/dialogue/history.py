"""The canonical history as a tree: every message keeps its siblings, and one path is shown.

An edit, a regeneration, a hand-edited reply or a new system prompt adds a sibling instead of
replacing anything, so nothing a user wrote or read is lost; `entries` is the path shown (what
the chat template renders and the cache follows). Operations build the path a reply answers
(`with_*`, `for_regeneration`) out of existing nodes plus new, unattached ones, and
`record_reply` attaches it once the reply exists, so a refused or failed operation leaves the
tree as it was.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from chat.errors import ConversationError, NothingToUndoError

Message = dict[str, Any]
Role = Literal["system", "user", "assistant"]
MAX_SIBLINGS = 32  # branches at one message
MAX_NODES = 2000  # messages in the whole tree, every branch counted


@dataclass
class ReplyVersion:
    """One reply: its text, and the tokens it was made of with the prompt they continued.
    Token ids are None for a reply written by hand or restored from saved text; they are
    rendered from the text when needed (`plans.reply_tokens`)."""

    content: str
    reasoning_content: str
    reply_ids: list[int] | None
    prompt_ids: list[int] | None
    opens_reasoning: bool
    stopped: bool
    edited: bool = False
    ended: bool = False  # the model ended it (an end-of-turn token): a Continue would add nothing
    thought_s: float | None = None  # how long it thought before answering (shown on its Thinking bubble)
    # the oldest user turns its prompt left out to fit the context (they stay in the tree); the
    # next turn keeps that cut while it fits (chat/dialogue/fitting.py). Not saved: a restored one refits.
    dropped_turns: int = 0


@dataclass(eq=False)
class Node:
    """A message in the tree. `active` is the child shown (None: the shown path ends here).
    `uid` is drawn from the tree's own counter (`History.node`): unique within the tree wherever
    it travels (a ZeroGPU worker, a pickle), so branch states and thinking times keyed by it
    never meet another branch's."""

    role: Literal["root", "system", "user", "assistant"]
    uid: int
    content: str = ""  # system and user messages
    reply: ReplyVersion | None = None  # assistant messages
    parent: Node | None = field(default=None, repr=False)
    children: list[Node] = field(default_factory=list, repr=False)
    active: int | None = None

    def message(self) -> Message:
        if self.role != "assistant":
            return {"role": self.role, "content": self.content}
        assert self.reply is not None
        return {"role": "assistant", "content": self.reply.content, "reasoning_content": self.reply.reasoning_content}

    def branches(self) -> tuple[int, int]:
        """(shown, count) of its children: the branches that follow this message."""
        return (self.active or 0, len(self.children))

    @property
    def shown_child(self) -> Node | None:
        return self.children[self.active] if self.active is not None else None

    def add_child(self, child: Node) -> Node:
        """Attach `child` as the last sibling and show it."""
        check_room_for_sibling(self)
        child.parent = self
        self.children.append(child)
        self.active = len(self.children) - 1
        return child

    def show(self, child: Node) -> None:
        self.active = next(i for i, c in enumerate(self.children) if c is child)

    def below(self) -> list[Node]:
        """Every node under this one, parents before children, siblings in order."""
        order, stack = [], list(reversed(self.children))
        while stack:
            node = stack.pop()
            order.append(node)
            stack.extend(reversed(node.children))
        return order


def check_room_for_sibling(parent: Node) -> None:
    if len(parent.children) >= MAX_SIBLINGS:
        raise ConversationError(f"this message already has {MAX_SIBLINGS} versions; switch to one of them")


def system_text(text: str | None) -> str | None:
    """A system prompt as the history keeps it: None when there is none (empty or blank)."""
    return text if text is not None and text.strip() else None


class History:
    def __init__(self, system_prompt: str | None = None):
        self._next_uid = 1  # travels with the tree: ids stay unique whoever adds to it
        self.root = Node("root", 0)
        self.size = 0  # nodes in the tree, the root left out
        if (text := system_text(system_prompt)) is not None:
            self._attach(self.root, self.node("system", text))

    def node(self, role: Literal["system", "user", "assistant"], content: str = "",
             reply: ReplyVersion | None = None) -> Node:
        """A new, unattached message with the tree's next id (never given twice, recorded or not)."""
        uid, self._next_uid = self._next_uid, self._next_uid + 1
        return Node(role, uid, content, reply)

    # ---- views -------------------------------------------------------------------------------
    @property
    def entries(self) -> list[Node]:
        """The shown path, root left out."""
        path, node = [], self.root.shown_child
        while node is not None:
            path.append(node)
            node = node.shown_child
        return path

    @property
    def messages(self) -> list[Message]:
        return [node.message() for node in self.entries]

    @property
    def system_prompt(self) -> str | None:
        first = self.root.shown_child
        return first.content if first is not None and first.role == "system" else None

    @property
    def versions(self) -> tuple[int, int]:
        """(shown, count) of the last reply's siblings; (0, 0) when the last message is no reply."""
        path = self.entries
        return self.branches(len(path) - 1) if path and path[-1].role == "assistant" else (0, 0)

    def path_through(self, index: int, node: Node) -> list[Node]:
        """The path shown once `node`, a sibling at message `index`, is: it and its shown path below."""
        path = self.entries[:index] + [node]
        while path[-1].shown_child is not None:
            path.append(path[-1].shown_child)
        return path

    def last_user_index(self) -> int:
        """Where an undo steps back to: the last user message."""
        users = [i for i, node in enumerate(self.entries) if node.role == "user"]
        if not users:
            raise NothingToUndoError("there is no user message to undo")
        return users[-1]

    def last_reply(self) -> Node | None:
        path = self.entries
        return path[-1] if path and path[-1].role == "assistant" else None

    def parent_at(self, index: Any, error: type[ConversationError] = ConversationError) -> Node:
        """The parent of the shown message `index` (checked to exist): its siblings are the branches there."""
        path = self.entries
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(path):
            raise error(f"there is no message at index {index!r}")
        return path[index - 1] if index else self.root

    def branches(self, index: int) -> tuple[int, int]:
        return self.parent_at(index).branches()

    def message_at(self, index: Any, role: Role, error: type[ConversationError] = ConversationError) -> Node:
        """The shown message `index`, checked to exist and to be a `role` message."""
        self.parent_at(index, error)
        node = self.entries[index]
        if node.role != role:
            what = "a reply" if role == "assistant" else f"a {role} message"
            shown = {"assistant": "a reply", "system": "the system prompt"}.get(node.role, f"a {node.role} message")
            raise error(f"message {index} is {shown}, not {what}")
        return node

    def nodes(self) -> list[Node]:
        """Every node, the root left out."""
        return self.root.below()

    # ---- planning: whether a reply could be recorded (nothing changes until it is) ----------
    def check_room(self, path: list[Node]) -> None:
        """Refuse, before anything runs, a reply that could not be recorded."""
        parent, attached, new_nodes = self.root, True, 1  # the reply itself
        for node in path:
            if attached and node.parent is parent:
                parent = node
                continue
            if attached:
                check_room_for_sibling(parent)
            attached, new_nodes = False, new_nodes + 1
        if attached:  # the reply joins existing siblings
            check_room_for_sibling(parent)
        self._check_size(new_nodes)

    # ---- changes -----------------------------------------------------------------------------
    def record_reply(self, path: list[Node], reply: Node, version: ReplyVersion) -> Node:
        """Attach `path` (existing nodes, and new ones: copies where turns were left out to fit the
        context) and `reply` (made by `node()`) with its version under it, and show it."""
        parent = self.root
        for node in path:
            if node.parent is parent:
                parent.show(node)
            elif node.parent is None:
                self._attach(parent, node)
            else:
                raise ValueError("a planned path leaves the tree: plan it again")
            parent = node
        reply.reply = version
        return self._attach(parent, reply)

    def record_continuation(self, path: list[Node], version: ReplyVersion) -> None:
        """The last reply of `path` (the shown path), extended in place."""
        path[-1].reply = version

    def add_reply(self, index: int, node: Node) -> Node:
        """`node`, a reply written by hand (made by `node()`), as a sibling of the reply at `index`, shown."""
        self.message_at(index, "assistant")
        self._check_size(1)
        return self._attach(self.parent_at(index), node)

    def set_system_prompt(self, text: str | None) -> bool:
        """A new branch at the root that starts with this system prompt (none: the next message
        starts one); the current conversation stays one switch away. False if nothing changed."""
        text = system_text(text)
        if text == self.system_prompt:
            return False
        first = self.root.shown_child
        if first is not None and first.role == "system" and not first.children:  # nothing said under it yet:
            self.root.children.remove(first)  # replaced, not kept as an empty branch
            self.root.active, self.size = None, self.size - 1
        if text is None:
            self.root.active = None
            return True
        self._check_size(1)
        self._attach(self.root, self.node("system", text))
        return True

    def undo(self) -> None:
        """Step back before the last user message; the undone turn stays as a branch there."""
        index = self.last_user_index()
        (self.entries[index - 1] if index else self.root).active = None

    def sibling(self, index: int, branch: Any) -> Node:
        """Branch `branch` at the shown message `index`, checked to exist."""
        parent = self.parent_at(index)
        if isinstance(branch, bool) or not isinstance(branch, int) or not 0 <= branch < len(parent.children):
            raise ConversationError(f"message {index} has no branch {branch!r}")
        return parent.children[branch]

    def _attach(self, parent: Node, node: Node) -> Node:
        parent.add_child(node)
        self.size += 1
        return node

    def _check_size(self, new_nodes: int) -> None:
        if self.size + new_nodes > MAX_NODES:
            raise ConversationError(f"this conversation holds {self.size} messages in all its branches, the most "
                                    f"one may; start a new chat")

