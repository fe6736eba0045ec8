"""API requests run on the engine: a prompt rendered (or taken as given), its kept state claimed
(chat/api/kept_states.py), its reply made by the same scheduler as the page's (one step for all,
fair between clients), streamed as reasoning and answer text, cut at a stop string, and its usage.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Hashable, Iterator, Literal

from chat.api.kept_states import Claim, How, KeptStates
from chat.api.protocol import ApiError, Call, ChatCall, invalid
from chat.api.tool_calls import ToolCall, ToolCallText
from chat.backends.local import system_prefix_length
from chat.dialogue.detokenizer import IncrementalDecoder
from chat.dialogue.reasoning import Delta, ReasoningSplitter
from chat.engine import ChatEngine
from chat.errors import ConversationError
from chat.scheduling.requests import CacheWork, GenerationRequest

# Requests one client may have running or waiting (past the batch they wait in the scheduler,
# fairly): one address can be a whole chat UI's server, as Open WebUI's is.
DEFAULT_REQUESTS_PER_CLIENT = 64
DEFAULT_MAX_IN_FLIGHT = 256  # requests of every client together


@dataclass(frozen=True)
class Ending:
    """How a reply ended and what it cost."""

    finish_reason: Literal["stop", "length", "tool_calls"]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens whose states were kept (none computed for them)
    found: How  # how its kept state was found
    content: str
    reasoning: str
    tool_calls: tuple[ToolCall, ...] = ()

    def usage(self) -> dict[str, object]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


class StopStrings:
    """Text in, the text before the first stop string out; what could still become one is held."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops, self.hit = stops, False
        self._held = ""
        self._hold = max((len(stop) for stop in stops), default=1) - 1

    def feed(self, text: str) -> str:
        if self.hit or not self.stops:
            return "" if self.hit else text
        self._held += text
        found = [index for index in (self._held.find(stop) for stop in self.stops) if index >= 0]
        if found:
            self.hit = True
            out, self._held = self._held[: min(found)], ""
            return out
        cut = max(0, len(self._held) - self._hold)
        out, self._held = self._held[:cut], self._held[cut:]
        return out

    def flush(self) -> str:
        out, self._held = ("" if self.hit else self._held), ""
        return out


class ApiRuns:
    """The API's face of one engine: its model's name, its kept states, the requests in flight."""

    def __init__(self, engine: ChatEngine, *, max_new_tokens: int, max_per_client: int = DEFAULT_REQUESTS_PER_CLIENT,
                 max_in_flight: int = DEFAULT_MAX_IN_FLIGHT, states: KeptStates | None = None,
                 model_name: str | None = None):
        """`model_name`: what /v1/models lists and requests name (default: the engine's model)."""
        self.engine, self.max_new_tokens = engine, max_new_tokens
        self.model_name = model_name or engine.name
        self.max_per_client, self.max_in_flight = max_per_client, max_in_flight
        self.states = states or KeptStates(engine.caches, engine.scheduler.call)
        self.vocab_size = len(engine.tokenizer)
        self._lock = threading.Lock()
        self._in_flight: dict[Hashable, int] = {}

    def stats(self) -> dict[str, object]:
        """For `/status`: requests running or waiting, and the kept states."""
        with self._lock:
            in_flight = sum(self._in_flight.values())
        return {"in_flight": in_flight, "states": self.states.stats()}

    @contextmanager
    def admitted(self, client: Hashable) -> Iterator[None]:
        """Counts the request while it runs; 429 past the client's share, 503 past everyone's."""
        with self._lock:
            if sum(self._in_flight.values()) >= self.max_in_flight:
                raise ApiError(503, "the server is at its limit of requests; try again shortly", "server_error",
                               code="server_busy")
            if self._in_flight.get(client, 0) >= self.max_per_client:
                raise ApiError(429, f"at most {self.max_per_client} requests of one client run at once",
                               "rate_limit_exceeded", code="rate_limit_exceeded")
            self._in_flight[client] = self._in_flight.get(client, 0) + 1
        try:
            yield
        finally:
            with self._lock:
                self._in_flight[client] -= 1
                if not self._in_flight[client]:
                    del self._in_flight[client]

    def own_tokens(self, client: Hashable, text: str, prompt_ids: list[int]) -> list[int]:
        """The prompt with earlier replies as the tokens the model chose for them. A client sends a
        reply back as text, which the tokenizer may split otherwise than the model's own tokens
        (the kept states would then part from the prompt inside it, and the model would read its
        reply in a form it never wrote); the page keeps a reply's tokens for the same reason.
        The longest start of what the nearest kept session holds that decodes to a start of
        `text` stands for it, and only the rest is encoded; where none does, the prompt is as
        encoded. (A decoded start grows with the tokens, so where not all of it is a start of
        `text`, the longest that is is found by halving.)"""
        held = self.states.nearest(client, prompt_ids)
        if len(held) <= len(prompt_ids) and held == prompt_ids[: len(held)]:
            return prompt_ids  # nothing to gain: it holds a prefix of the prompt as encoded
        decode = self.engine.tokenizer.decode

        def said(count: int) -> str | None:
            """What its first `count` tokens say, if that starts `text` (and ends on a whole character)."""
            spoken = decode(held[:count], skip_special_tokens=False)
            return spoken if text.startswith(spoken) and not spoken.endswith("\ufffd") else None

        # said(low) holds; the largest such count, all of it first (a next turn: the common case)
        low, high = (len(held), len(held)) if said(len(held)) is not None else (0, len(held) - 1)
        while low < high:
            middle = (low + high + 1) // 2
            low, high = (middle, high) if said(middle) is not None else (low, middle - 1)
        if low == 0 or held[:low] == prompt_ids[:low]:
            return prompt_ids
        return held[:low] + self.engine.runtime.template.encode(text[len(said(low) or ""):])

    def start(self, call: Call, client: Hashable, stop: threading.Event) -> "ApiRun":
        """Render and check the prompt, claim its state and submit it; raises `ApiError` first."""
        runtime = self.engine.runtime
        opens_reasoning, shared_prefix = False, 0
        if isinstance(call, ChatCall):
            if call.tools and not runtime.template.calls_tools:
                raise invalid("this model's chat template offers no tools in a form this server reads back "
                              "(<tool_call> blocks)", "tools")
            try:
                rendered = runtime.template.render(call.messages, tools=call.tools,
                                                   enable_thinking=call.sampling.options.enable_thinking)
            except ConversationError as error:
                raise invalid(str(error), "messages") from error
            prompt_ids = self.own_tokens(client, rendered.text, rendered.ids)
            opens_reasoning = rendered.opens_reasoning
            shared_prefix = system_prefix_length(runtime, call.messages, prompt_ids)
        else:
            prompt_ids = call.token_ids if call.token_ids is not None else runtime.template.encode(call.text or "")
        if not prompt_ids:
            raise invalid("the prompt has no tokens", "prompt")
        limit = self.engine.context_limit
        options = call.sampling.options
        if limit is not None:
            if len(prompt_ids) >= limit:
                raise invalid(f"the prompt has {len(prompt_ids)} tokens; this model's context holds {limit}",
                              "messages" if isinstance(call, ChatCall) else "prompt", "context_length_exceeded")
            options = replace(options, max_new_tokens=min(options.max_new_tokens, limit - len(prompt_ids)))
        claim = self.states.claim(client, prompt_ids)
        try:
            work = CacheWork(runtime.prefix_store, shared_prefix,
                             references=(claim.earlier_reply,) if claim.earlier_reply else ())
            generation = runtime.scheduler.submit(claim.session, prompt_ids, options, stop, work, client)
        except BaseException:
            self.states.give_back(claim, [], 0)
            raise
        return ApiRun(self, claim, generation, call, opens_reasoning, stop)


class ApiRun:
    """One request's reply: iterate `pieces()`, then `end()` (which also stops it if it still runs)."""

    def __init__(self, runs: ApiRuns, claim: Claim, generation: GenerationRequest, call: Call,
                 opens_reasoning: bool, stop: threading.Event):
        self.runs, self.claim, self.generation, self.call, self.stop = runs, claim, generation, call, stop
        self.chat = isinstance(call, ChatCall)
        self.splitter = ReasoningSplitter(starts_in_reasoning=opens_reasoning) if self.chat else None
        self.stops = StopStrings(call.sampling.stops)
        self.tool_text = ToolCallText() if isinstance(call, ChatCall) and call.tools else None
        self.tool_calls: list[ToolCall] = []
        self.content = self.reasoning = ""
        self._ended: Ending | None = None

    def pieces(self) -> Iterator[Delta]:
        """The reply's text as it comes: reasoning and answer (a completion's text is all answer)."""
        runtime = self.runs.engine.runtime
        decoder = IncrementalDecoder(runtime.tokenizer, runtime.eos_token_ids)
        for token_id in self.generation.tokens():
            yield from self._text(decoder.push(token_id))
            if self.stops.hit:
                self.stop.set()
                break
        else:
            yield from self._text(decoder.flush())
        if self.splitter is not None:
            for delta in self.splitter.finish():
                yield from self._kept(delta)
        if self.tool_text is not None:
            self.tool_calls, rest = self.tool_text.finish()
            yield from self._kept(Delta("answer", rest), calls_read=True)
        yield from self._kept(Delta("answer", self.stops.flush()), flushed=True)

    def _text(self, text: str) -> Iterator[Delta]:
        deltas = self.splitter.feed(text) if self.splitter is not None else [Delta("answer", text)]
        for delta in deltas:
            yield from self._kept(delta)

    def _kept(self, delta: Delta, flushed: bool = False, calls_read: bool = False) -> Iterator[Delta]:
        """A delta after tool calls and stop strings: reasoning passes; the answer is held from
        a tool call's start (`ToolCallText`) and cut at a stop."""
        text = delta.text
        if delta.kind == "answer" and not flushed:
            if self.tool_text is not None and not calls_read:
                text = self.tool_text.feed(text)
            text = self.stops.feed(text)
        if delta.kind == "reasoning" and not self.reasoning:
            text = text.lstrip("\n")  # as the history keeps it (`ReasoningSplitter.message_fields`)
        elif delta.kind == "answer" and self.reasoning and not self.content:
            text = text.lstrip()
        if not text:
            return
        if delta.kind == "reasoning":
            self.reasoning += text
        else:
            self.content += text
        yield Delta(delta.kind, text)

    def end(self) -> Ending:
        """Wait for the reply to leave the batch (stopping it first if it still runs), give its
        session back, and say how it ended. Raises what generation raised."""
        if self._ended is not None:
            return self._ended
        prompt_length = len(self.generation.prompt_ids)
        try:
            sequence = self.generation.finish()
        except BaseException:
            self.runs.states.give_back(self.claim, [], 0)
            raise
        self.runs.states.give_back(self.claim, sequence, prompt_length)
        generated = sequence[prompt_length:]
        eos = self.runs.engine.eos_token_ids
        ran_out = len(generated) >= self.generation.options.max_new_tokens and not (generated and generated[-1] in eos)
        prefill = self.generation.prefill
        reason = "tool_calls" if self.tool_calls else "length" if ran_out and not self.stops.hit else "stop"
        self._ended = Ending(reason, prompt_length, len(generated), prefill.reused_tokens if prefill is not None else 0,
                             self.claim.how, self.content, self.reasoning.rstrip("\n"), tuple(self.tool_calls))
        return self._ended
