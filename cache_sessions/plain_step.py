"""The one model step of the plain decoder families, for decode rows and prompt pieces alike.

gpt-fast's way: the decoder written out as one function of the model's own modules (its
projections, norms, rotary embedding and MLP: int8 or packed layers run as they are), with no
cache object, no mask function and no config read per call, over a packed sequence: every row's
new tokens side by side, so each weight is read once for all of them. At each layer every row
writes its keys and values into its own cache's buffer (a `GrowingLayer`, in place) and attends
to that buffer's filled part: a decode row (one query: every held position, no mask) or a prompt
piece (a causal mask offset by what its row holds, built once a step). The query heads that share
a key/value head are stacked on the query axis, so the history is read as it is, never repeated.

The engine runs this eagerly for any step whose rows it takes, and cache_sessions/compiled.py
compiles the same function for steps of decode rows alone: one step, two ways to run it. A step
it does not take (sliding windows, recurrent layers, a quantized cache, another family) runs the
model's own forward, packed (cache_sessions/resident.py) or row by row.

Measured against that packed forward (`python -m benchmarks.step_anatomy`, docs/performance.md):
the per-row work of a step is a write and an attention call a layer, where the model's forward
builds each row's masks from its cache and dispatches its update through the cache object.

Exactness: the operations of the model's own forward on the same states (its modules, the same
rotary tables, SDPA with the same scale), so logits agree with a from-scratch forward to float
noise (tests/test_plain_step.py holds every family it takes to 1e-4).
"""

from __future__ import annotations

import sys
from typing import Any, Sequence

import torch
from transformers import PreTrainedModel

from cache_sessions.growing import GrowingLayer

PLAIN_FAMILIES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")

Span = tuple[int, int, int]  # a row's (start, end) in the packed sequence, and the positions its cache holds


def plain_refusal(model: PreTrainedModel) -> str | None:
    """Why this model's steps do not run as the plain step (None: they do)."""
    if type(model).__name__ not in PLAIN_FAMILIES:
        return f"{type(model).__name__} is not one of the plain decoders ({', '.join(PLAIN_FAMILIES)})"
    config = model.config
    sliding = getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True)
    if sliding or any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or ()):
        return "it has sliding-window layers"
    return None


def plain_step(model: PreTrainedModel, tokens: torch.Tensor, positions: torch.Tensor, spans: Sequence[Span],
               keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], logits_at: torch.Tensor) -> torch.Tensor:
    """`model`'s decoder on the packed `tokens` (at `positions`, both shaped (tokens,)); row r
    feeds `tokens[start:end]` of `spans[r] = (start, end, held)`, writing each layer's keys and
    values at positions held..held + (end - start) of its buffers (`keys[r * layers + layer]`,
    with room for them) and attending to their first held + (end - start) positions. The
    logits after the tokens at `logits_at` (indices into `tokens`), shaped (len(logits_at), vocab)."""
    core = model.model
    layers = len(core.layers)
    hidden = core.embed_tokens(tokens)[None]
    cos, sin = core.rotary_emb(hidden, positions[None])
    masks: list[torch.Tensor | None] = []
    for start, end, held in spans:  # a prompt piece's query i sees the held positions and its own up to i
        if end - start == 1:
            masks.append(None)
        else:
            seen = torch.arange(held + end - start, device=tokens.device)
            masks.append(seen[None, :] <= seen[held:, None])
    count = tokens.shape[0]
    for index, layer in enumerate(core.layers):
        attention = layer.self_attn
        rotate = sys.modules[type(attention).__module__].apply_rotary_pos_emb
        normed = layer.input_layernorm(hidden)
        shape = (1, count, -1, attention.head_dim)
        query, key = attention.q_proj(normed).view(shape), attention.k_proj(normed).view(shape)
        if hasattr(attention, "q_norm"):
            query, key = attention.q_norm(query), attention.k_norm(key)
        value = attention.v_proj(normed).view(shape).transpose(1, 2)
        query, key = rotate(query.transpose(1, 2), key.transpose(1, 2), cos, sin)
        heads, kv_heads = query.shape[1], key.shape[1]
        groups = heads // kv_heads
        outputs = []
        for row, (start, end, held) in enumerate(spans):
            length = end - start
            row_keys, row_values = keys[row * layers + index], values[row * layers + index]
            row_keys.index_copy_(2, positions[start:end], key[:, :, start:end])
            row_values.index_copy_(2, positions[start:end], value[:, :, start:end])
            mask = masks[row]
            stacked = query[:, :, start:end].reshape(1, kv_heads, groups * length, attention.head_dim)
            output = torch.nn.functional.scaled_dot_product_attention(
                stacked, row_keys[:, :, :held + length], row_values[:, :, :held + length],
                attn_mask=None if mask is None else mask.repeat(groups, 1), scale=attention.scaling)
            outputs.append(output.reshape(heads, length, -1).transpose(0, 1).reshape(length, -1))
        hidden = hidden + attention.o_proj(torch.cat(outputs)[None])
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    return model.lm_head(core.norm(hidden[:, logits_at]))[0]


def takes_states(sessions: Sequence[Any]) -> bool:
    """Whether every full-attention layer of these sessions is a buffer the step writes in place,
    holding what its ledger says (a layer not started yet is started by the step)."""
    return all(isinstance(layer, GrowingLayer) and (layer.get_seq_length() if layer.is_initialized else 0)
               == len(session.token_ids) for session in sessions for layer in session.cache.layers)


def row_inputs(model: PreTrainedModel, rows: Sequence[tuple[Any, Sequence[int]]]
               ) -> tuple[list[int], list[int], list[Span], list[torch.Tensor], list[torch.Tensor]]:
    """`plain_step`'s tokens, positions, spans and buffers for these rows (sessions and what each
    feeds), every buffer grown to take its row's tokens; layers not started yet are started empty."""
    tokens: list[int] = []
    positions: list[int] = []
    spans: list[Span] = []
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    for session, fed in rows:
        if not fed:
            raise ValueError("every row of a packed step feeds at least one token")
        held = len(session.token_ids)
        spans.append((len(tokens), len(tokens) + len(fed), held))
        tokens.extend(fed)
        positions.extend(range(held, held + len(fed)))
        for layer_index, layer in enumerate(session.cache.layers):
            if not layer.is_initialized:
                empty = _empty_states(model, layer_index)
                layer.update(empty, empty)
            key_buffer, value_buffer = layer.room_for(held + len(fed))
            keys.append(key_buffer)
            values.append(value_buffer)
    return tokens, positions, spans, keys, values


def _empty_states(model: PreTrainedModel, layer_index: int) -> torch.Tensor:
    attention = model.model.layers[layer_index].self_attn
    heads = model.config.num_key_value_heads
    return torch.empty(1, heads, 0, attention.head_dim, dtype=model.dtype, device=model.device)


@torch.no_grad()
def run_plain(model: PreTrainedModel, rows: Sequence[tuple[Any, Sequence[int]]], logits_of: Sequence[int]
              ) -> torch.Tensor:
    """Feed each session its tokens through `plain_step` (rows whose states `takes_states`); the
    logits after every token of the rows `logits_of`, in that order, as `forward_rows` returns
    them. The ledgers are the caller's; if this raises, a row's buffers may hold part of the step
    past what they say they hold (nothing reads it)."""
    tokens, positions, spans, keys, values = row_inputs(model, rows)
    wanted = [place for index in logits_of for place in range(spans[index][0], spans[index][1])]
    device = model.device
    logits = plain_step(model, torch.tensor(tokens, device=device), torch.tensor(positions, device=device), spans,
                        keys, values, torch.tensor(wanted, dtype=torch.long, device=device))
    for (session, fed), (_, _, held) in zip(rows, spans):
        for layer in session.cache.layers:
            layer.filled(held + len(fed))
    return logits
