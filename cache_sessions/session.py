"""A cache session: one `DynamicCache` plus the ledger of token ids whose states it holds.

Invariant at rest: `cache.get_seq_length() == len(token_ids)` and the cached states are what a
from-scratch forward over `token_ids` would give. Every change of the ledger goes through this
class and those it builds on: `rewind_to` (roll back), `note_extended` (after the runner fed
tokens on the cache in place: chat/model_step/), `commit`, segments (cache_sessions/segmented.py)
and `release` (cache_sessions/states.py). A session holds no model and never runs one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from cache_sessions.prefixes import PrefixStore
from cache_sessions.rollback import RollbackHow
from cache_sessions.segmented import SegmentedStates


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    limit = min(len(a), len(b))
    for index in range(limit):
        if a[index] != b[index]:
            return index
    return limit


@dataclass(frozen=True)
class Landing:
    """Where a cache stands for a prompt: the tokens it holds (a prefix of the prompt), and the
    fork, the point past them where the prompt parts from what the cache held before its
    rollback (it had to land before it: the prefill checkpoints there), if any."""

    position: int
    fork: int | None = None


@dataclass(frozen=True)
class PrefillResult:
    reused_tokens: int  # prompt tokens whose states were kept (or copied from a shared prefix)
    prefilled_tokens: int  # prompt tokens computed for this prompt (the last one is fed by generate)
    rebuilt: bool  # the cache had to start from nothing although it once held a usable prefix
    rollback: RollbackHow
    shared_prefix_tokens: int = 0  # of reused_tokens, copied from the shared-prefix store


class CacheSession(SegmentedStates):
    """A cache and its ledger, driven by prompts: `rewind_to` before generating, `commit` after."""

    # ---- the main path -----------------------------------------------------------------------
    def rewind_to(self, prompt_ids: Sequence[int], *, prefix_store: PrefixStore | None = None,
                  shared_prefix_length: int = 0, whole: bool = False) -> PrefillResult:
        """Roll the cache back to the longest exact prefix of `prompt_ids` (at most all but its
        last token: the first one a decode step feeds; given a cache that covers the whole input,
        `generate` would re-feed all of it). The prefill then goes on in pieces
        (`prefill_piece`, fed by the runner, then `piece_fed`). An empty cache starts from the
        longest shared prefix in `prefix_store` (a system prompt). With `whole`, a prompt whose
        `next_logits` the session kept is kept whole: its first token comes from them. Where it
        lands is `landing`, found beforehand without moving anything."""
        prompt_ids = list(prompt_ids)
        if not prompt_ids:
            raise ValueError("cannot rewind to an empty prompt")
        rebuilt, self._states_lost = self._states_lost, False
        copied = self._start_from_shared_prefix(prefix_store, prompt_ids)
        target = self.rollback_target(prompt_ids, whole)
        result = self.rollback_to(target)
        self._checkpoint_here()  # a turn boundary: where this prompt starts to differ
        self._fork = target if result.position < target else None
        self._check_invariant()
        return PrefillResult(
            reused_tokens=result.position,
            prefilled_tokens=len(prompt_ids) - result.position,
            rebuilt=rebuilt or result.how == "rebuild",
            rollback=result.how,
            shared_prefix_tokens=min(copied, result.position),
        )

    def landing(self, prompt_ids: Sequence[int], prefix_store: PrefixStore | None = None,
                whole: bool = False) -> Landing:
        """Where `rewind_to(prompt_ids, prefix_store=prefix_store, whole=whole)`
        would leave the cache, found without moving anything (a step is planned from it before
        the rollback is applied)."""
        prompt_ids = list(prompt_ids)
        if not self.token_ids and prefix_store is not None:
            shared = prefix_store.find(prompt_ids[:-1])
            if shared is not None:  # an empty cache starts from it, all of it a prefix of the prompt
                return Landing(len(shared.token_ids))
        target = self.rollback_target(prompt_ids, whole)
        position = self.reachable(target)
        return Landing(position, target if position < target else None)

    def here(self) -> Landing:
        """Where the cache stands for the prompt it was last rolled back to."""
        return Landing(len(self.token_ids), self._fork)

    def rollback_target(self, prompt_ids: Sequence[int], whole: bool = False) -> int:
        """Where `rewind_to(prompt_ids)` rolls back to: the common prefix, one token always left to
        feed; with `whole`, the whole prompt where the logits after it were kept (`next_logits`)."""
        if whole and self.next_logits(prompt_ids) is not None:
            return len(prompt_ids)
        return min(common_prefix_length(self.token_ids, prompt_ids), len(prompt_ids) - 1)

    def keep_next_logits(self, prompt_ids: Sequence[int], logits: torch.Tensor) -> None:
        """The logits after `prompt_ids` (the cache holds them all now), as the step that fed the
        last one gave them: kept while the ledger starts with that prompt, so a Retry of its reply
        (or the Send of a prompt prepared whole) chooses its first token from them with no model
        step, and a greedy Retry starts as the reply it replaces did. Only where every layer
        crops anywhere: a sliding window or a recurrent state would need a checkpoint after the
        prompt's last token as well as before it, and one more kept set of logits is not worth that."""
        if self.crops_anywhere() and list(self.token_ids[:len(prompt_ids)]) == list(prompt_ids):
            self._next_logits = (list(prompt_ids), logits.detach().reshape(1, -1).clone())

    def next_logits(self, prompt_ids: Sequence[int]) -> torch.Tensor | None:
        """The logits kept after `prompt_ids` (1 x vocabulary), if the cache still holds that whole
        prompt, else None."""
        kept = self._next_logits
        if kept is None or kept[0] != list(prompt_ids) or self.token_ids[:len(prompt_ids)] != kept[0]:
            return None
        return kept[1]

    def prefill_piece(self, prompt_ids: Sequence[int], budget: int | None = None,
                      prefix_store: PrefixStore | None = None, shared_prefix_length: int = 0,
                      at: Landing | None = None) -> list[int]:
        """The next prompt tokens to feed: at most `budget`, ending at the next point where the
        session keeps something (the shared prefix, for `prefix_store`; the point this prompt
        parts from the last one, where the rollback had to land before it, to checkpoint it).
        None left once only the last token is, or where the whole prompt is held (a `whole`
        rollback: the logits after it were kept). `at`: from where a rollback not applied yet
        would leave the cache (`landing`), rather than from where it stands."""
        prompt_ids = list(prompt_ids)
        if at is None:
            at = self.here()
            if prompt_ids[:at.position] != self.token_ids:
                raise ValueError("the cache does not hold a prefix of this prompt; rewind_to it first")
        start, end = at.position, len(prompt_ids) - 1
        if start == len(prompt_ids):
            return []
        if end < start:
            raise ValueError("the cache does not hold a prefix of this prompt; rewind_to it first")
        if budget is not None:
            end = min(end, start + budget)
        shares = prefix_store is not None and shared_prefix_length < len(prompt_ids)
        stops = [p for p in (at.fork, shared_prefix_length if shares else None) if p is not None and start < p < end]
        return prompt_ids[start:min(stops, default=end)]

    def piece_fed(self, prompt_ids: Sequence[int], prefix_store: PrefixStore | None = None,
                  shared_prefix_length: int = 0) -> bool:
        """A piece of `prefill_piece` was fed and noted: the shared prefix, once reached, goes to
        `prefix_store` for new conversations; a checkpoint at the fork and the shared prefix, and
        at the generation start (where regenerate rolls back to). True once only the last
        prompt token is left."""
        held = len(self.token_ids)
        if prefix_store is not None and held == shared_prefix_length < len(prompt_ids):
            if not prefix_store.has(self.token_ids):
                prefix_store.add(self.cut_segment(0))
        if held in (shared_prefix_length, self._fork):
            self._checkpoint_here()
        done = held == len(prompt_ids) - 1
        if done:
            self._checkpoint_here()
        return done

    def feeds_with_first_step(self, prompt_ids: Sequence[int], piece: Sequence[int],
                              prefix_store: PrefixStore | None = None, shared_prefix_length: int = 0,
                              at: Landing | None = None) -> bool:
        """Whether `piece` (the next from `prefill_piece`) may go with the prompt's last token in the
        reply's first decode step instead of a step of its own, its first token chosen after it
        (as vLLM samples after a prompt's last piece): only where `piece_fed` would keep nothing
        at its end, i.e. it reaches the generation start and every layer crops anywhere (no
        checkpoint there: regenerate crops back to it), and no shared prefix is stored there. A
        sliding window needs its checkpoint there: a crop (a refused guess, chat/scheduling/drafting.py) keeps
        only a window of what it recorded, so a Regenerate could not crop back that far."""
        held = (at or self.here()).position + len(piece)
        stores_prefix = prefix_store is not None and held == shared_prefix_length < len(prompt_ids)
        return held == len(prompt_ids) - 1 and self.crops_anywhere() and not stores_prefix

    def _start_from_shared_prefix(self, prefix_store: PrefixStore | None, prompt_ids: list[int]) -> int:
        """An empty cache starts from the longest stored shared prefix; returns its length."""
        if self.token_ids or prefix_store is None:
            return 0
        shared = prefix_store.find(prompt_ids[:-1])
        if shared is None:
            return 0
        self._append(shared)
        return len(shared.token_ids)

    def commit(self, sequence_ids: Sequence[int]) -> None:
        """Record what `generate` fed: the prompt and all sampled tokens but the last."""
        cached = self.cache.get_seq_length()
        if list(sequence_ids[: len(self.token_ids)]) != self.token_ids or cached > len(sequence_ids):
            self.release()
            raise RuntimeError("generated sequence does not extend the cache ledger")
        self.token_ids = list(sequence_ids[:cached])
