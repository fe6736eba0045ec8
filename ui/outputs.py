"""What handlers take and give, by name: the order of Gradio's input and output lists is made
here, from these dataclasses, and nowhere else."""

from __future__ import annotations

from dataclasses import astuple, dataclass, field, fields
from typing import Any

import gradio as gr

from chat import GenerationOptions
from ui import inputs
from ui.inputs import Limits


@dataclass
class Settings:
    """The settings panel, as a handler receives it."""

    system_prompt: str = "You are a helpful assistant."
    thinking: bool = True
    max_new_tokens: int = GenerationOptions.max_new_tokens
    temperature: float = 0.7
    top_p: float = 0.95
    top_k: int = 50
    repetition_penalty: float = 1.0

    @classmethod
    def names(cls) -> list[str]:
        return [setting.name for setting in fields(cls)]

    @classmethod
    def from_values(cls, values: tuple, limits: Limits = Limits()) -> "Settings":
        """Checked one by one: a bad value is refused with its name (see ui/inputs.py)."""
        if len(values) != len(fields(cls)):
            raise inputs.refuse("settings", f"expected {len(fields(cls))} values ({', '.join(cls.names())}), "
                                f"got {len(values)}")
        raw = dict(zip(cls.names(), values))
        settings = cls(
            system_prompt=inputs.text(raw["system_prompt"], "system_prompt", limits.max_system_chars),
            thinking=inputs.flag(raw["thinking"], "thinking"),
            max_new_tokens=inputs.whole_number(raw["max_new_tokens"], "max_new_tokens", 1, limits.max_new_tokens),
            temperature=inputs.number(raw["temperature"], "temperature", 0, 2),
            top_p=inputs.number(raw["top_p"], "top_p", 0, 1),
            top_k=inputs.whole_number(raw["top_k"], "top_k", 0, 10_000),
            repetition_penalty=inputs.number(raw["repetition_penalty"], "repetition_penalty", 0, 10))
        if settings.top_p <= 0 or settings.repetition_penalty <= 0:
            raise inputs.refuse("top_p" if settings.top_p <= 0 else "repetition_penalty", "must be above 0")
        return settings

    def values(self) -> list[Any]:
        return list(astuple(self))

    def options(self) -> GenerationOptions:
        """Temperature 0 means greedy; the sampling knobs then do not apply."""
        greedy = self.temperature <= 0
        sampling = {} if greedy else dict(temperature=float(self.temperature), top_p=float(self.top_p),
                                          top_k=int(self.top_k))
        return GenerationOptions(max_new_tokens=int(self.max_new_tokens), do_sample=not greedy,
                                 enable_thinking=bool(self.thinking),
                                 repetition_penalty=float(self.repetition_penalty), **sampling)


@dataclass
class ChatOutputs:
    """Every handler's result. A field left as `gr.skip()` leaves that component as it is."""

    chat: Any = field(default_factory=gr.skip)
    textbox: Any = field(default_factory=gr.skip)
    key: Any = field(default_factory=gr.skip)
    stats: Any = field(default_factory=gr.skip)
    versions: Any = field(default_factory=gr.skip)  # "version 2 / 3" of the last reply (for API clients)
    send: Any = field(default_factory=gr.skip)  # one of Send and Stop shows: Stop while a reply streams
    stop: Any = field(default_factory=gr.skip)
    system_prompt: Any = field(default_factory=gr.skip)  # set when the shown branch's system prompt changes
    # the system prompt the shown conversation runs with ({"prompt": text}; None: no conversation
    # yet): the page says when the box holds another, not applied until the next message
    applied_prompt: Any = field(default_factory=gr.skip)

    @classmethod
    def names(cls) -> list[str]:
        return [output.name for output in fields(cls)]

    def to_gradio(self) -> tuple:
        return tuple(getattr(self, name) for name in self.names())
