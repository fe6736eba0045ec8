"""One session fed on its own by the model's own forward, outside the engine's loop: what tests
and benchmarks use to bring a session to a point (the engine feeds its sessions in the runner's
steps, chat/model_step/runner.py). The session only notes what was fed (`note_extended`)."""

from __future__ import annotations

from typing import Sequence

import torch
from transformers import PreTrainedModel

from cache_sessions.prefixes import PrefixStore
from cache_sessions.session import CacheSession, PrefillResult


@torch.no_grad()
def feed(model: PreTrainedModel, session: CacheSession, token_ids: Sequence[int]) -> None:
    """`token_ids` on top of what the session's cache holds, by the model's own forward."""
    if not token_ids:
        return
    input_ids = torch.tensor([list(token_ids)], dtype=torch.long, device=model.device)
    model(input_ids=input_ids, past_key_values=session.cache, use_cache=True, logits_to_keep=1)
    session.note_extended(token_ids)


def prefill(model: PreTrainedModel, session: CacheSession, prompt_ids: Sequence[int], *, budget: int | None = None,
            prefix_store: PrefixStore | None = None, shared_prefix_length: int = 0) -> bool:
    """Feed at most `budget` more tokens of `prompt_ids[:-1]` (all, if None) after what the cache
    holds, which must be a prefix of it, piece by piece as the engine does. True once only the
    last token is left. A failure midway releases the states (they cannot be trusted)."""
    prompt_ids = list(prompt_ids)
    limit = None if budget is None else len(session.token_ids) + budget
    try:
        while True:
            left = None if limit is None else limit - len(session.token_ids)
            piece = session.prefill_piece(prompt_ids, left, prefix_store, shared_prefix_length)
            feed(model, session, piece)
            done = session.piece_fed(prompt_ids, prefix_store, shared_prefix_length)
            if done or not piece or len(session.token_ids) == limit:
                return done
    except BaseException:
        session.release()
        raise


def rewind_and_prefill(model: PreTrainedModel, session: CacheSession, prompt_ids: Sequence[int], *,
                       prefix_store: PrefixStore | None = None, shared_prefix_length: int = 0) -> PrefillResult:
    """Roll back to the longest exact prefix of `prompt_ids` and prefill all but its last token."""
    result = session.rewind_to(prompt_ids, prefix_store=prefix_store, shared_prefix_length=shared_prefix_length)
    prefill(model, session, prompt_ids, prefix_store=prefix_store, shared_prefix_length=shared_prefix_length)
    return result
