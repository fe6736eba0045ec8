"""The chat engine: one loaded model and tokenizer, serving any number of conversations."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from cache_sessions.prefixes import PrefixStore
from cache_sessions.session import DEFAULT_MAX_CHECKPOINTS
from chat.conversation import Conversation
from chat.loading import load_model_and_tokenizer
from chat.templates import ChatTemplate
from chat.worker import ModelWorker


class ChatEngine:
    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, *,
                 max_checkpoints: int = DEFAULT_MAX_CHECKPOINTS, context_limit: int | None = None,
                 shared_prefixes: int = 8, offload_sessions: bool = False, compute_threads: int = 1,
                 worker: ModelWorker | None = None):
        """`shared_prefixes`: how many distinct system-prompt prefixes to keep prefilled for new
        conversations (0: none). `offload_sessions`: keep caches on the CPU between operations
        (ZeroGPU, where GPU memory does not survive between calls). `compute_threads`: generations
        that can run at once; more than one only pays off on a GPU (see chat/worker.py). `worker`:
        the compute threads the model was built on, if any (build it there for full CPU speed)."""
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.template = ChatTemplate(tokenizer)
        self.max_checkpoints = max_checkpoints
        self.context_limit = context_limit or _context_limit(model)
        self.eos_token_ids = _eos_token_ids(model, tokenizer)
        self.prefix_store = PrefixStore(shared_prefixes) if shared_prefixes else None
        self.offload_sessions = offload_sessions
        self.worker = worker or ModelWorker(compute_threads)

    @classmethod
    def load(cls, name_or_path: str, *, device: str | None = None, dtype: str | torch.dtype | None = None,
             **engine_options: object) -> "ChatEngine":
        """`name_or_path`: a hub id, a local folder, or "demo" (tiny random model built offline)."""
        worker = ModelWorker(int(engine_options.pop("compute_threads", 1)))
        # Loaded on the compute thread: torch's CPU pool then lives on the thread that uses it.
        model, tokenizer = worker.run(load_model_and_tokenizer, name_or_path, device=device, dtype=dtype)
        return cls(model, tokenizer, worker=worker, **engine_options)

    def conversation(self, system_prompt: str | None = None) -> Conversation:
        return Conversation(self, system_prompt)


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
