"""Streaming generation on a prepared cache: `model.generate` in a worker thread, tokens out.

`generate` does the sampling, the logits processors and the decode loop; this file only feeds
it the cache, listens to its streamer, stops it on request and reports timings.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Iterator, Sequence

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase, StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from chat.options import GenerationOptions
from chat.worker import ModelWorker

class IncrementalDecoder:
    """Token ids in, text deltas out; holds back bytes of a character that is not complete yet."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, skip_ids: set[int], context_ids: Sequence[int] = ()):
        self.tokenizer = tokenizer
        self.skip_ids = skip_ids
        self.ids: list[int] = list(context_ids)  # tokens already shown (a reply being continued)
        self.context_text = self._decode(self.ids)
        self._prefix_offset = max(0, len(self.ids) - 6)  # a few tokens of context for merges
        self._read_offset = len(self.ids)

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode([i for i in ids if i not in self.skip_ids], skip_special_tokens=False)

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        before = self._decode(self.ids[self._prefix_offset : self._read_offset])
        after = self._decode(self.ids[self._prefix_offset :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
            return after[len(before) :]
        return ""

    def flush(self) -> str:
        before = self._decode(self.ids[self._prefix_offset : self._read_offset])
        after = self._decode(self.ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self.ids)
        return after[len(before) :]


class _TokenQueue(BaseStreamer):
    """`generate`'s streamer: the first `put` is the prompt, each later one a new token."""

    END = object()

    def __init__(self) -> None:
        self.queue: queue.Queue = queue.Queue()
        self._seen_prompt = False

    def put(self, value: torch.Tensor) -> None:
        if not self._seen_prompt:
            self._seen_prompt = True
            return
        for token_id in value.reshape(-1).tolist():
            self.queue.put(token_id)

    def end(self) -> None:
        self.queue.put(self.END)


class _StopWhenSet(StoppingCriteria):
    def __init__(self, event: threading.Event):
        self.event = event

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs: Any) -> torch.BoolTensor:
        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool, device=input_ids.device)


class GenerationRun:
    """One `generate` call on the model's compute thread. Iterate `tokens()`, then `finish()`."""

    def __init__(self, model: PreTrainedModel, cache: Any, prompt_ids: Sequence[int], options: GenerationOptions,
                 stop_event: threading.Event, worker: ModelWorker):
        if worker.on_compute_thread():  # it would wait for tokens from a job queued behind itself
            raise RuntimeError("stream a reply from outside the engine's compute thread")
        self.stop_event = stop_event
        self.sequence: list[int] | None = None
        self.error: BaseException | None = None
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.token_count = 0
        self.ended = False  # the streamer said the end: `generate` returned or raised
        self._streamer = _TokenQueue()
        input_ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=model.device)
        self._kwargs = dict(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            past_key_values=cache,
            streamer=self._streamer,
            stopping_criteria=StoppingCriteriaList([_StopWhenSet(stop_event)]),
            **options.generate_kwargs(),
        )
        self._model = model
        self._done = worker.submit(self._work)

    def _work(self) -> None:
        try:
            with torch.no_grad():
                output = self._model.generate(**self._kwargs)
            self.sequence = output[0].tolist()
        except BaseException as error:  # handed to the consumer thread
            self.error = error
        finally:
            self._streamer.end()

    def tokens(self) -> Iterator[int]:
        while True:
            item = self._streamer.queue.get()
            if item is _TokenQueue.END:
                self.ended = True
                return
            now = time.perf_counter()
            if self.first_token_at is None:
                self.first_token_at = now
            self.last_token_at = now
            self.token_count += 1
            yield item

    def finish(self) -> list[int]:
        """Stop early if still running, wait for the worker, and return the full sequence."""
        if not self.ended:  # the consumer left early: stop the model rather than let it run on
            self.stop_event.set()
        self._done.result()
        if self.error is not None:
            raise self.error
        assert self.sequence is not None
        return self.sequence
