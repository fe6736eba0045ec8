"""The chat engine: one loaded model and tokenizer, serving any number of conversations."""

from __future__ import annotations

import weakref
from dataclasses import asdict, replace
from typing import Any, Hashable

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from cache_sessions.cold import ColdStore
from chat.model_step.compiled import CompiledDecode
from cache_sessions.owner import CacheOwner
from cache_sessions.prefixes import PrefixStore
from chat.dialogue import saved
from chat.config import EngineConfig
from chat.dialogue.conversation import Conversation
from chat.loading import load_model_and_tokenizer
from chat.backends.local import LocalSource
from chat.dialogue.plans import Planner
from chat.backends.remote import RemoteSource
from chat.runtime import Runtime
from chat.scheduling.scheduler import DecodeScheduler
from chat.scheduling.step_plan import SchedulerStats
from chat.backends.sources import ReplySource
from chat.dialogue.templates import ChatTemplate
from chat.model_step.weights import Int8Linear, apply_weight_format, choose_weight_format, prompt_kernel_choice
from chat.scheduling.worker import ModelWorker


class ChatEngine:
    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, config: EngineConfig | None = None,
                 *, worker: ModelWorker | None = None, **settings: Any):
        """`config` (or its fields as keyword arguments, see chat/config.py) sets the limits.
        `worker`: the compute thread the model was built on, if any (build it there for full CPU speed)."""
        config = replace(config or EngineConfig(), **settings)
        self.config = config
        worker = worker or ModelWorker()
        # Timed and converted on the compute thread, as every torch operation of the engine:
        # on the caller's thread they slowed every later step (chat/scheduling/worker.py says why).
        # "auto": full or packed, as this host multiplies faster (timed once on the model's own
        # layer: `apply_weight_format` reads the same choice)
        self.weight_choice = worker.run(choose_weight_format, model) if config.weights == "auto" else None
        self.weights = str(self.weight_choice["chosen"]) if self.weight_choice else config.weights
        self.model = worker.run(apply_weight_format, model, config.weights).eval()
        config.kv_cache_kind.check_applies(model)
        # Steps run eager at once; the compiled one takes over when its thread has built it.
        self.compiled = CompiledDecode(self.model, config.compile if config.kv_cache == "dynamic" else "off",
                                       max_rows=config.max_batch_size)
        self.compiled.start()
        self.tokenizer = tokenizer
        template = ChatTemplate(tokenizer)
        prefix_store = PrefixStore(config.shared_prefixes) if config.shared_prefixes else None
        cold_store = ColdStore(config.cache_dir, config.cache_dir_bytes) if config.cache_dir else None
        if cold_store is not None:
            weakref.finalize(self, cold_store.close)  # its files go with the engine, or at exit
        scheduler = DecodeScheduler(self.model, worker, max_batch_size=config.max_batch_size,
                                    prefill_chunk=config.prefill_chunk,
                                    prefill_chunk_alone=config.prefill_chunk_alone,
                                    prefill_order=config.prefill_order, compiled=self.compiled,
                                    step_gap_factor=config.step_gap_factor, alone_step_s=config.alone_step_s,
                                    draft=config.draft,
                                    budget_bytes=config.cache_budget_bytes,
                                    max_checkpoints=config.max_checkpoints, prefix_store=prefix_store,
                                    offload=config.offload_sessions, cold_store=cold_store,
                                    kv_cache=config.kv_cache_kind)
        self.runtime = Runtime(model=self.model, tokenizer=tokenizer, template=template, scheduler=scheduler,
                               eos_token_ids=frozenset(_eos_token_ids(model, tokenizer)), prefix_store=prefix_store,
                               config=config)
        self.planner = Planner(template, config.context_limit or _context_limit(model))
        self.name = getattr(model.config, "_name_or_path", "") or type(model).__name__  # for /status
        self._remote_runner: Any = None

    @classmethod
    def load(cls, name_or_path: str, *, device: str | None = None, dtype: str | torch.dtype | None = None,
             config: EngineConfig | None = None, **settings: Any) -> "ChatEngine":
        """`name_or_path`: a hub id, a local folder, or "demo" (the toy model trained here, committed)."""
        config = replace(config or EngineConfig(), **settings)
        worker = ModelWorker()
        # Loaded on the compute thread: torch's CPU pool then lives on the thread that uses it.
        model, tokenizer = worker.run(load_model_and_tokenizer, name_or_path, device=device, dtype=dtype)
        engine = cls(model, tokenizer, config, worker=worker)
        engine.name = name_or_path
        return engine

    def run_replies_in(self, runner: Any) -> None:
        """On ZeroGPU: replies of conversations made from now on run through `runner`
        (`spaces.GPU(chat.backends.remote.run_in_worker)`), in its worker process (chat/backends/remote.py)."""
        self._remote_runner = runner

    def conversation(self, system_prompt: str | None = None, client: Hashable | None = None) -> Conversation:
        """A new conversation. `client`: who holds it (an address, a person: a key the caller
        chose), so one client's replies share one client's part of the prompt budget."""
        return Conversation(self.planner, self._source(client=client), system_prompt=system_prompt)

    def restore(self, data: Any, client: Hashable | None = None) -> Conversation:
        """A conversation from `Conversation.to_dict()` output, which may come from anywhere (a
        browser, a file): checked whole first; a `ConversationError` names what is wrong."""
        history = saved.from_dict(data)
        return Conversation(self.planner, self._source(rebuilt=bool(history.entries), client=client), history)

    def branch_off(self, source: Conversation, data: Any, client: Hashable | None = None) -> Conversation:
        """A new conversation of `data` (saved data, checked: a path of `source`, "Branch off into
        a new chat") whose cache starts from a copy of `source`'s, so its first turn computes only
        what it does not share. While `source` runs a reply nothing is copied (its states are
        changing): the first turn computes everything, as a restore's does."""
        history = saved.from_dict(data)
        conversation = Conversation(self.planner, self._source(client=client), history)
        copied = not source.is_busy and source.session is not None and conversation.session is not None \
            and self.runtime.scheduler.call(self.runtime.caches.start_from, conversation.session, source.session)
        if not copied and history.entries and conversation.session is not None:
            conversation.session.mark_rebuilt()
        return conversation

    def _source(self, rebuilt: bool = False, client: Hashable | None = None) -> ReplySource:
        local = LocalSource(self.runtime, rebuilt=rebuilt, client=client)
        return local if self._remote_runner is None else RemoteSource(local, self._remote_runner)

    def status(self) -> dict[str, Any]:
        """What an operator reads of the engine (aggregates only): the batch, the caches, planning."""
        batch, caches = self.batch_stats(), self.caches.stats()
        cold = {"cold_tier": asdict(caches.cold)} if caches.cold is not None else {}
        return {"backend": "local", "model": self.name, **cold,
                "planning": self.planner.planning,
                "generating": batch.waiting + batch.prefilling + batch.decoding + batch.paused,
                "batch": {"decoding": batch.decoding, "prefilling": batch.prefilling, "waiting": batch.waiting,
                          "paused": batch.paused, "preparing": batch.preparing, "prepared": batch.prepared,
                          "first_tokens_kept": batch.first_tokens_kept,
                          "newcomers_apart": batch.newcomers_apart,
                          "max_batch_size": batch.max_batch_size, "largest_batch": batch.largest_batch,
                          "decode_steps": batch.steps,
                          "join_wait_mean_s": round(batch.join_wait_mean_s, 4),
                          "join_wait_max_s": round(batch.join_wait_max_s, 4), "packed": batch.packed,
                          "prompt_tokens_per_step": batch.prompt_tokens_per_step},
                "model_step": self.runtime.scheduler.runner.stats(),
                "compiled_step": self.compiled.stats(),
                "weights": self._weights_status(),
                "guessing": {"mode": self.config.draft, "off_because": self.runtime.scheduler.runner.guess_refusal(),
                             "guessed": batch.guessed, "taken": batch.guesses_taken},
                "cache_bytes": caches.cache_bytes, "cache_budget_bytes": caches.budget_bytes,
                "shared_prefix_bytes": caches.shared_prefix_bytes, "busy_caches": caches.busy,
                "evictions": caches.evictions, "branch_segments_freed": caches.segments_freed}

    def _weights_status(self) -> dict[str, Any]:
        """How the weights are held, and for int8 which prompt product runs (chat/model_step/weights.py)."""
        kernel = next((module.prompt_kernel for module in self.model.modules() if isinstance(module, Int8Linear)), None)
        return {"format": self.weights, "asked": self.config.weights, "auto_timed": self.weight_choice,
                "int8_prompt_kernel": kernel,
                "int8_prompt_kernels_timed": prompt_kernel_choice() if kernel else None}

    # what callers read of an engine
    @property
    def template(self) -> ChatTemplate:
        return self.runtime.template

    @property
    def worker(self) -> ModelWorker:
        return self.runtime.scheduler.worker

    @property
    def scheduler(self) -> DecodeScheduler:
        return self.runtime.scheduler

    @property
    def caches(self) -> CacheOwner:
        return self.runtime.caches

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
        return self.planner.context_limit


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
