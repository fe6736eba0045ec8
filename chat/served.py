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
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import openai
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from chat import saved
from chat.conversation import Conversation
from chat.errors import ChatError, ConversationError, ModelLoadError, StalePlanError
from chat.history import History, Node, ReplyVersion
from chat.operations import Continue, Operation
from chat.options import GenerationOptions
from chat.plans import Plan
from chat.reasoning import Delta, ReasoningSplitter
from chat.scheduler import SchedulerStats
from chat.templates import ChatTemplate
from chat.turns import TurnStats

AFFINITY_HEADER = "X-Session-Affinity"
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
    """What a served conversation needs (the fields planning reads are those of `Runtime`)."""

    client: openai.OpenAI
    model_name: str
    tokenizer: PreTrainedTokenizerBase
    template: ChatTemplate
    context_limit: int | None
    prefix_store: None = None  # the server shares prefixes itself
    prompt_format: str = "messages"  # "messages" (chat completions), "text" or "token-ids" (completions)
    refused_fields: set[str] = field(default_factory=set)  # extra fields the server said it does not take


class NoLocalCache:
    """A served conversation holds no cache here: nothing to measure, free or keep."""

    token_ids: list[int] = []

    def nbytes(self) -> int:
        return 0

    def release(self) -> None:
        pass

    def segment_count(self) -> int:
        return 0


class ServedConversation(Conversation):
    def __init__(self, runtime: ServedRuntime, system_prompt: str | None = None, history: History | None = None):
        # planning reads the same runtime fields as a local conversation's
        super().__init__(runtime, system_prompt, history, session=NoLocalCache())  # type: ignore[arg-type]
        self.cache_salt = secrets.token_urlsafe(16)
        self.affinity = secrets.token_hex(12)

    def plan(self, operation: Operation, options: GenerationOptions) -> Plan:
        runtime: ServedRuntime = self._runtime  # type: ignore[assignment]
        last = self.history.last_reply()
        if isinstance(operation, Continue) and runtime.prompt_format == "messages" and last is not None:
            if runtime.refused_fields & CONTINUE_FIELDS.keys():
                raise ConversationError(CANNOT_CONTINUE)
            if last.reply is not None and not last.reply.content:
                # the server would close the thought before going on: only a prompt rendered here continues it
                raise ConversationError("this reply stopped while thinking; chat messages can only continue an "
                                        "answer (--prompt-format text or token-ids continues a thought); use Retry")
        return super().plan(operation, options)

    def _leave(self, shown: list[Node], target: list[Node], index: int) -> bool:
        return False  # no states here to keep or put back: the server's prefix cache decides

    def run(self, plan: Plan) -> Iterator[Delta]:
        with self.exclusive():
            if plan.revision != self._revision:
                raise StalePlanError("the conversation changed after this operation was planned")
            self._stop.clear()
            yield from self._stream(plan)

    def _stream(self, plan: Plan) -> Iterator[Delta]:
        runtime: ServedRuntime = self._runtime  # type: ignore[assignment]
        started = time.perf_counter()
        stream = self._open(runtime, plan)
        splitter = ReasoningSplitter(starts_in_reasoning=plan.opens_reasoning and runtime.prompt_format != "messages")
        if plan.kind == "continue":  # the reply so far: context for the split, not shown again
            splitter.feed(runtime.tokenizer.decode(plan.earlier_ids, skip_special_tokens=False))
        server_reasoning, usage, first_at, last_at, chunks = "", None, None, None, 0
        stopped = failed = False
        try:
            for chunk in stream:
                if chunk.usage is not None:
                    usage = chunk.usage
                if not chunk.choices:
                    continue
                choice = chunk.choices[0]
                if runtime.prompt_format == "messages":
                    text = choice.delta.content or ""
                    thought = getattr(choice.delta, "reasoning_content", None) or ""
                else:
                    text, thought = choice.text or "", ""
                server_reasoning += thought
                pieces = ([Delta("reasoning", thought)] if thought else []) + splitter.feed(text)
                if pieces:
                    first_at, last_at, chunks = first_at or time.perf_counter(), time.perf_counter(), chunks + 1
                yield from pieces
                if self._stop.is_set():
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
                if server_reasoning:  # split by the server: cleaned as the splitter cleans its own
                    content, reasoning = content.lstrip(), (server_reasoning + reasoning).strip("\n")
                version = ReplyVersion(content, reasoning, None, None, plan.opens_reasoning, stopped)
                self._record_served(plan, version, usage, started, first_at, last_at, chunks)

    def _open(self, runtime: ServedRuntime, plan: Plan) -> Any:
        """The streaming request: chat completions with the messages, or completions with the
        prompt rendered here (as text, or as token ids). Fields beyond OpenAI's (`cache_salt`,
        `top_k`, ...) are sent until the server refuses one by name (`transformers serve` takes
        none of them); then the request goes again without it, and later ones leave it out."""
        wanted = request_options(plan.options) | {"cache_salt": self.cache_salt}
        required: dict[str, Any] = {}  # fields without which the request means something else
        if runtime.prompt_format == "messages":
            messages = runtime.template.template_messages([node.message() for node in plan.history])
            create, request = runtime.client.chat.completions.create, {"messages": messages}
            if plan.kind == "continue":  # the last message is the reply so far, left open (vLLM, SGLang)
                required = dict(CONTINUE_FIELDS)
        else:
            wanted.pop("chat_template_kwargs", None)  # the template ran here
            prompt: Any = plan.prompt_ids if runtime.prompt_format == "token-ids" else \
                runtime.tokenizer.decode(plan.prompt_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
            create, request = runtime.client.completions.create, {"prompt": prompt}
        while True:
            extra = {name: value for name, value in wanted.items() if name not in runtime.refused_fields} | required
            try:
                return create(model=runtime.model_name, stream=True, stream_options={"include_usage": True},
                              user=self.affinity, extra_headers={AFFINITY_HEADER: self.affinity}, extra_body=extra,
                              **request, **sampling(plan.options))
            except openai.APIStatusError as error:
                refused = {name for name in extra if error.status_code in (400, 422) and name in error.response.text}
                if not refused:
                    raise ServerError(describe(error)) from error
                runtime.refused_fields |= refused
                if refused & required.keys():
                    raise ServerError(CANNOT_CONTINUE) from error
            except openai.APIError as error:
                raise ServerError(describe(error)) from error

    def _record_served(self, plan: Plan, version: ReplyVersion, usage: Any, started: float, first_at: float | None,
                       last_at: float | None, chunks: int) -> None:
        if plan.kind == "continue":
            self.history.record_continuation(plan.history, version)
        else:
            self.history.record_reply(plan.history, version)
        prompt = getattr(usage, "prompt_tokens", None) or len(plan.prompt_ids)
        generated = getattr(usage, "completion_tokens", None) or chunks
        details = getattr(usage, "prompt_tokens_details", None)
        cached = getattr(details, "cached_tokens", None)
        now = time.perf_counter()
        span = (last_at or now) - (first_at or now)
        self.stats = TurnStats(
            reused_tokens=cached or 0, prefilled_tokens=prompt - (cached or 0), generated_tokens=generated,
            rebuilt=False, ttft_s=(first_at or now) - started,
            decode_tokens_per_s=(generated - 1) / span if generated > 1 and span > 0 else 0.0,
            cache_tokens=0, cache_bytes=0, prompt_tokens=prompt, stopped=version.stopped,
            cache_reuse_known=cached is not None)
        self._revision += 1


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


class NoLocalBatch:
    """The server batches; nothing is batched here."""

    def batch_bytes(self) -> int:
        return 0

    def stats(self) -> SchedulerStats:
        return SchedulerStats(0, 0, 0, 0, 0, 0, 0, 0, 0.0, 0.0)


class ServedEngine:
    """`ChatEngine`'s face for the app, with replies from an OpenAI-compatible server. The
    tokenizer (for the template and the context check) is loaded here from `tokenizer` or the
    served model's name."""

    def __init__(self, base_url: str, model_name: str, *, api_key: str | None = None, tokenizer: str | None = None,
                 timeout_s: float = 60.0, max_retries: int = 2, context_limit: int | None = None,
                 prompt_format: str = "messages"):
        """`prompt_format`: "messages" sends chat completions (the server renders the template);
        "text" and "token-ids" send completions with the prompt rendered here, so nothing can
        drift between turns and Continue works (vLLM takes token ids; `transformers serve` text)."""
        if prompt_format not in PROMPT_FORMATS:
            raise ValueError(f"prompt_format is one of {', '.join(PROMPT_FORMATS)}, not {prompt_format!r}")
        try:
            loaded = AutoTokenizer.from_pretrained(tokenizer or model_name)
        except (OSError, ValueError) as error:
            raise ModelLoadError(f"cannot load the tokenizer of {tokenizer or model_name!r} (give --tokenizer a "
                                 f"local folder or a hub id): {str(error).splitlines()[0]}") from error
        self.tokenizer = loaded
        self.model = None
        self.model_name = model_name
        self.base_url = base_url
        self.prefix_store = None
        self.scheduler = NoLocalBatch()
        client = openai.OpenAI(base_url=base_url, api_key=api_key or "none", timeout=timeout_s,
                               max_retries=max_retries)
        self.runtime = ServedRuntime(client, model_name, loaded, ChatTemplate(loaded), context_limit,
                                     prompt_format=prompt_format)

    @property
    def template(self) -> ChatTemplate:
        return self.runtime.template

    @property
    def context_limit(self) -> int | None:
        return self.runtime.context_limit

    def conversation(self, system_prompt: str | None = None) -> ServedConversation:
        return ServedConversation(self.runtime, system_prompt)

    def restore(self, data: Any) -> ServedConversation:
        return ServedConversation(self.runtime, history=saved.from_dict(data))

    def batch_stats(self) -> SchedulerStats:
        return self.scheduler.stats()
