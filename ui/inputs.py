"""What a client may send, checked before anything runs. The browser never sends bad values, but
the API takes anything: every refusal is a `gr.Error` that names the field, and changes nothing."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import gradio as gr

from chat.errors import ContextOverflowError


@dataclass(frozen=True)
class Limits:
    """The sizes a request may have (flags of the app)."""

    max_new_tokens: int = 512
    max_message_chars: int = 20_000
    max_system_chars: int = 4_000


def text_only(field: str, **options: Any) -> gr.Textbox:
    """A Textbox (Gradio's `options`) whose value from a client must be text, else refused naming
    `field`: Gradio's own passes anything on as its `str` (an object sent for a message became the
    message "{'text': ...}"). (Its check is set on the instance: a subclass of a component makes
    Gradio write a stub file beside this module.)"""
    box = gr.Textbox(**options)
    as_text = box.preprocess

    def preprocess(payload: Any) -> str | None:
        if payload is not None and not isinstance(payload, str):
            raise refuse(field, f"must be text, not {type(payload).__name__}")
        return as_text(payload)

    box.preprocess = preprocess  # type: ignore[method-assign]
    return box


def refuse(field: str, problem: str) -> gr.Error:
    return refused(f"{field}: {problem}")


def refused(reason: Any) -> gr.Error:
    """A refusal, raised by a handler before it changes anything: an API client gets an error it
    can catch, the page one toast with every component left as it was (the page's style hides
    Gradio's per-output error badges), and the log no traceback (it is routine, not a fault)."""
    text = too_long(reason) if isinstance(reason, ContextOverflowError) else str(reason)
    return gr.Error(text, title="Not accepted", print_exception=False)


def too_long(error: ContextOverflowError) -> str:
    """A prompt over the model's context, in a user's words: by how much, and what to do.
    (Older turns are dropped by themselves when the newest message alone fits.)"""
    over = error.prompt_tokens + error.max_new_tokens - error.context_limit
    return (f"That is too long for this model by about {over:,} tokens (roughly {4 * over:,} characters): it "
            f"holds {error.context_limit:,} tokens, {error.max_new_tokens:,} of them kept for the reply. "
            "Shorten the message (or the system prompt), lower “Max new tokens” in Settings, or start a new chat.")


def text(value: Any, field: str, max_chars: int) -> str:
    if not isinstance(value, str):
        raise refuse(field, f"must be text, not {type(value).__name__}")
    if len(value) > max_chars:
        raise refuse(field, f"{len(value):,} characters is more than the {max_chars:,} allowed")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise refuse(field, "contains characters that are not valid Unicode (lone surrogates)") from None
    return value


def flag(value: Any, field: str) -> bool:
    if not isinstance(value, bool):
        raise refuse(field, f"must be true or false, not {value!r}"[:200])
    return value


def number(value: Any, field: str, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise refuse(field, f"must be a number, not {value!r}"[:200])
    if not low <= value <= high:
        raise refuse(field, f"must be between {low:g} and {high:g}, not {value:g}")
    return float(value)


def whole_number(value: Any, field: str, low: int, high: int) -> int:
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise refuse(field, f"must be a whole number, not {value!r}"[:200])
    if not low <= value <= high:
        raise refuse(field, f"must be between {low} and {high}, not {value}")
    return value


def branch_target(value: Any) -> tuple[int, int]:
    """ "message index:branch" from a branch switcher (the page's own script sends it)."""
    match = re.fullmatch(r"(\d{1,6}):(\d{1,3})", value) if isinstance(value, str) else None
    if match is None:
        raise refuse("branch", "must be 'message:branch', two whole numbers")
    return int(match[1]), int(match[2])


def message_index(value: Any) -> int:
    """A message index as the page's own script sends it (text: ↻ above a reply)."""
    match = re.fullmatch(r"\d{1,6}", value) if isinstance(value, str) else None
    if match is None:
        raise refuse("index", "must be a whole number")
    return int(value)


class StrictBlocks(gr.Blocks):
    """Blocks whose every refusal is one line in the log and an error that says why.

    - A call with more input values than its event takes is refused (Gradio checks for too few
      only, and drops the rest): an API client with a wrong idea of the inputs is told so instead
      of having part of its call ignored.
    - What Gradio itself finds wrong before a handler runs (too few values, a value its component
      cannot read, a slider's value out of range, an event that runs in the page only) is a
      refusal like the handlers' own: before, each one logged a traceback (a fuzzing client
      filled the log with them) as if the server had failed.
    - Every refusal is logged as one line: the event and the reason.
    """

    def validate_inputs(self, block_fn: Any, inputs: list[Any]) -> None:
        try:
            super().validate_inputs(block_fn, inputs)
        except ValueError as error:
            raise refused(error) from None
        if len(inputs) > len(block_fn.inputs):
            name = f"{block_fn.api_name} " if isinstance(block_fn.api_name, str) else ""
            raise refused(f"{name}takes {len(block_fn.inputs)} input values, not {len(inputs)}")

    async def preprocess_data(self, block_fn: Any, inputs: list[Any], state: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().preprocess_data(block_fn, inputs, state, *args, **kwargs)
        except gr.Error as error:
            if error.print_exception:
                raise refused(error.message) from None
            raise
        except Exception as error:  # a value its component cannot read (Gradio says which input)
            raise refused(" ".join(str(error).split())[:400]) from None

    def _function(self, block_fn: Any) -> Any:
        """Gradio passes an event either as its index or as itself."""
        return self.fns[block_fn] if isinstance(block_fn, int) else block_fn

    async def call_function(self, block_fn: Any, *args: Any, **kwargs: Any) -> Any:
        if not self._function(block_fn).fn:
            raise refused("this event runs in the page, not on the server")
        return await super().call_function(block_fn, *args, **kwargs)

    async def process_api(self, block_fn: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        try:
            return await super().process_api(block_fn, *args, **kwargs)
        except gr.Error as error:
            if not error.print_exception:
                function = self._function(block_fn)
                name = function.name or function.api_name
                print(f"rewind-chat: refused {name}: {' '.join(str(error.message).split())[:300]}", flush=True)
            raise
