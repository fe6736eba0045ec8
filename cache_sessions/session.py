"""A cache session: one `DynamicCache` plus the ledger of token ids whose states it holds.

Invariant at rest: `cache.get_seq_length() == len(token_ids)` and the cached states are what a
from-scratch forward over `token_ids` would give. Every way of changing the cache goes through
`prepare` (roll back + prefill), `commit` (after `generate`), `release` or `invalidate`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
from transformers import DynamicCache, PreTrainedModel

from cache_sessions.checkpoints import CheckpointStore
from cache_sessions.rollback import layer_kinds, needs_checkpoints, roll_back, take_checkpoint

DEFAULT_MAX_CHECKPOINTS = 16


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    limit = min(len(a), len(b))
    for index in range(limit):
        if a[index] != b[index]:
            return index
    return limit


@dataclass(frozen=True)
class PrefillResult:
    reused_tokens: int  # prompt tokens whose states were kept
    prefilled_tokens: int  # prompt tokens computed for this prompt (the last one is fed by generate)
    rebuilt: bool  # the cache had to start from nothing although it once held a usable prefix
    rollback: str  # "none", "crop", "checkpoint" or "rebuild"


class CacheSession:
    def __init__(self, model: PreTrainedModel, *, max_checkpoints: int = DEFAULT_MAX_CHECKPOINTS):
        self.model = model
        self.max_checkpoints = max_checkpoints
        self.token_ids: list[int] = []
        self._states_lost = False
        self._reset_cache()

    def _reset_cache(self) -> None:
        self.cache = DynamicCache(config=self.model.config)
        self._kinds = layer_kinds(self.cache)
        for kind in self._kinds:
            kind.prepare()
        self._uses_checkpoints = needs_checkpoints(self._kinds)
        self.checkpoints = CheckpointStore(self.max_checkpoints if self._uses_checkpoints else 0)
        self.token_ids = []

    def prepare(self, prompt_ids: Sequence[int]) -> PrefillResult:
        """Make the cache hold exactly `prompt_ids[:-1]`, reusing the longest exact prefix.

        The last prompt token is left for `generate` to feed: given a cache that covers the
        whole input, `generate` would re-feed all of it.
        """
        prompt_ids = list(prompt_ids)
        if not prompt_ids:
            raise ValueError("cannot prepare an empty prompt")
        target = min(common_prefix_length(self.token_ids, prompt_ids), len(prompt_ids) - 1)
        result = roll_back(self._kinds, self.checkpoints, len(self.token_ids), target)
        rebuilt = self._states_lost or result.how == "rebuild"
        if result.how == "rebuild":
            self._reset_cache()
        self.token_ids = self.token_ids[: result.position]
        self._states_lost = False
        try:
            self._checkpoint_here()  # a turn boundary: where this prompt starts to differ
            self._forward(prompt_ids[result.position : -1])
            self.token_ids = prompt_ids[:-1]
            self._checkpoint_here()  # the generation start: regenerate rolls back to here
        except BaseException:
            self.invalidate()
            raise
        self._check_invariant()
        return PrefillResult(
            reused_tokens=result.position,
            prefilled_tokens=len(prompt_ids) - result.position,
            rebuilt=rebuilt,
            rollback=result.how,
        )

    def commit(self, sequence_ids: Sequence[int]) -> None:
        """Record what `generate` fed: the prompt and all sampled tokens but the last."""
        cached = self.cache.get_seq_length()
        if list(sequence_ids[: len(self.token_ids)]) != self.token_ids or cached > len(sequence_ids):
            self.invalidate()
            raise RuntimeError("generated sequence does not extend the cache ledger")
        self.token_ids = list(sequence_ids[:cached])

    def _checkpoint_here(self) -> None:
        position = len(self.token_ids)
        if self._uses_checkpoints and position > 0 and not self.checkpoints.has(position):
            self.checkpoints.add(take_checkpoint(self._kinds, position))

    @torch.no_grad()
    def _forward(self, token_ids: Sequence[int]) -> None:
        if not token_ids:
            return
        input_ids = torch.tensor([list(token_ids)], dtype=torch.long, device=self.model.device)
        self.model(input_ids=input_ids, past_key_values=self.cache, use_cache=True, logits_to_keep=1)

    def _check_invariant(self) -> None:
        if self.cache.get_seq_length() != len(self.token_ids):
            held = self.cache.get_seq_length()
            self.invalidate()
            raise RuntimeError(f"cache holds {held} tokens but the ledger {len(self.token_ids)}")

    def release(self) -> None:
        """Free every tensor (memory pressure); the next `prepare` rebuilds and says so."""
        had_states = bool(self.token_ids)
        self._reset_cache()
        self._states_lost = self._states_lost or had_states

    def invalidate(self) -> None:
        """After a failure mid-update the states cannot be trusted: drop them all."""
        self.release()

    def tensors(self) -> Iterator[torch.Tensor]:
        for kind in self._kinds:
            yield from kind.tensors()
        yield from self.checkpoints.tensors()

    def nbytes(self) -> int:
        """Bytes held by the cache and its checkpoints, counting each storage once (crops are views)."""
        seen: dict[int, int] = {}
        for tensor in self.tensors():
            storage = tensor.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        return sum(seen.values())
