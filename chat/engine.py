"""The chat engine: one loaded model and tokenizer, serving any number of conversations."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from cache_sessions.prefixes import PrefixStore
from chat import saved
from chat.config import EngineConfig
from chat.conversation import Conversation
from chat.loading import load_model_and_tokenizer
from chat.runtime import Runtime
from chat.scheduler import DecodeScheduler, SchedulerStats
from chat.templates import ChatTemplate
from chat.worker import ModelWorker


class ChatEngine:
    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, config: EngineConfig | None = None,
                 *, worker: ModelWorker | None = None, **settings: Any):
        """`config` (or its fields as keyword arguments, see chat/config.py) sets the limits.
        `worker`: the compute threads the model was built on, if any (build it there for full CPU speed)."""
        config = replace(config or EngineConfig(), **settings)
        self.config = config
        self.model = model.eval()
        self.tokenizer = tokenizer
        worker = worker or ModelWorker(config.compute_threads)
        self.runtime = Runtime(
            model=self.model,
            tokenizer=tokenizer,
            template=ChatTemplate(tokenizer),
            worker=worker,
            scheduler=DecodeScheduler(self.model, worker, max_batch_size=config.max_batch_size,
                                      prefill_chunk=config.prefill_chunk),
            eos_token_ids=frozenset(_eos_token_ids(model, tokenizer)),
            prefix_store=PrefixStore(config.shared_prefixes) if config.shared_prefixes else None,
            config=config,
            context_limit=config.context_limit or _context_limit(model),
        )

    @classmethod
    def load(cls, name_or_path: str, *, device: str | None = None, dtype: str | torch.dtype | None = None,
             config: EngineConfig | None = None, **settings: Any) -> "ChatEngine":
        """`name_or_path`: a hub id, a local folder, or "demo" (the toy model trained here, committed)."""
        config = replace(config or EngineConfig(), **settings)
        worker = ModelWorker(config.compute_threads)
        # Loaded on the compute thread: torch's CPU pool then lives on the thread that uses it.
        model, tokenizer = worker.run(load_model_and_tokenizer, name_or_path, device=device, dtype=dtype)
        return cls(model, tokenizer, config, worker=worker)

    def conversation(self, system_prompt: str | None = None) -> Conversation:
        return Conversation(self.runtime, system_prompt)

    def restore(self, data: Any) -> Conversation:
        """A conversation from `Conversation.to_dict()` output, which may come from anywhere (a
        browser, a file): checked whole first; a `ConversationError` names what is wrong."""
        conversation = Conversation(self.runtime, history=saved.from_dict(data))
        if conversation.messages:
            conversation.session.mark_rebuilt()  # its first turn computes what a cache once held
        return conversation

    # what callers read of an engine
    @property
    def template(self) -> ChatTemplate:
        return self.runtime.template

    @property
    def worker(self) -> ModelWorker:
        return self.runtime.worker

    @property
    def scheduler(self) -> DecodeScheduler:
        return self.runtime.scheduler

    def batch_stats(self) -> SchedulerStats:
        """The running batch: its size, prefills in progress, waits to join."""
        return self.runtime.scheduler.stats()

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.runtime.eos_token_ids

    @property
    def prefix_store(self) -> PrefixStore | None:
        return self.runtime.prefix_store

    @property
    def context_limit(self) -> int | None:
        return self.runtime.context_limit


def _context_limit(model: PreTrainedModel) -> int | None:
    config = model.config.get_text_config(decoder=True)
    return getattr(config, "max_position_embeddings", None)


def _eos_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> set[int]:
    ids: set[int] = set()
    for value in (model.generation_config.eos_token_id, tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(value)
    return ids
