"""Planning an operation: validate it, render the prompt, fit it to the context. Nothing changes
but the ids new messages draw from the tree.

A plan holds the path the reply answers (existing nodes, and new ones made here), the node the
reply will be, and the `ReplyRequest` a reply source takes (plain data). Planning runs on the
request's thread, costs what the context holds rather than what the history holds
(chat/dialogue/fitting.py), is counted while it runs (`Planner.planning`, shown in /status) and stops
when its caller says it went away.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from cache_sessions.branches import BranchKeep
from cache_sessions.session import common_prefix_length
from chat.errors import ContextOverflowError, NotAUserMessageError, NothingToRegenerateError, ReplyEndedError
from chat.dialogue.fitting import fit_to_context
from chat.dialogue.history import History, Node
from chat.in_flight import InFlight
from chat.dialogue.operations import Continue, Edit, Operation, Regenerate, Send
from chat.dialogue.options import GenerationOptions
from chat.backends.sources import ReplyKind, ReplyRequest
from chat.dialogue.templates import ChatTemplate


@dataclass(frozen=True)
class Plan:
    request: ReplyRequest
    history: list[Node]  # the path answered: "reply": ends with the user message; "continue": with the reply
    reply: Node | None  # "reply": the new reply's node (its version is set when it is recorded)
    revision: int  # the conversation's revision when planned; a changed one refuses the plan
    fork: int | None = None  # the shown message the new path replaces (its branch is kept)
    dropped_turns: int = 0  # oldest turns left out to fit the context
    dropped_before: int = 0  # what the reply before it left out (the cut it keeps while it fits)

    @property
    def kind(self) -> ReplyKind:
        return self.request.kind


class Planner:
    """One engine's way from an operation to a plan: its template and context, shared by all
    its conversations."""

    def __init__(self, template: ChatTemplate, context_limit: int | None):
        self.template, self.context_limit = template, context_limit
        self._planning = InFlight()

    @property
    def planning(self) -> int:
        """Operations being planned now."""
        return self._planning.count

    def plan(self, operation: Operation, history: History, options: GenerationOptions, revision: int,
             cancelled: Callable[[], bool] = lambda: False) -> Plan:
        with self._planning.held():
            if isinstance(operation, Continue):
                return self._continue(history, options, revision, cancelled)
            dropped_before = dropped_before_operation(operation, history)
            fit = operation.fit_context or dropped_before > 0
            return self._reply(answered_path(operation, history), history, options, revision, fit,
                               dropped_before, cancelled)

    def _reply(self, path: list[Node], history: History, options: GenerationOptions, revision: int,
               fit_context: bool, dropped_before: int, cancelled: Callable[[], bool]) -> Plan:
        """The reply to `path`. Turns left out to fit the context stay where they are in the tree
        (the person still sees and can branch from them); only the prompt leaves them out, and
        the reply records how many (`ReplyVersion.dropped_turns`) so the next turn keeps the same
        cut while it fits (chat/dialogue/fitting.py). No branch is made for a cut: however many
        turns a long chat is cut at, it goes on."""
        fitted = fit_to_context(self.template, [node.message() for node in path], context_limit=self.context_limit,
                                max_new_tokens=options.max_new_tokens, enable_thinking=options.enable_thinking,
                                may_drop=fit_context, dropped_before=dropped_before, cancelled=cancelled)
        history.check_room(path)
        reply, fork = history.node("assistant"), fork_of(history, path)
        keep = BranchKeep([node.uid for node in history.entries], fork) if fork is not None else None
        seen = [path[i] for i in fitted.kept]
        request = ReplyRequest("reply", [node.message() for node in seen], fitted.prompt.ids,
                               fitted.prompt.opens_reasoning, options, (*(node.uid for node in seen), reply.uid),
                               keep=keep, references=replaced_replies(history, fork))
        return Plan(request, path, reply, revision, fork, fitted.dropped_turns, dropped_before)

    def _continue(self, history: History, options: GenerationOptions, revision: int,
                  cancelled: Callable[[], bool]) -> Plan:
        last = history.last_reply()
        if last is None or last.reply is None:
            raise NothingToRegenerateError("there is no reply to continue")
        if last.reply.ended:
            raise ReplyEndedError("this reply had ended: there is nothing to continue (Retry writes another)")
        entries = history.entries
        messages = [node.message() for node in entries]
        rendered = None
        if last.reply.prompt_ids is None or last.reply.reply_ids is None:  # its tokens come from its text:
            # the prompt without it must fit, refused before a long history is rendered whole
            rendered = fit_to_context(self.template, messages[:-1], context_limit=self.context_limit,
                                      max_new_tokens=options.max_new_tokens, enable_thinking=None, may_drop=False,
                                      cancelled=cancelled).prompt.ids
        prompt, reply_ids = self.reply_tokens(entries, rendered)
        self.check_context(len(prompt) + len(reply_ids), options)
        request = ReplyRequest("continue", messages, prompt + reply_ids, last.reply.opens_reasoning, options,
                               tuple(node.uid for node in entries), earlier_ids=reply_ids)
        return Plan(request, entries, None, revision)

    def reply_tokens(self, path: list[Node], prompt: list[int] | None = None) -> tuple[list[int], list[int]]:
        """(prompt ids, reply ids) of the reply ending `path`: as generated, or, for a reply written
        by hand or restored from text, rendered with the template and the reply left open
        (`prompt`: the rendered prompt of `path[:-1]`, when the caller has it already)."""
        reply = path[-1].reply
        assert reply is not None
        if reply.prompt_ids is not None and reply.reply_ids is not None:
            return list(reply.prompt_ids), list(reply.reply_ids)
        messages = [node.message() for node in path]
        whole = self.template.render_continuation(messages)
        prompt = prompt if prompt is not None else self.template.render(messages[:-1]).ids
        split = min(common_prefix_length(whole, prompt), len(whole))
        return whole[:split], whole[split:]

    def check_context(self, prompt_tokens: int, options: GenerationOptions) -> None:
        limit = self.context_limit
        if limit is not None and prompt_tokens + options.max_new_tokens > limit:
            raise ContextOverflowError(
                f"the prompt ({prompt_tokens} tokens) plus max_new_tokens ({options.max_new_tokens}) "
                f"exceeds the model's context of {limit} tokens",
                prompt_tokens=prompt_tokens, max_new_tokens=options.max_new_tokens, context_limit=limit)



def answered_path(operation: Operation, history: History) -> list[Node]:
    """The path the new reply answers: existing nodes, then a new user message where there is
    one (nothing is attached until the reply is recorded)."""
    path = history.entries
    match operation:
        case Send(text=text):
            return path + [history.node("user", text)]
        case Edit(index=index, text=text):
            history.message_at(index, "user", NotAUserMessageError)
            return path[:index] + [history.node("user", text)]
        case Regenerate(index=None):  # the last reply, or a trailing user message left without one
            if path and path[-1].role in ("assistant", "user"):
                return path[:-1] if path[-1].role == "assistant" else path
            raise NothingToRegenerateError("there is no reply to retry")
        case Regenerate(index=index):
            history.message_at(index, "assistant", NothingToRegenerateError)
            return path[:index]
    raise TypeError(f"not an operation: {operation!r}")


def dropped_before_operation(operation: Send | Edit | Regenerate, history: History) -> int:
    """How many oldest turns the reply nearest before the new one left out: the reply a Send
    follows, the one a Retry replaces, the one that answered the message an Edit replaces (or
    the last before it). The new prompt keeps that cut while it fits, so its cache is reused."""
    path = history.entries
    match operation:
        case Send():
            upto = len(path)
        case Regenerate(index=index):
            upto = len(path) if index is None else index + 1
        case Edit(index=index):
            upto = index + 2
    reply = next((node for node in reversed(path[:upto]) if node.role == "assistant"), None)
    return reply.reply.dropped_turns if reply is not None and reply.reply is not None else 0


MAX_REFERENCES = 4  # earlier versions a reply guesses from (each is indexed once, at its start)


def replaced_replies(history: History, fork: int | None) -> tuple[tuple[int, ...], ...]:
    """The tokens of the replies the new one takes the place of: at `fork`, the shown reply and
    its other versions (a Retry), or the reply that answered the message an Edit replaces (and
    its versions), the shown one first; those made from text alone (no tokens) are left out."""
    entries = history.entries
    if fork is None or fork >= len(entries):
        return ()
    shown = entries[fork] if entries[fork].role == "assistant" else (
        entries[fork + 1] if fork + 1 < len(entries) and entries[fork + 1].role == "assistant" else None)
    if shown is None or shown.parent is None:
        return ()
    versions = [shown] + [node for node in shown.parent.children if node is not shown and node.role == "assistant"]
    return tuple(tuple(node.reply.reply_ids) for node in versions
                 if node.reply is not None and node.reply.reply_ids)[:MAX_REFERENCES]


def fork_of(history: History, path: list[Node]) -> int | None:
    """Where `path` and the reply recorded under it leave the shown path: the index of the shown
    message they replace, if any."""
    for index, node in enumerate(history.entries):
        if index >= len(path) or path[index] is not node:
            return index  # past the end: the new reply takes the shown one's place
    return None
