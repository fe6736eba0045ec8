"""What handlers take and give, by name: the order of Gradio's input and output lists is made
here, from these dataclasses, and nowhere else."""

from __future__ import annotations

from dataclasses import astuple, dataclass, field, fields
from typing import Any

import gradio as gr

from chat import GenerationOptions


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
    def from_values(cls, values: tuple) -> "Settings":
        if len(values) != len(fields(cls)):
            raise TypeError(f"expected {len(fields(cls))} settings, got {len(values)}")
        return cls(*values)

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
    versions: Any = field(default_factory=gr.skip)
    previous_version: Any = field(default_factory=gr.skip)
    next_version: Any = field(default_factory=gr.skip)

    @classmethod
    def names(cls) -> list[str]:
        return [output.name for output in fields(cls)]

    def to_gradio(self) -> tuple:
        return tuple(getattr(self, name) for name in self.names())
