"""The OpenAI API's requests as plain data, checked whole before any work, and its error shape.

What a request asks that this server cannot honour (several choices, log probabilities, a forced
tool call, images, penalties other than `repetition_penalty`) is refused with a 400 naming the field, never
ignored; fields this server does not know (`user`, `metadata`, `store`, other servers' extensions)
change nothing and are accepted, as vLLM's server accepts them. `max_tokens` above the server's largest reply is lowered to it (the reply then ends
with `finish_reason` "length"), as llama.cpp's server does with its own limit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from chat.dialogue.templates import THINK_CLOSE, THINK_OPEN
from chat.errors import InvalidOptionError
from chat.dialogue.options import GenerationOptions

MAX_STOPS = 4  # as OpenAI's
MAX_STOP_CHARS = 200
ROLES = ("system", "developer", "user", "assistant", "tool")
class ApiError(Exception):
    """A refused request, in the API's own shape (`body`), with its HTTP status."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code

    @property
    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def invalid(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param, code)


@dataclass(frozen=True)
class Sampling:
    """What every request sets for its reply."""

    options: GenerationOptions
    stops: tuple[str, ...]
    stream: bool
    include_usage: bool


@dataclass(frozen=True)
class ChatCall:
    """`POST /v1/chat/completions`: the conversation, as the chat template takes it, and the
    tools the model is offered (none: none offered, `tool_choice` "none" included)."""

    messages: list[dict[str, Any]]
    sampling: Sampling
    tools: list[dict[str, Any]] | None = None


@dataclass(frozen=True)
class TextCall:
    """`POST /v1/completions`: a prompt as text, or as token ids (fed as given)."""

    text: str | None
    token_ids: list[int] | None
    sampling: Sampling


Call = ChatCall | TextCall
Endpoint = Literal["chat", "text"]


def parse(body: Any, endpoint: Endpoint, model_name: str, max_new_tokens: int, vocab_size: int) -> Call:
    """The request, checked; an `ApiError` says what is wrong with it."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != model_name:
        raise ApiError(404, f"the model {str(model)[:100]!r} does not exist here; this server serves {model_name!r}",
                       "invalid_request_error", "model", "model_not_found")
    sampling = _sampling(body, max_new_tokens, default_tokens=max_new_tokens if endpoint == "chat" else 16)
    _refuse_unsupported(body)
    if endpoint == "chat":
        return ChatCall(_messages(body.get("messages")), sampling, _tools(body.get("tools"), body.get("tool_choice")))
    if body.get("tools"):
        raise invalid("tools are for chat completions", "tools")
    if body.get("echo"):
        raise invalid("echo is not supported", "echo")
    if body.get("suffix"):
        raise invalid("suffix is not supported", "suffix")
    text, token_ids = _prompt(body.get("prompt"), vocab_size)
    return TextCall(text, token_ids, sampling)


def _refuse_unsupported(body: dict[str, Any]) -> None:
    if body.get("n", 1) != 1:
        raise invalid("only n = 1 is supported", "n")
    if body.get("logprobs") not in (None, False, 0):
        raise invalid("log probabilities are not supported", "logprobs")
    if body.get("functions") or body.get("function_call"):
        raise invalid("functions are not supported: use tools", "functions")
    response_format = body.get("response_format")
    if response_format is not None and (not isinstance(response_format, dict) or response_format.get("type") != "text"):
        raise invalid("only a text response_format is supported", "response_format")
    for name in ("frequency_penalty", "presence_penalty"):
        value = body.get(name)
        if value is not None and value != 0:
            raise invalid(f"{name} is not supported (use repetition_penalty)", name)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise invalid("stream_options must be an object", "stream_options")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and (not isinstance(kwargs, dict) or set(kwargs) - {"enable_thinking"}):
        raise invalid("chat_template_kwargs takes enable_thinking only", "chat_template_kwargs")


def _number(body: dict[str, Any], name: str, low: float, high: float) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise invalid(f"{name} must be a number from {low} to {high}", name)
    return float(value)


def _whole(body: dict[str, Any], name: str, low: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise invalid(f"{name} must be a whole number of at least {low}", name)
    return value


def _sampling(body: dict[str, Any], max_new_tokens: int, default_tokens: int) -> Sampling:
    asked = _whole(body, "max_completion_tokens", 1)
    asked = asked if asked is not None else _whole(body, "max_tokens", 1)
    temperature = _number(body, "temperature", 0.0, 2.0)
    top_p = _number(body, "top_p", 0.0, 1.0)
    if top_p == 0:
        raise invalid("top_p must be above 0", "top_p")
    seed = _whole(body, "seed", 0)
    top_k = _whole(body, "top_k", -1)
    repetition = _number(body, "repetition_penalty", 0.01, 10.0)
    thinking = body.get("enable_thinking", (body.get("chat_template_kwargs") or {}).get("enable_thinking"))
    if thinking is not None and not isinstance(thinking, bool):
        raise invalid("enable_thinking must be true or false", "enable_thinking")
    greedy = temperature == 0
    try:
        options = GenerationOptions(
            max_new_tokens=min(asked if asked is not None else default_tokens, max_new_tokens),
            do_sample=False if greedy else (True if temperature is not None else None),
            temperature=None if greedy else temperature, top_p=top_p,
            top_k=None if top_k is None or top_k < 1 else top_k, repetition_penalty=repetition,
            enable_thinking=thinking, seed=seed)
    except InvalidOptionError as error:
        raise invalid(str(error)) from error
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise invalid("stream must be true or false", "stream")
    usage = (body.get("stream_options") or {}).get("include_usage", False)
    if not isinstance(usage, bool):
        raise invalid("stream_options.include_usage must be true or false", "stream_options")
    return Sampling(options, _stops(body.get("stop")), stream, usage)


def _stops(value: Any) -> tuple[str, ...]:
    stops = [value] if isinstance(value, str) else value if isinstance(value, list) else [] if value is None else None
    if stops is None or len(stops) > MAX_STOPS or \
            not all(isinstance(stop, str) and 0 < len(stop) <= MAX_STOP_CHARS for stop in stops):
        raise invalid(f"stop must be a string or a list of at most {MAX_STOPS} non-empty strings of at most "
                      f"{MAX_STOP_CHARS} characters", "stop")
    return tuple(stops)


def _messages(value: Any) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise invalid("messages must be a non-empty list", "messages")
    messages = []
    for index, message in enumerate(value):
        param = f"messages[{index}]"
        if not isinstance(message, dict):
            raise invalid("each message must be an object", param)
        role = message.get("role")
        if role not in ROLES:
            raise invalid(f"role must be one of {', '.join(ROLES)}", f"{param}.role")
        content = _text(message.get("content"), f"{param}.content", may_be_empty=role == "assistant")
        item: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": content}
        if role == "assistant" and message.get("tool_calls"):
            item["tool_calls"] = _calls(message["tool_calls"], f"{param}.tool_calls")
        if role == "tool" and message.get("tool_call_id") is not None:
            if not isinstance(message["tool_call_id"], str):
                raise invalid("tool_call_id must be a string", f"{param}.tool_call_id")
            item["tool_call_id"] = message["tool_call_id"]
        reasoning = message.get("reasoning_content", message.get("reasoning"))
        if role == "assistant":
            if reasoning is not None and not isinstance(reasoning, str):
                raise invalid("reasoning_content must be a string", f"{param}.reasoning_content")
            item["content"], found = split_reasoning(content)
            item["reasoning_content"] = reasoning or found
        messages.append(item)
    if messages[-1]["role"] == "assistant":
        raise invalid("the last message must not be the assistant's (continuing a reply is not supported)",
                      f"messages[{len(messages) - 1}].role")
    return messages


def _tools(value: Any, choice: Any) -> list[dict[str, Any]] | None:
    """The functions offered, as the template takes them; "none" offers none."""
    if choice not in (None, "auto", "none"):
        raise invalid('tool_choice must be "auto" or "none" (a call cannot be forced here)', "tool_choice")
    if value is None or value == [] or choice == "none":
        return None
    if not isinstance(value, list):
        raise invalid("tools must be a list", "tools")
    for index, tool in enumerate(value):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict) \
                or not isinstance(function.get("name"), str) or not function["name"]:
            raise invalid("each tool must be {\"type\": \"function\", \"function\": {\"name\": ...}}",
                          f"tools[{index}]")
    return value


def _calls(value: Any, param: str) -> list[dict[str, Any]]:
    """An assistant message's earlier calls, as the template renders them."""
    if not isinstance(value, list):
        raise invalid("tool_calls must be a list", param)
    calls = []
    for call in value:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) \
                or not isinstance(function.get("arguments", ""), (str, dict)):
            raise invalid("each tool call needs a function with a name and arguments", param)
        calls.append({"id": call.get("id"), "type": "function",
                      "function": {"name": function["name"], "arguments": function.get("arguments", "{}")}})
    return calls


def _text(value: Any, param: str, may_be_empty: bool) -> str:
    """A message's text: a string or a list of text parts."""
    if value is None and may_be_empty:
        return ""
    if isinstance(value, list):
        parts = []
        for part in value:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise invalid("only text content parts are supported", param)
            parts.append(part["text"])
        return "".join(parts)
    if not isinstance(value, str):
        raise invalid("content must be a string or a list of text parts", param)
    return value


def split_reasoning(content: str) -> tuple[str, str]:
    """An assistant message whose content carries its `<think>` block (clients that show the
    reasoning inline send it back so): (the answer, the reasoning)."""
    stripped = content.lstrip()
    if stripped.startswith(THINK_OPEN) and THINK_CLOSE in stripped:
        reasoning, answer = stripped[len(THINK_OPEN):].split(THINK_CLOSE, 1)
        return answer.lstrip(), reasoning.strip("\n")
    return content, ""


def _prompt(value: Any, vocab_size: int) -> tuple[str | None, list[int] | None]:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]  # a batch of one
    if isinstance(value, str):
        if not value:
            raise invalid("prompt must not be empty", "prompt")
        return value, None
    if isinstance(value, list) and value and all(isinstance(token, int) and not isinstance(token, bool)
                                                 for token in value):
        if not all(0 <= token < vocab_size for token in value):
            raise invalid(f"token ids must be from 0 to {vocab_size - 1}", "prompt")
        return None, list(value)
    raise invalid("prompt must be a non-empty string or list of token ids (one prompt a request)", "prompt")
