"""What a reply from the embedded engine needs, and nothing more: the model and the loop that
serves it, the cache owner, the template, the end-of-turn ids, the shared-prefix store and the
settings."""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from cache_sessions.owner import CacheOwner
from cache_sessions.prefixes import PrefixStore
from chat.config import EngineConfig
from chat.scheduling.scheduler import DecodeScheduler
from chat.dialogue.templates import ChatTemplate


@dataclass(frozen=True)
class Runtime:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    template: ChatTemplate
    scheduler: DecodeScheduler  # the loop: every reply decodes there, batched with the others
    eos_token_ids: frozenset[int]
    prefix_store: PrefixStore | None
    config: EngineConfig

    @property
    def caches(self) -> CacheOwner:
        """The one owner of every cache session's states (it applies what the loop decides)."""
        return self.scheduler.caches
