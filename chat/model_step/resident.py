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

Linear attention (and state-space) layers keep one recurrent state per sequence, folded over
every token in order, so a packed sequence cannot run through them as one: during a packed step
each such mixer runs on each row's span with that row's own states: the decoding rows together,
their bounded states stacked for the call and written back, and each prefill piece alone. The
rest of the layer stays packed. A model whose recurrent layers' mixers cannot be found (no
module taking `cache_params`) runs row by row instead (chat/model_step/runner.py).
"""

from __future__ import annotations

import inspect
import sys
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from transformers import PreTrainedModel
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from chat.model_step.plain_step import logit_places
from cache_sessions.rollback import RecurrentState
from cache_sessions.session import CacheSession

ROWS_ATTENTION = "rewind_rows"


_MIXERS: "weakref.WeakKeyDictionary[torch.nn.Module, list[torch.nn.Module]]" = weakref.WeakKeyDictionary()


def recurrent_mixers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of `model` that read and write a layer's recurrent state: those whose forward
    takes the cache as `cache_params` (transformers' linear-attention and state-space mixers)."""
    if model not in _MIXERS:
        _MIXERS[model] = [module for module in model.modules() if hasattr(module, "layer_idx")
                          and "cache_params" in inspect.signature(module.forward).parameters]
    return _MIXERS[model]


def packs(model: PreTrainedModel, sessions: Sequence[CacheSession]) -> bool:
    """Whether these sessions' layers can run packed: every recurrent state has a mixer to run
    per row (the rest packs as it is)."""
    return all(sum(isinstance(kind, RecurrentState) for kind in session.kinds) <= len(recurrent_mixers(model))
               for session in sessions)


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
    grouped = (attention is sdpa_attention_forward and getattr(module, "num_key_value_groups", 1) > 1
               and kwargs.get("softcap") is None and kwargs.get("position_bias") is None)
    outputs = []
    for row, (keys, values) in zip(key.rows, key.states, strict=True):
        rows_query, mask = query[:, :, row.start:row.end], row.masks[kind]
        if grouped and isinstance(mask, torch.Tensor) and mask.dim() == 4 and mask.shape[1] == 1:
            outputs.append(_grouped_sdpa(module, rows_query, keys, values, mask, kwargs.get("scaling")))
        else:
            outputs.append(attention(module, rows_query, keys, values, mask, **kwargs)[0])
    return torch.cat(outputs, dim=1), None


def _grouped_sdpa(module: torch.nn.Module, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                  mask: torch.Tensor, scaling: float | None) -> torch.Tensor:
    """SDPA with the query heads that share a key/value head stacked along the query axis, and the
    mask repeated to match: every such head sees the same keys, so the history is read as it is.
    transformers does this for one query token (`pack_gqa`) but repeats the keys and values for
    more, a copy of the whole history every layer: 13 ms of a 76 ms step carrying 16 prompt tokens
    over a 3,000-token history on the benchmark model. Same sums per query, so the same result."""
    batch, heads, length, dim = query.shape
    groups = module.num_key_value_groups
    stacked = query.reshape(batch, heads // groups, groups * length, dim)
    output = torch.nn.functional.scaled_dot_product_attention(
        stacked, keys, values, attn_mask=mask.repeat(1, 1, groups, 1), scale=scaling)
    return output.reshape(batch, heads, length, values.shape[-1]).transpose(1, 2).contiguous()


AttentionInterface.register(ROWS_ATTENTION, _rows_attention)


class _NotStackable(Exception):
    """A mixer asked the stacked states for something they do not offer: run its rows one by one."""


# Mixers that raised `_NotStackable` once: not tried stacked again (a try runs their projections).
_UNSTACKABLE: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()


class _StackedStates:
    """The recurrent states of several decoding rows, stacked on the batch dimension for one call
    of a mixer: the `cache_params` it reads and updates (transformers' decode path updates the conv
    window in place and hands back the new recurrent state). Copies of bounded states (a conv
    window and one state a row), so a call that raises leaves every row's cache as it was;
    `put_back` writes each row's slice into its own cache."""

    def __init__(self, caches: list[Any], layer_idx: int):
        self.caches, self.layer_idx = caches, layer_idx
        self.conv = torch.cat([cache.get_conv_state(layer_idx) for cache in caches])
        self.recurrent = torch.cat([cache.get_recurrent_state(layer_idx) for cache in caches])

    @staticmethod
    def fits(cache: Any, layer_idx: int) -> bool:
        """A row whose states exist and hold only their bounded window (nothing recorded)."""
        return (cache.get_conv_state(layer_idx) is not None and cache.get_recurrent_state(layer_idx) is not None
                and not cache.is_recording_past(layer_idx))

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor:
        return self.conv

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor:
        return self.recurrent

    def is_recording_past(self, layer_idx: int) -> bool:
        return False

    def update_recurrent_state(self, states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs: Any
                               ) -> torch.Tensor:
        self.recurrent = states
        return states

    def __getattr__(self, name: str) -> Any:  # anything else (a conv update is a prefill's): not stacked
        raise _NotStackable(name)

    def put_back(self) -> None:
        for index, cache in enumerate(self.caches):
            cache.get_conv_state(self.layer_idx).copy_(self.conv[index:index + 1])
            cache.update_recurrent_state(self.recurrent[index:index + 1], self.layer_idx)


def _mixer_per_row(mixer: torch.nn.Module, forward: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """A recurrent mixer's forward that, in a packed step, runs on each row's span with its own
    cache (a recurrent state folds one sequence's tokens in order): the decoding rows together in
    one call on their stacked states, the prefill pieces one by one."""
    def per_row(hidden_states: torch.Tensor, cache_params: Any = None, attention_mask: Any = None, **kwargs: Any
                ) -> torch.Tensor:
        if not isinstance(cache_params, PackedRows):
            return forward(hidden_states, cache_params=cache_params, attention_mask=attention_mask, **kwargs)
        # No padding in a row's span: its own forward would have no recurrent mask either.
        rows, outputs = cache_params.rows, {}
        decoding = [index for index, row in enumerate(rows)
                    if row.end - row.start == 1 and _StackedStates.fits(row.session.cache, mixer.layer_idx)]
        if len(decoding) > 1 and mixer not in _UNSTACKABLE:
            stacked = _StackedStates([rows[index].session.cache for index in decoding], mixer.layer_idx)
            inputs = torch.cat([hidden_states[:, rows[index].start:rows[index].end] for index in decoding])
            try:
                together = forward(inputs, cache_params=stacked, **kwargs)
            except _NotStackable:
                _UNSTACKABLE.add(mixer)  # a mixer this does not know: its rows run one by one below
            else:
                stacked.put_back()
                outputs = {index: together[place:place + 1] for place, index in enumerate(decoding)}
        return torch.cat([outputs[index] if index in outputs else
                          forward(hidden_states[:, row.start:row.end], cache_params=row.session.cache, **kwargs)
                          for index, row in enumerate(rows)], dim=1)
    return per_row


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
                 logits_of: Sequence[int], tails: Sequence[int] | None = None) -> torch.Tensor:
    """Feed each session its tokens in one forward; the logits after every token of the rows
    `logits_of` (indices into `rows`; a decode row feeds its next input and any guesses to
    verify, chat/scheduling/drafting.py), in that order, or only after their last `tails` tokens
    (`logit_places`). The ledgers are not
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
    wanted = logit_places(spans, logits_of, tails)
    last = torch.tensor(wanted or [len(tokens) - 1], device=device)
    mixers = recurrent_mixers(model)
    # For this forward only (all run on the loop thread): rows attend to their own caches, and
    # recurrent mixers run per row.
    model.config._attn_implementation = ROWS_ATTENTION
    own_forwards = [mixer.__dict__.get("forward") for mixer in mixers]  # set on the instance (hooks), or None
    for mixer in mixers:
        mixer.forward = _mixer_per_row(mixer, mixer.forward)
    try:
        logits = model(input_ids=torch.tensor([tokens], device=device), position_ids=position_ids,
                       past_key_values=PackedRows(packed, attention), use_cache=True, logits_to_keep=last).logits
    finally:
        model.config._attn_implementation = original
        for mixer, own in zip(mixers, own_forwards):
            if own is None:
                del mixer.forward  # the class's own forward again
            else:
                mixer.forward = own
    return logits[0, : len(wanted)]
