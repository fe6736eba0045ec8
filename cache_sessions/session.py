"""A cache session: one `DynamicCache` plus the ledger of token ids whose states it holds.

Invariant at rest: `cache.get_seq_length() == len(token_ids)` and the cached states are what a
from-scratch forward over `token_ids` would give. Every change of the cache goes through this
class: `prepare` (roll back + prefill), `commit` (after `generate`), segments, `release`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Iterator, Sequence

import torch
from transformers import DynamicCache, PreTrainedModel

from cache_sessions.checkpoints import CheckpointStore
from cache_sessions.prefixes import PrefixStore
from cache_sessions.rollback import RollbackResult, layer_kinds, needs_checkpoints, roll_back, take_checkpoint
from cache_sessions.segments import Segment

DEFAULT_MAX_CHECKPOINTS = 16


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    limit = min(len(a), len(b))
    for index in range(limit):
        if a[index] != b[index]:
            return index
    return limit


@dataclass(frozen=True)
class PrefillResult:
    reused_tokens: int  # prompt tokens whose states were kept (or copied from a shared prefix)
    prefilled_tokens: int  # prompt tokens computed for this prompt (the last one is fed by generate)
    rebuilt: bool  # the cache had to start from nothing although it once held a usable prefix
    rollback: str  # "none", "crop", "checkpoint" or "rebuild"
    shared_prefix_tokens: int = 0  # of reused_tokens, copied from the shared-prefix store


class CacheSession:
    def __init__(self, model: PreTrainedModel, *, max_checkpoints: int = DEFAULT_MAX_CHECKPOINTS):
        self.model = model
        self.max_checkpoints = max_checkpoints
        self.token_ids: list[int] = []
        self.segments: dict[Hashable, Segment] = {}
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

    def __getstate__(self) -> dict:
        """Pickled without its model (a session crosses to a GPU worker process and back)."""
        state = self.__dict__.copy()
        state["model"] = None
        return state

    # ---- the main path -----------------------------------------------------------------------
    def prepare(self, prompt_ids: Sequence[int], *, prefix_store: PrefixStore | None = None,
                shared_prefix_length: int = 0) -> PrefillResult:
        """Roll the cache back to the longest exact prefix of `prompt_ids`, and prefill.

        Afterwards the cache holds a prefix of `prompt_ids[:-1]` and `generate` feeds the rest:
        at least the last token, since given a cache that covers the whole input `generate`
        would re-feed all of it. Layers that need checkpoints are prefilled here up to the last
        token, to checkpoint the generation start (where regenerate returns); full attention
        alone leaves the whole prefill to `generate`, in one forward pass.
        `shared_prefix_length` tokens of the prompt (a system prompt) are shared through
        `prefix_store` with other sessions.
        """
        prompt_ids = list(prompt_ids)
        if not prompt_ids:
            raise ValueError("cannot prepare an empty prompt")
        rebuilt, copied = self._states_lost, 0
        self._states_lost = False
        if not self.token_ids and prefix_store is not None:
            shared = prefix_store.find(prompt_ids[:-1])
            if shared is not None:
                self._append(shared)
                copied = len(shared.token_ids)
        target = min(common_prefix_length(self.token_ids, prompt_ids), len(prompt_ids) - 1)
        result = self.rollback_to(target)
        rebuilt = rebuilt or result.how == "rebuild"
        try:
            self._checkpoint_here()  # a turn boundary: where this prompt starts to differ
            start = len(self.token_ids)
            if prefix_store is not None and start < shared_prefix_length < len(prompt_ids):
                self._forward(prompt_ids[start:shared_prefix_length])
                self.token_ids = prompt_ids[:shared_prefix_length]
                if not prefix_store.has(self.token_ids):
                    prefix_store.add(self.cut_segment(0))
                self._checkpoint_here()
            if self._uses_checkpoints:
                self._forward(prompt_ids[len(self.token_ids) : -1])
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
            shared_prefix_tokens=min(copied, result.position),
        )

    def commit(self, sequence_ids: Sequence[int]) -> None:
        """Record what `generate` fed: the prompt and all sampled tokens but the last."""
        cached = self.cache.get_seq_length()
        if list(sequence_ids[: len(self.token_ids)]) != self.token_ids or cached > len(sequence_ids):
            self.invalidate()
            raise RuntimeError("generated sequence does not extend the cache ledger")
        self.token_ids = list(sequence_ids[:cached])

    def rollback_to(self, target: int) -> RollbackResult:
        """Go back to `target` tokens, or to the closest exact point before it."""
        self.segments = {key: seg for key, seg in self.segments.items() if seg.start <= target}
        result = roll_back(self._kinds, self.checkpoints, len(self.token_ids), target)
        if result.how == "rebuild":
            self._reset_cache()
        self.token_ids = self.token_ids[: result.position]
        return result

    # ---- segments: cut a span of states out, put it back later without a forward pass -------
    def cut_segment(self, start: int) -> Segment:
        """The states for positions [start, now), as a copy that later changes do not touch."""
        end = len(self.token_ids)
        if not 0 <= start <= end:
            raise ValueError(f"segment start {start} outside the cache (0..{end})")
        return Segment(start, self.token_ids[start:end], [kind.cut_segment(start, end) for kind in self._kinds])

    def append_segment(self, segment: Segment) -> bool:
        """Put `segment` back on top of its start; False when the cache cannot reach that start."""
        if len(self.token_ids) < segment.start:
            return False
        if self.rollback_to(segment.start).position != segment.start:
            return False
        self._append(segment)
        self._checkpoint_here()
        return True

    def _append(self, segment: Segment) -> None:
        for kind, state in zip(self._kinds, segment.states, strict=True):
            kind.append_segment(state, segment.start, segment.end)
        self.token_ids = self.token_ids + list(segment.token_ids)
        self._check_invariant()

    # ---- internals -----------------------------------------------------------------------------
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

    # ---- memory ---------------------------------------------------------------------------------
    def release(self) -> None:
        """Free every tensor (memory pressure); the next `prepare` rebuilds and says so."""
        had_states = bool(self.token_ids)
        self.segments = {}
        self._reset_cache()
        self._states_lost = self._states_lost or had_states

    def invalidate(self) -> None:
        """After a failure mid-update the states cannot be trusted: drop them all."""
        self.release()

    def tensors(self) -> Iterator[torch.Tensor]:
        for kind in self._kinds:
            yield from kind.tensors()
        yield from self.checkpoints.tensors()
        for segment in self.segments.values():
            yield from segment.tensors()

    def nbytes(self) -> int:
        """Bytes held by the cache, checkpoints and segments, each storage once (crops are views)."""
        seen: dict[int, int] = {}
        for tensor in self.tensors():
            storage = tensor.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        return sum(seen.values())

    def to(self, device: torch.device | str) -> None:
        """Move every held tensor, e.g. to the CPU between ZeroGPU calls."""
        for kind in self._kinds:
            kind.to(device)
        for checkpoint in self.checkpoints:
            checkpoint.to(device)
        for segment in self.segments.values():
            segment.to(device)
