"""What a user can set per reply, checked once when it is made."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

from chat.errors import InvalidOptionError, UnknownOptionError

DEFAULT_MAX_NEW_TOKENS = 256
SAMPLING_FIELDS = ("temperature", "top_p", "top_k")


@dataclass(frozen=True)
class GenerationOptions:
    """None means the model's own generation config decides."""

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    do_sample: bool | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    repetition_penalty: float | None = None
    enable_thinking: bool | None = None
    seed: int | None = None  # a sampled reply's own random generator: the same reply, batched or not

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p", "repetition_penalty"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not math.isfinite(value)):
                raise InvalidOptionError(f"{name} must be a finite number")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise InvalidOptionError("max_new_tokens must be a whole number of at least 1")
        if self.temperature is not None and self.temperature <= 0:
            raise InvalidOptionError("temperature must be > 0 (use do_sample=False for greedy)")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise InvalidOptionError("top_p must be in (0, 1]")
        if self.top_k is not None and self.top_k < 0:
            raise InvalidOptionError("top_k must be >= 0")
        if self.repetition_penalty is not None and self.repetition_penalty <= 0:
            raise InvalidOptionError("repetition_penalty must be > 0")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0):
            raise InvalidOptionError("seed must be a whole number >= 0")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "GenerationOptions":
        unknown = set(kwargs) - {field.name for field in fields(cls)}
        if unknown:
            raise UnknownOptionError(f"unknown generation options: {sorted(unknown)}")
        return cls(**kwargs)

    def generate_kwargs(self) -> dict[str, Any]:
        """The options a `GenerationConfig` takes; sampling knobs are left out of a greedy reply."""
        greedy = self.do_sample is False
        return {name: value for name, value in asdict(self).items()
                if value is not None and name not in ("enable_thinking", "seed")
                and not (greedy and name in SAMPLING_FIELDS)}
