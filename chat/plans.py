"""Planning an operation: validate it, render the prompt, check the context. No state changes.

A plan is plain data (it crosses to a ZeroGPU worker with its conversation): the history the
reply answers, the prompt token ids, and what recording the reply will need.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from chat.errors import ContextOverflowError, NothingToRegenerateError
from chat.history import Entry, History, oldest_turn
from chat.operations import Continue, Edit, Operation, Regenerate, Send
from chat.options import GenerationOptions
from chat.runtime import Runtime

PlanKind = Literal["reply", "continue"]


@dataclass(frozen=True)
class Plan:
    kind: PlanKind  # "reply": a new reply (send, regenerate, edit); "continue": extend the last one
    history: list[Entry]  # "reply": ends with the user message; "continue": with the reply
    prompt_ids: list[int]
    opens_reasoning: bool  # the prompt leaves a <think> block open
    options: GenerationOptions
    revision: int  # the conversation's revision when planned; a changed one refuses the plan
    regenerates: bool = False  # a new version of the current last reply
    dropped_turns: int = 0  # oldest turns left out to fit the context
    shared_prefix_length: int = 0  # prompt tokens of the system turn, shared between sessions
    earlier_ids: list[int] = field(default_factory=list)  # "continue": the reply's tokens so far


def plan_operation(operation: Operation, history: History, runtime: Runtime, options: GenerationOptions,
                   revision: int) -> Plan:
    match operation:
        case Send(text=text, fit_context=fit):
            return _plan_reply(history.with_user_message(text), history, runtime, options, revision, fit)
        case Regenerate():
            return _plan_reply(history.for_regeneration(), history, runtime, options, revision, False)
        case Edit(index=index, text=text):
            return _plan_reply(history.with_edit(index, text), history, runtime, options, revision, False)
        case Continue():
            return _plan_continue(history, runtime, options, revision)
    raise TypeError(f"not an operation: {operation!r}")


def _plan_reply(entries: list[Entry], history: History, runtime: Runtime, options: GenerationOptions,
                revision: int, fit_context: bool) -> Plan:
    regenerates = history.regenerates(entries)
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
    return Plan("reply", entries, prompt.ids, prompt.opens_reasoning, options, revision, regenerates, dropped,
                _shared_prefix_length(runtime, entries, prompt.ids))


def _plan_continue(history: History, runtime: Runtime, options: GenerationOptions, revision: int) -> Plan:
    last = history.last_reply()
    if last is None:
        raise NothingToRegenerateError("there is no reply to continue")
    reply = last.reply
    prompt_ids = reply.prompt_ids + reply.reply_ids
    check_context(runtime, len(prompt_ids), options)
    entries = list(history.entries)
    return Plan("continue", entries, prompt_ids, reply.opens_reasoning, options, revision,
                shared_prefix_length=_shared_prefix_length(runtime, entries, prompt_ids),
                earlier_ids=list(reply.reply_ids))


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


def _shared_prefix_length(runtime: Runtime, entries: list[Entry], prompt_ids: list[int]) -> int:
    """Tokens of the system prompt turn, when the template renders it as a prompt prefix."""
    if runtime.prefix_store is None or not runtime.template.accepts_system:
        return 0
    if not entries or entries[0].role != "system":
        return 0
    prefix = runtime.template.render_history([entries[0].message()])
    return len(prefix) if prompt_ids[: len(prefix)] == prefix else 0
