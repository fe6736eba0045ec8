"""One forward for many conversations, each reading and writing its own cache in place.

Every live conversation's states stay where they are: in its session's cache (a full-attention
layer is a `GrowingLayer` buffer written in place). A step packs the new tokens of every row (one
for a decoding row, a chunk for a prefilling one) into one sequence, so the weights are read
once for all of them; at each attention layer every row appends its own keys and values to its
own cache and attends to what that cache returns, as it would alone. That is llama.cpp's slots
with sequence ids, the row's span of the packed sequence being its id: nothing is gathered into a
batch, padded or scattered back, so joining or leaving the batch is bookkeeping and the states
are held once.

Exactness: a row's position ids, the cache update it calls and the mask it attends with are the
ones its own forward would use (each mask is built by the model's own mask functions from the
row's cache before the step); only the row count of the matrix products differs, as in any batch.

Linear attention keeps a recurrent state per sequence over a batch dimension, which a packed
sequence has not: models with such layers decode on a gathered batch (cache_sessions/batch.py).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from transformers import PreTrainedModel
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from cache_sessions.rollback import RecurrentState
from cache_sessions.session import CacheSession

ROWS_ATTENTION = "rewind_rows"


def packs(sessions: Sequence[CacheSession]) -> bool:
    """Whether these sessions' layers can run packed (no recurrent state among them)."""
    return not any(isinstance(kind, RecurrentState) for session in sessions for kind in session.kinds)


@dataclass
class _Row:
    session: CacheSession
    start: int  # its span of the packed sequence
    end: int
    masks: dict[str, Any]  # "full" / "sliding": the mask its own forward would attend with


class RowStates:
    """What a packed step's cache update returns to attention: each row's own keys and values
    (as its cache returned them) with its span and masks, and the attention the model runs."""

    def __init__(self, rows: list[_Row], attention: Callable[..., Any] | None, states: list[tuple[torch.Tensor, torch.Tensor]]):
        self.rows, self.attention, self.states = rows, attention, states


class PackedRows:
    """The `past_key_values` of a packed step: each row's new states go to its own cache."""

    def __init__(self, rows: list[_Row], attention: Callable[..., Any] | None):
        self.rows, self.attention = rows, attention

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
               ) -> tuple[RowStates, RowStates]:
        states = [row.session.cache.update(key_states[:, :, row.start:row.end], value_states[:, :, row.start:row.end],
                                           layer_idx, *args, **kwargs) for row in self.rows]
        handle = RowStates(self.rows, self.attention, states)
        return handle, handle


def _rows_attention(module: torch.nn.Module, query: torch.Tensor, key: Any, value: Any, attention_mask: Any,
                    **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Each row attends to its own cache's states, with its own mask, by the model's own attention."""
    if not isinstance(key, RowStates):  # not a packed step (the model is switched only during one)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    kind = "sliding" if kwargs.get("sliding_window") is not None else "full"
    attention = key.attention or sys.modules[type(module).__module__].eager_attention_forward
    outputs = [attention(module, query[:, :, row.start:row.end], keys, values, row.masks[kind], **kwargs)[0]
               for row, (keys, values) in zip(key.rows, key.states, strict=True)]
    return torch.cat(outputs, dim=1), None


AttentionInterface.register(ROWS_ATTENTION, _rows_attention)


def _uses_sliding_masks(config: Any) -> bool:
    if getattr(config, "sliding_window", None) is None:
        return False
    layer_types = getattr(config, "layer_types", None)
    return layer_types is None or "sliding_attention" in layer_types


def _masks(model: PreTrainedModel, session: CacheSession, count: int, positions: torch.Tensor) -> dict[str, Any]:
    """The masks a forward of `count` tokens on this session alone would build (before it runs)."""
    shape = torch.empty(1, count, model.config.hidden_size, dtype=model.dtype, device=model.device)
    arguments = dict(config=model.config, inputs_embeds=shape, attention_mask=None,
                     past_key_values=session.cache, position_ids=positions)
    masks = {"full": create_causal_mask(**arguments)}
    if _uses_sliding_masks(model.config):
        masks["sliding"] = create_sliding_window_causal_mask(**arguments)
    return masks


@torch.no_grad()
def forward_rows(model: PreTrainedModel, rows: Sequence[tuple[CacheSession, Sequence[int]]],
                 logits_of: Sequence[int]) -> torch.Tensor:
    """Feed each session its tokens in one forward; the logits after the last token of the rows
    `logits_of` (indices into `rows`), one per such row, in that order. The ledgers are not
    touched: the caller notes what was fed (`note_extended`) or, if this raises, releases the
    sessions (their caches may hold part of the step)."""
    device, spans, positions, tokens = model.device, [], [], []
    for session, fed in rows:
        if not fed:
            raise ValueError("every row of a packed step feeds at least one token")
        held = len(session.token_ids)
        spans.append((len(tokens), len(tokens) + len(fed)))
        positions.extend(range(held, held + len(fed)))
        tokens.extend(fed)
    position_ids = torch.tensor([positions], device=device)
    packed = [_Row(session, start, end, _masks(model, session, end - start, position_ids[:, start:end]))
              for (session, _), (start, end) in zip(rows, spans)]
    original = model.config._attn_implementation
    # The model's own attention function; "eager" is each model's own (found from its module).
    attention = None if original == "eager" else ALL_ATTENTION_FUNCTIONS.get_interface(original, sdpa_attention_forward)
    last = torch.tensor([spans[index][1] - 1 for index in logits_of] or [len(tokens) - 1], device=device)
    model.config._attn_implementation = ROWS_ATTENTION  # for this forward only: all run on the loop thread
    try:
        logits = model(input_ids=torch.tensor([tokens], device=device), position_ids=position_ids,
                       past_key_values=PackedRows(packed, attention), use_cache=True, logits_to_keep=last).logits
    finally:
        model.config._attn_implementation = original
    return logits[0, : len(logits_of)]
