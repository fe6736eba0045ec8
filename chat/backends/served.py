"""The same conversations with the replies made by an OpenAI-compatible server (vLLM, SGLang,
`transformers serve`) instead of the embedded engine.

Conversation semantics stay here: the branch tree, the reasoning split, stripping reasoning from
the history the way the model's own template expects (the app renders nothing the server does
not; it sends the same canonical messages every turn, so the server's prefix cache hits), stop
(closing the stream, which cancels the request on the server). There is no local cache: what a
switch or an edit reuses is up to the server's prefix cache, and the stats say what the server
reported (`usage.prompt_tokens_details.cached_tokens`), or that it did not say.

Isolation and routing: each conversation sends a random `cache_salt` (vLLM and SGLang keep salted
prefixes apart, so no one can probe another's prompts through cache timing) and a random
affinity id as the `user` field and the `X-Session-Affinity` header (a prefix-aware router keeps
the conversation on the replica that holds its prefix). Neither is the app's session key.
"""

from __future__ import annotations

import secrets
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Hashable, Iterator

import openai
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from cache_sessions.branches import BranchMove
from chat.dialogue import saved
from chat.dialogue.conversation import Conversation
from chat.errors import ChatError, ConversationError, ModelLoadError
from chat.dialogue.history import ReplyVersion
from chat.dialogue.options import GenerationOptions
from chat.dialogue.plans import Planner
from chat.dialogue.reasoning import Delta, ReasoningSplitter
from chat.backends.sources import Reply, ReplyRequest, TurnStats
from chat.dialogue.templates import ChatTemplate

AFFINITY_HEADER = "X-Session-Affinity"
MAX_WARMING = 8  # one-token requests warming the server's prefix cache in flight, for the whole app
_WARMING = threading.BoundedSemaphore(MAX_WARMING)
# A conversation's warm-ups start at most this often: the page asks at each keystroke (for the
# embedded engine, where a newer ask costs nothing but idle steps), and a request to the server a
# keystroke is a load of its own; a prefix cache keeps whole blocks, so the last second's few
# tokens are the Send's to compute either way.
WARM_EVERY_S = 1.0
PROMPT_FORMATS = ("messages", "text", "token-ids")
# What vLLM and SGLang take to render the last (assistant) message open, as the reply so far.
CONTINUE_FIELDS = {"continue_final_message": True, "add_generation_prompt": False}
CANNOT_CONTINUE = ("this model server cannot continue a reply through chat messages (it refused "
                   "continue_final_message); start the app with --prompt-format text or token-ids for that, "
                   "or use Retry")


class ServerError(ChatError):
    """The server could not be reached, refused the request, timed out or cut the stream; the
    conversation is as it was before the operation."""


@dataclass
class ServedRuntime:
    """What served replies share: the client, the served model's name, the tokenizer and template
    this app renders with, and what the server was found to refuse."""

    client: openai.OpenAI
    model_name: str
    tokenizer: PreTrainedTokenizerBase
    template: ChatTemplate
    prompt_format: str = "messages"  # "messages" (chat completions), "text" or "token-ids" (completions)
    refused_fields: set[str] = field(default_factory=set)  # extra fields the server said it does not take
    warm_while_typing: bool = True  # `ServedSource.prepare` sends one-token requests ahead of a Send
    warmed: int = 0  # such requests answered so far


class ServedSource:
    """A `ReplySource` on an OpenAI-compatible server. It keeps no states here: what a switch or
    an edit reuses is up to the server's prefix cache."""

    session = None

    def __init__(self, runtime: ServedRuntime):
        self.runtime = runtime
        self.cache_salt = secrets.token_urlsafe(16)
        self.affinity = secrets.token_hex(12)
        self._warmed_at = -WARM_EVERY_S  # when this conversation's last warm-up started (monotonic)

    def check(self, request: ReplyRequest) -> None:
        if request.kind != "continue" or self.runtime.prompt_format != "messages":
            return
        if self.runtime.refused_fields & CONTINUE_FIELDS.keys():
            raise ConversationError(CANNOT_CONTINUE)
        if not request.messages[-1]["content"]:
            # the server would close the thought before going on: only a prompt rendered here continues it
            raise ConversationError("this reply stopped while thinking; chat messages can only continue an "
                                    "answer (--prompt-format text or token-ids continues a thought); use Retry")

    def reply(self, request: ReplyRequest, stop: threading.Event) -> "ServedReply":
        return ServedReply(self, request, stop)

    def move(self, move: BranchMove) -> bool:
        return False  # no states here to keep or put back

    def prepare(self, request: ReplyRequest) -> threading.Event:
        """Warm the server's own prefix cache with the conversation as it will be with the message
        being typed: the same request the Send will make (same messages or prompt,
        `cache_salt` and affinity, so a prefix-caching server such as vLLM or SGLang keeps its
        blocks where the Send finds them), asking for one token, on a thread of its own. Setting
        the returned event closes its stream (the server cancels it). At most `MAX_WARMING`
        of them are in flight for the whole app, and one a conversation starts at most every
        `WARM_EVERY_S`; past those an ask warms nothing. A
        server without a prefix cache (`transformers serve`) computes the prompt for nothing:
        the page's switch turns this off, and `--warm-served off` for everyone."""
        stop = threading.Event()
        if not self.runtime.warm_while_typing or time.monotonic() - self._warmed_at < WARM_EVERY_S:
            return stop
        if not _WARMING.acquire(blocking=False):
            return stop
        self._warmed_at = time.monotonic()
        one_token = replace(request, options=replace(request.options, max_new_tokens=1, do_sample=False))
        threading.Thread(target=self._warm, args=(one_token, stop), name="warm-served-prefix", daemon=True).start()
        return stop

    def _warm(self, request: ReplyRequest, stop: threading.Event) -> None:
        try:
            stream = ServedReply(self, request, stop)._open()
            try:
                for _ in stream:
                    if stop.is_set():
                        break
            finally:
                stream.close()
            self.runtime.warmed += 1
        except Exception:  # a warm-up that failed costs nothing but itself: the Send says what is wrong
            pass
        finally:
            _WARMING.release()

    def close(self) -> None:
        """Nothing kept here to free."""


class ServedReply:
    def __init__(self, source: ServedSource, request: ReplyRequest, stop: threading.Event):
        self.source, self.runtime, self.request, self.stop = source, source.runtime, request, stop
        self._reply: Reply | None = None

    def result(self) -> Reply | None:
        return self._reply

    def __iter__(self) -> Iterator[Delta]:
        runtime, request = self.runtime, self.request
        started = time.perf_counter()
        stream = self._open()
        here = runtime.prompt_format != "messages"  # rendered here: a <think> the prompt opened is ours
        splitter = ReasoningSplitter(starts_in_reasoning=request.opens_reasoning and here)
        if request.kind == "continue":  # the reply so far: context for the split, not shown again
            splitter.feed(runtime.tokenizer.decode(request.earlier_ids, skip_special_tokens=False))
        progress = _Progress(started)
        stopped = failed = False
        try:
            for chunk in stream:
                pieces = progress.take(chunk, splitter, runtime.prompt_format)
                yield from pieces
                if self.stop.is_set():
                    stopped = True
                    break
            yield from splitter.finish()
        except openai.APIError as error:
            failed = True
            raise ServerError(describe(error)) from error
        except GeneratorExit:  # the reader went away: as Stop
            stopped = True
            raise
        finally:
            stream.close()  # the server cancels a request whose stream closed
            if not failed:
                content, reasoning = splitter.message_fields()
                if progress.server_reasoning:  # split by the server: cleaned as the splitter cleans its own
                    content, reasoning = content.lstrip(), (progress.server_reasoning + reasoning).strip("\n")
                version = ReplyVersion(content, reasoning, None, None, request.opens_reasoning, stopped,
                                       ended=not stopped and progress.finish_reason == "stop")
                self._reply = Reply(version, progress.stats(request, stopped))

    def _open(self) -> Any:
        """The streaming request: chat completions with the messages, or completions with the
        prompt rendered here (as text, or as token ids). Fields beyond OpenAI's (`cache_salt`,
        `top_k`, ...) are sent until the server refuses one by name (`transformers serve` takes
        none of them); then the request goes again without it, and later ones leave it out."""
        runtime, request = self.runtime, self.request
        wanted = request_options(request.options) | {"cache_salt": self.source.cache_salt}
        required: dict[str, Any] = {}  # fields without which the request means something else
        if runtime.prompt_format == "messages":
            messages = runtime.template.template_messages(request.messages)
            create, body = runtime.client.chat.completions.create, {"messages": messages}
            if request.kind == "continue":  # the last message is the reply so far, left open (vLLM, SGLang)
                required = dict(CONTINUE_FIELDS)
        else:
            wanted.pop("chat_template_kwargs", None)  # the template ran here
            prompt: Any = request.prompt_ids if runtime.prompt_format == "token-ids" else runtime.tokenizer.decode(
                request.prompt_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
            create, body = runtime.client.completions.create, {"prompt": prompt}
        affinity = self.source.affinity
        while True:
            extra = {name: value for name, value in wanted.items() if name not in runtime.refused_fields} | required
            try:
                return create(model=runtime.model_name, stream=True, stream_options={"include_usage": True},
                              user=affinity, extra_headers={AFFINITY_HEADER: affinity}, extra_body=extra,
                              **body, **sampling(request.options))
            except openai.APIStatusError as error:
                refused = {name for name in extra if error.status_code in (400, 422) and name in error.response.text}
                if not refused:
                    raise ServerError(describe(error)) from error
                runtime.refused_fields |= refused
                if refused & required.keys():
                    raise ServerError(CANNOT_CONTINUE) from error
            except openai.APIError as error:
                raise ServerError(describe(error)) from error


class _Progress:
    """What a served stream said so far: text pieces, the server's own reasoning, its usage."""

    def __init__(self, started: float):
        self.started, self.server_reasoning, self.usage = started, "", None
        self.first_at: float | None = None
        self.last_at: float | None = None
        self.chunks = 0
        self.finish_reason: str | None = None  # "stop": the model ended the reply; "length": cut off

    def take(self, chunk: Any, splitter: ReasoningSplitter, prompt_format: str) -> list[Delta]:
        if chunk.usage is not None:
            self.usage = chunk.usage
        if not chunk.choices:
            return []
        choice = chunk.choices[0]
        self.finish_reason = getattr(choice, "finish_reason", None) or self.finish_reason
        if prompt_format == "messages":
            text = choice.delta.content or ""
            thought = getattr(choice.delta, "reasoning_content", None) or ""
        else:
            text, thought = choice.text or "", ""
        self.server_reasoning += thought
        pieces = ([Delta("reasoning", thought)] if thought else []) + splitter.feed(text)
        if pieces:
            self.first_at, self.last_at = self.first_at or time.perf_counter(), time.perf_counter()
            self.chunks += 1
        return pieces

    def stats(self, request: ReplyRequest, stopped: bool) -> TurnStats:
        """What the server reported (its cached prompt tokens, if it says), else what was seen here."""
        usage = self.usage
        prompt = getattr(usage, "prompt_tokens", None) or len(request.prompt_ids)
        generated = getattr(usage, "completion_tokens", None) or self.chunks
        cached = getattr(getattr(usage, "prompt_tokens_details", None), "cached_tokens", None)
        now = time.perf_counter()
        span = (self.last_at or now) - (self.first_at or now)
        return TurnStats(
            reused_tokens=cached or 0, prefilled_tokens=prompt - (cached or 0), generated_tokens=generated,
            rebuilt=False, ttft_s=(self.first_at or now) - self.started,
            decode_tokens_per_s=(generated - 1) / span if generated > 1 and span > 0 else 0.0,
            cache_tokens=0, cache_bytes=0, prompt_tokens=prompt, stopped=stopped,
            cache_reuse_known=cached is not None)


def sampling(options: GenerationOptions) -> dict[str, Any]:
    """The OpenAI fields; temperature 0 when greedy."""
    fields: dict[str, Any] = {"max_tokens": options.max_new_tokens}
    if options.do_sample is False:
        fields["temperature"] = 0.0
    else:
        fields.update({k: v for k, v in (("temperature", options.temperature), ("top_p", options.top_p),
                                         ("seed", options.seed)) if v is not None})
    return fields


def request_options(options: GenerationOptions) -> dict[str, Any]:
    """What vLLM, SGLang and `transformers serve` take beside the OpenAI fields."""
    extra: dict[str, Any] = {}
    if options.do_sample is not False and options.top_k is not None:
        extra["top_k"] = options.top_k
    if options.repetition_penalty is not None:
        extra["repetition_penalty"] = options.repetition_penalty
    if options.enable_thinking is not None:
        extra["chat_template_kwargs"] = {"enable_thinking": options.enable_thinking}
    return extra


def describe(error: openai.APIError) -> str:
    if isinstance(error, openai.APITimeoutError):
        return "the model server did not answer in time; try again"
    if isinstance(error, openai.APIConnectionError):
        return "the model server cannot be reached; try again in a moment"
    if isinstance(error, openai.APIStatusError):
        return f"the model server refused the request ({error.status_code}): {str(error.message)[:200]}"
    return f"the model server's reply broke off: {str(error)[:200]}"


class ServedEngine:
    """An engine whose replies come from an OpenAI-compatible server: the same conversations,
    plans and branch tree, with a `ServedSource` for each. The tokenizer (for the template and
    the context check) is loaded here from `tokenizer` or the served model's name."""

    def __init__(self, base_url: str, model_name: str, *, api_key: str | None = None, tokenizer: str | None = None,
                 timeout_s: float = 60.0, max_retries: int = 2, context_limit: int | None = None,
                 prompt_format: str = "messages", warm_while_typing: bool = True):
        """`prompt_format`: "messages" sends chat completions (the server renders the template);
        "text" and "token-ids" send completions with the prompt rendered here, so nothing can
        drift between turns and Continue works (vLLM takes token ids; `transformers serve` text).
        `warm_while_typing`: `Conversation.prepare` sends the request a Send would, for one token,
        so a prefix-caching server has the prompt ready (`ServedSource.prepare`)."""
        if prompt_format not in PROMPT_FORMATS:
            raise ValueError(f"prompt_format is one of {', '.join(PROMPT_FORMATS)}, not {prompt_format!r}")
        try:
            loaded = AutoTokenizer.from_pretrained(tokenizer or model_name)
        except (OSError, ValueError) as error:
            raise ModelLoadError(f"cannot load the tokenizer of {tokenizer or model_name!r} (give --tokenizer a "
                                 f"local folder or a hub id): {str(error).splitlines()[0]}") from error
        self.tokenizer = loaded
        self.model_name = model_name
        self.base_url = base_url
        client = openai.OpenAI(base_url=base_url, api_key=api_key or "none", timeout=timeout_s,
                               max_retries=max_retries)
        template = ChatTemplate(loaded)
        self.runtime = ServedRuntime(client, model_name, loaded, template, prompt_format=prompt_format,
                                     warm_while_typing=warm_while_typing)
        self.planner = Planner(template, context_limit)

    @property
    def template(self) -> ChatTemplate:
        return self.runtime.template

    @property
    def context_limit(self) -> int | None:
        return self.planner.context_limit

    def conversation(self, system_prompt: str | None = None, client: Hashable | None = None) -> Conversation:
        """(`client` is the server's to schedule by: not sent.)"""
        return Conversation(self.planner, ServedSource(self.runtime), system_prompt=system_prompt)

    def restore(self, data: Any, client: Hashable | None = None) -> Conversation:
        return Conversation(self.planner, ServedSource(self.runtime), saved.from_dict(data))

    def branch_off(self, source: Conversation, data: Any, client: Hashable | None = None) -> Conversation:
        """As `ChatEngine.branch_off`: the server's own prefix cache holds what the branch shares."""
        return self.restore(data, client)

    def status(self) -> dict[str, Any]:
        """What an operator reads: where replies come from (the server batches and caches)."""
        return {"backend": "openai", "model": self.model_name, "planning": self.planner.planning,
                "model_server": self.base_url,
                "warm_while_typing": self.runtime.warm_while_typing, "warmed": self.runtime.warmed}
