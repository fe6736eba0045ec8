"""What a conversation needs of its engine, and nothing more: the model and where it runs, the
template, the end-of-turn ids, the shared-prefix store and the limits."""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from cache_sessions.prefixes import PrefixStore
from chat.config import EngineConfig
from chat.scheduler import DecodeScheduler
from chat.templates import ChatTemplate
from chat.worker import ModelWorker


@dataclass(frozen=True)
class Runtime:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    template: ChatTemplate
    worker: ModelWorker
    scheduler: DecodeScheduler  # on `worker`: every reply decodes there, batched with the others
    eos_token_ids: frozenset[int]
    prefix_store: PrefixStore | None
    config: EngineConfig
    context_limit: int | None  # the config's, else the model's own
