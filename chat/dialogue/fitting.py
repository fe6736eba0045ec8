"""Fitting a long history into the model's context: the fewest oldest turns left out, found in
time bounded by the context, not by the history.

Dropping one turn at a time and rendering everything again each time is quadratic (100 turns of
1,000 characters took 12.5 s). Here a history that may not fit is rendered once as a skeleton
(markers in place of each message's text: what the template itself adds around every message),
the texts are measured newest first and only until the context is full, the cut is chosen at a
turn boundary from those sizes, and the template renders the kept messages for real. The prompt
is always the template's own rendering of the kept messages, and the cut is checked on it: the
kept ones fit, and one more turn would not. A history of any length costs one skeleton render
plus the renders of about a context's worth of messages.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

from chat.errors import ContextOverflowError, PlanningCancelled
from chat.dialogue.history import Message
from chat.dialogue.templates import ChatTemplate, RenderedPrompt

_MARK = re.compile("\ue000([0-9]+)([cr])\ue001")  # private-use characters: in no real text
CLEAR_MARGIN = 2  # a history measured at twice the room is refused without rendering it all
QUICK_CHARS_PER_TOKEN = 8  # a history under `room * 8` characters is simply rendered whole


@dataclass(frozen=True)
class Fitted:
    kept: list[int]  # indices of the messages kept, in order
    prompt: RenderedPrompt
    dropped_turns: int


def fit_to_context(template: ChatTemplate, messages: list[Message], *, context_limit: int | None,
                   max_new_tokens: int, enable_thinking: bool | None, may_drop: bool, dropped_before: int = 0,
                   cancelled: Callable[[], bool] = lambda: False) -> Fitted:
    """The prompt for a reply to `messages`, leaving `max_new_tokens` of the context for the reply
    (no limit: all of them). With `may_drop`, the oldest user turns (a user message and what
    answered it) are left out; the messages before the first user message (a system prompt) and
    the last user message always stay. Raises `ContextOverflowError` when it cannot.

    Which turns go, in blocks so that most turns reuse the cache: the prompt keeps the cut of the
    reply before it (`dropped_before` turns) while that fits, so it starts as that reply's did
    and only the new turn is prefilled. When it no longer fits (or nothing was dropped before and
    everything no longer fits), the fewest oldest turns go that bring the prompt within
    `REFIT_SHARE` of the room (within the room, where the newest turn alone is longer): the
    prompt's start moves, costing one prefill of what is kept, and the turns after it have room
    to grow into. Dropping only what is needed each turn would move the start every turn."""
    room = None if context_limit is None else context_limit - max_new_tokens
    users = [i for i, message in enumerate(messages) if message["role"] == "user"]
    droppable = max(0, len(users) - 1) if may_drop else 0
    fewest = _Fewest(template, messages, users, enable_thinking, max_new_tokens, context_limit, cancelled)
    if room is None or not droppable:
        return fewest.fit(room, droppable)
    if dropped_before:
        turns = min(dropped_before, droppable)
        prompt = fewest.render(turns)
        if len(prompt.ids) <= room:
            return Fitted(fewest.kept(turns), prompt, turns)
    else:
        fitted = fewest.fit(room, droppable)
        if not fitted.dropped_turns:
            return fitted
    try:
        return fewest.fit(int(room * REFIT_SHARE), droppable)
    except ContextOverflowError:  # the newest turn alone takes more than that share
        return fewest.fit(room, droppable)


REFIT_SHARE = 0.5  # once turns must go: the kept ones fill at most this share of the room


@dataclass
class _Fewest:
    """The fewest oldest turns to leave out for a prompt within a room, found in time bounded by
    the room (see the module's docstring)."""

    template: ChatTemplate
    messages: list[Message]
    users: list[int]
    enable_thinking: bool | None
    max_new_tokens: int
    context_limit: int | None
    cancelled: Callable[[], bool]

    def kept(self, turns: int) -> list[int]:
        return list(range(len(self.messages))) if not turns else \
            list(range(self.users[0])) + list(range(self.users[turns], len(self.messages)))

    def render(self, turns: int) -> RenderedPrompt:
        if self.cancelled():
            raise PlanningCancelled("planning was stopped")
        return self.template.render([self.messages[i] for i in self.kept(turns)], enable_thinking=self.enable_thinking)

    def overflow(self, tokens: int, exact: bool) -> ContextOverflowError:
        assert self.context_limit is not None
        return ContextOverflowError(
            f"the prompt ({tokens if exact else f'about {tokens} or more'} tokens) plus max_new_tokens "
            f"({self.max_new_tokens}) exceeds the model's context of {self.context_limit} tokens",
            prompt_tokens=tokens, max_new_tokens=self.max_new_tokens, context_limit=self.context_limit)

    def fit(self, room: int | None, droppable: int) -> Fitted:
        """The fewest of the oldest `droppable` turns left out for a prompt within `room` tokens."""
        messages, users, render = self.messages, self.users, self.render
        turns, estimated = 0, False
        if room is not None and _chars(messages) > room * QUICK_CHARS_PER_TOKEN:
            estimate = _estimate(self.template, messages, users, room, self.enable_thinking, self.cancelled)
            if droppable and estimate.fewest > CLEAR_MARGIN * room:
                raise self.overflow(estimate.fewest, exact=False)
            if not droppable and estimate.clearly_over is not None:
                raise self.overflow(estimate.clearly_over, exact=False)
            turns, estimated = min(estimate.turns, droppable), True
        prompt, grew = render(turns), False
        if room is not None and len(prompt.ids) > room and droppable and not estimated:
            # few characters, many turns: the cut from the sizes too, not one render per dropped turn
            turns = min(_estimate(self.template, messages, users, room, self.enable_thinking,
                                  self.cancelled).turns, droppable)
            prompt = render(turns)
        while room is not None and len(prompt.ids) > room and turns < droppable:  # measured short: one more goes
            turns, grew = turns + 1, True
            prompt = render(turns)
        if room is not None and len(prompt.ids) > room:
            raise self.overflow(len(prompt.ids), exact=True)
        while turns > 0 and not grew:  # measured generously: turns come back while they fit
            wider = render(turns - 1)
            if room is not None and len(wider.ids) > room:
                break
            turns, prompt = turns - 1, wider
        return Fitted(self.kept(turns), prompt, turns)


@dataclass(frozen=True)
class _Estimate:
    turns: int  # oldest turns to leave out
    fewest: int  # tokens of what always stays: the leading messages and the last user turn
    clearly_over: int | None  # tokens measured once past CLEAR_MARGIN times the room, if it got there


def _estimate(template: ChatTemplate, messages: list[Message], users: list[int], room: int,
              enable_thinking: bool | None, cancelled: Callable[[], bool]) -> _Estimate:
    """Message sizes newest first, from the skeleton's overhead and each text's own tokens, until
    the measured part is clearly over the room (never more than that is tokenized)."""
    overhead, fixed, rendered = _skeleton(template, messages, enable_thinking)

    def size(index: int) -> int:
        return overhead[index] + _text_tokens(template, messages[index], rendered[index])

    total = fixed + sum(size(i) for i in range(users[0] if users else len(messages)))
    fewest, turns, start = None, 0, len(messages)
    for count, user in enumerate(reversed(users), start=1):
        if cancelled():
            raise PlanningCancelled("planning was stopped")
        total, start = total + sum(size(i) for i in range(user, start)), user
        fewest = total if fewest is None else fewest
        if total > room and not turns:
            turns = len(users) - count + 1  # this turn and the older ones go
        if total > CLEAR_MARGIN * room:
            return _Estimate(turns, fewest, total)
    return _Estimate(turns, fewest if fewest is not None else total, None)


def _skeleton(template: ChatTemplate, messages: list[Message],
              enable_thinking: bool | None) -> tuple[list[int], int, list[set[str]]]:
    """Per message: the template's own tokens around it; the tokens before the first and after the
    last message (a preamble, the generation prompt); which of its texts the template renders."""
    marked = [{**message, "content": f"\ue000{i}c\ue001",
               **({"reasoning_content": f"\ue000{i}r\ue001"} if message.get("reasoning_content") else {})}
              for i, message in enumerate(messages)]
    text = template.render_text(marked, add_generation_prompt=True, enable_thinking=enable_thinking)
    pieces, owners, rendered, last = [], [], [set() for _ in messages], 0
    for match in _MARK.finditer(text):
        index = int(match.group(1))
        pieces.append(text[last:match.start()])
        owners.append(index)
        rendered[index].add(match.group(2))
        last = match.end()
    counts = template.encode_many(pieces + [text[last:]])
    overhead = [0] * len(messages)
    for index, ids in zip(owners, counts):
        overhead[index] += len(ids)
    return overhead, len(counts[-1]), rendered


def _text_tokens(template: ChatTemplate, message: Message, rendered: set[str]) -> int:
    texts = [message["content"] if "c" in rendered else "",
             (message.get("reasoning_content") or "") if "r" in rendered else ""]
    return sum(len(ids) for ids in template.encode_many([text for text in texts if text]))


def _chars(messages: list[Message]) -> int:
    return sum(len(m["content"]) + len(m.get("reasoning_content") or "") for m in messages)
