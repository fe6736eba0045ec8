"""Rendering the canonical history into prompt token ids with the tokenizer's own chat template."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

from chat.errors import ConversationError, ModelLoadError

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
TOOL_FIELDS = ("tool_calls", "tool_call_id", "name")  # an assistant's calls, a tool result's call


@dataclass(frozen=True)
class RenderedPrompt:
    text: str
    ids: list[int]
    opens_reasoning: bool  # the generation prompt leaves a <think> block open (QwQ, DeepSeek-R1)


class ChatTemplate:
    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        source = tokenizer.chat_template
        if not source:
            raise ModelLoadError("the tokenizer has no chat template: use a chat (instruct) model")
        if isinstance(source, dict):  # several named templates: use the default one
            source = source.get("default") or next(iter(source.values()))
        self.tokenizer = tokenizer
        self.source: str = source
        # Templates such as Qwen3's read `reasoning_content`; the others get reasoning stripped.
        self.reads_reasoning_content = "reasoning_content" in source
        self.accepts_system = self._accepts_system()
        # Tools are offered only where the template writes them and the calls in a form this
        # project reads back (Qwen's and Hermes' `<tool_call>{json}</tool_call>`: chat/api/tool_calls.py).
        self.calls_tools = "tools" in source and "<tool_call>" in source

    def _accepts_system(self) -> bool:
        """Some templates (Gemma's) raise on a system message; theirs goes into the first user turn."""
        probe = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
        try:
            self.tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True,
                                               chat_template=self.source)
            return True
        except TemplateError:
            return False

    def template_messages(self, messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """What the template expects: reasoning as a field where it reads one, else dropped."""
        converted = []
        system = None
        for message in messages:
            if message["role"] == "system" and not self.accepts_system:
                system = message["content"]
                continue
            item = {"role": message["role"], "content": message["content"]}
            item.update({name: message[name] for name in TOOL_FIELDS if message.get(name)})
            if message["role"] == "assistant" and self.reads_reasoning_content:
                # Always given, "" included: it tells the template the content is literal answer
                # text (Qwen3's would otherwise split a stray "</think>" out of it).
                item["reasoning_content"] = message.get("reasoning_content") or ""
            if system is not None and message["role"] == "user":
                item["content"], system = f"{system}\n\n{item['content']}", None
            converted.append(item)
        return converted

    def render_text(self, messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool,
                    enable_thinking: bool | None, tools: Sequence[dict[str, Any]] | None = None) -> str:
        extra: dict[str, Any] = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
        if tools:
            extra["tools"] = list(tools)
        try:
            return self.tokenizer.apply_chat_template(
                self.template_messages(messages),
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                chat_template=self.source,
                **extra,
            )
        except TemplateError as error:  # the template's own rule (roles must alternate, ...)
            raise ConversationError(f"the model's chat template refused this history: {error}") from error

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def encode_many(self, texts: list[str]) -> list[list[int]]:
        return [list(ids) for ids in self.tokenizer(texts, add_special_tokens=False)["input_ids"]] if texts else []

    def render_history(self, messages: Sequence[dict[str, Any]], *, about: int | None = None) -> list[int]:
        """Token ids of `messages` alone, without a generation prompt (e.g. a system turn). With
        `about`, only roughly the first `about` of them: a long history costs what the context
        holds, not what it says (the last ids of a cut rendering may differ from the whole's)."""
        text = self.render_text(messages, add_generation_prompt=False, enable_thinking=None)
        chars = 4 * (about + 16) if about is not None else len(text)
        while chars < len(text):
            ids = self.encode(text[:chars])
            if len(ids) > about + 8:
                return ids[:-4]  # the cut may have split the last few
            chars *= 2
        return self.encode(text)

    def render_continuation(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        """Token ids of `messages` with the last (an assistant reply) left open to be continued."""
        try:
            text = self.tokenizer.apply_chat_template(self.template_messages(messages), tokenize=False,
                                                      continue_final_message=True, chat_template=self.source)
        except (TemplateError, ValueError) as error:
            raise ConversationError(f"the model's chat template cannot continue this reply: {error}") from error
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def render(self, messages: Sequence[dict[str, Any]], *, enable_thinking: bool | None = None,
               tools: Sequence[dict[str, Any]] | None = None) -> RenderedPrompt:
        """The prompt for the next reply (offering `tools`, where given), and whether it leaves a
        <think> block open."""
        text = self.render_text(messages, add_generation_prompt=True, enable_thinking=enable_thinking, tools=tools)
        history = self.render_text(messages, add_generation_prompt=False, enable_thinking=enable_thinking,
                                   tools=tools)
        suffix = text[len(history):] if text.startswith(history) else ""
        return RenderedPrompt(text=text, ids=self.encode(text), opens_reasoning=_opens_reasoning(suffix))


def _opens_reasoning(text: str) -> bool:
    return text.rfind(THINK_OPEN) > text.rfind(THINK_CLOSE)
