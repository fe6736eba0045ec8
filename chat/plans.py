"""Planning an operation: validate it, render the prompt, check the context. No state changes.

A plan is plain data (it crosses to a ZeroGPU worker with its conversation): the history the
reply answers, the prompt token ids, and what recording the reply will need.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from cache_sessions.session import common_prefix_length
from chat.errors import ContextOverflowError, NothingToRegenerateError
from chat.history import History, Node, oldest_turn
from chat.operations import Continue, Edit, Operation, Regenerate, Send
from chat.options import GenerationOptions
from chat.runtime import Runtime

PlanKind = Literal["reply", "continue"]


@dataclass(frozen=True)
class Plan:
    kind: PlanKind  # "reply": a new reply (send, regenerate, edit); "continue": extend the last one
    history: list[Node]  # the path answered: "reply": ends with the user message; "continue": with the reply
    prompt_ids: list[int]
    opens_reasoning: bool  # the prompt leaves a <think> block open
    options: GenerationOptions
    revision: int  # the conversation's revision when planned; a changed one refuses the plan
    fork: int | None = None  # the shown message the new path replaces (its branch is kept)
    dropped_turns: int = 0  # oldest turns left out to fit the context
    shared_prefix_length: int = 0  # prompt tokens of the system turn, shared between sessions
    earlier_ids: list[int] = field(default_factory=list)  # "continue": the reply's tokens so far


def plan_operation(operation: Operation, history: History, runtime: Runtime, options: GenerationOptions,
                   revision: int) -> Plan:
    match operation:
        case Send(text=text, fit_context=fit):
            return _plan_reply(history.with_user_message(text), history, runtime, options, revision, fit)
        case Regenerate(index=index):
            return _plan_reply(history.for_regeneration(index), history, runtime, options, revision, False)
        case Edit(index=index, text=text):
            return _plan_reply(history.with_edit(index, text), history, runtime, options, revision, False)
        case Continue():
            return _plan_continue(history, runtime, options, revision)
    raise TypeError(f"not an operation: {operation!r}")


def _plan_reply(entries: list[Node], history: History, runtime: Runtime, options: GenerationOptions,
                revision: int, fit_context: bool) -> Plan:
    dropped = 0
    while True:
        messages = [entry.message() for entry in entries]
        prompt = runtime.template.render(messages, enable_thinking=options.enable_thinking)
        try:
            check_context(runtime, len(prompt.ids), options)
            break
        except ContextOverflowError:
            turn = oldest_turn(entries)
            if not fit_context or turn is None:
                raise
            del entries[turn[0]:turn[1]]
            dropped += 1
    history.check_room(entries)
    return Plan("reply", entries, prompt.ids, prompt.opens_reasoning, options, revision, history.fork_of(entries),
                dropped, _shared_prefix_length(runtime, entries, prompt.ids))


def _plan_continue(history: History, runtime: Runtime, options: GenerationOptions, revision: int) -> Plan:
    last = history.last_reply()
    if last is None:
        raise NothingToRegenerateError("there is no reply to continue")
    entries = history.entries
    prompt, reply_ids = reply_tokens(runtime, entries)
    prompt_ids = prompt + reply_ids
    check_context(runtime, len(prompt_ids), options)
    return Plan("continue", entries, prompt_ids, last.reply.opens_reasoning, options, revision,
                shared_prefix_length=_shared_prefix_length(runtime, entries, prompt_ids),
                earlier_ids=reply_ids)


def reply_tokens(runtime: Runtime, path: list[Node]) -> tuple[list[int], list[int]]:
    """(prompt ids, reply ids) of the reply ending `path`: as generated, or, for a reply written
    by hand or restored from text, rendered with the template and the reply left open."""
    reply = path[-1].reply
    assert reply is not None
    if reply.prompt_ids is not None and reply.reply_ids is not None:
        return list(reply.prompt_ids), list(reply.reply_ids)
    messages = [node.message() for node in path]
    whole = runtime.template.render_continuation(messages)
    prompt = runtime.template.render(messages[:-1]).ids
    split = min(common_prefix_length(whole, prompt), len(whole))
    return whole[:split], whole[split:]


def check_context(runtime: Runtime, prompt_tokens: int, options: GenerationOptions) -> None:
    limit = runtime.context_limit
    if limit is not None and prompt_tokens + options.max_new_tokens > limit:
        raise ContextOverflowError(
            f"the prompt ({prompt_tokens} tokens) plus max_new_tokens ({options.max_new_tokens}) "
            f"exceeds the model's context of {limit} tokens",
            prompt_tokens=prompt_tokens,
            max_new_tokens=options.max_new_tokens,
            context_limit=limit,
        )


def _shared_prefix_length(runtime: Runtime, entries: list[Node], prompt_ids: list[int]) -> int:
    """Tokens of the system prompt turn, when the template renders it as a prompt prefix."""
    if runtime.prefix_store is None or not runtime.template.accepts_system:
        return 0
    if not entries or entries[0].role != "system":
        return 0
    prefix = runtime.template.render_history([entries[0].message()])
    return len(prefix) if prompt_ids[: len(prefix)] == prefix else 0
