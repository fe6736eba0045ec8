"""The one model step of the plain decoder families, for decode rows and prompt pieces alike.

gpt-fast's way: the decoder written out as one function of the model's own modules (its
projections, norms, rotary embedding and MLP: int8 or packed layers run as they are), with no
cache object, no mask function and no config read per call, over a packed sequence: every row's
new tokens side by side, so each weight is read once for all of them. At each layer every row
writes its keys and values into its own cache's buffer (a `GrowingLayer`, in place) and attends
to that buffer's filled part: a decode row (one query: every held position, no mask) or a prompt
piece (a causal mask offset by what its row holds, built once a step). The query heads that share
a key/value head are stacked on the query axis, so the history is read as it is, never repeated.

A sliding-window layer (Mistral's, Qwen2's where it uses one, every other layer of Gemma2) keeps
the library's own `DynamicSlidingWindowLayer`, whose trimming and past-recording
cache_sessions/rollback.py relies on: the step hands it each row's new states through its own
`update` (as the model's forward does) and attends to what it returns, masked to the window.
Gemma2's logit soft-caps (tanh) are applied as its own attention does (SDPA has none), and its
extra norms around attention and the MLP as its layer runs them.

The engine runs this eagerly for any step whose rows it takes, and chat/model_step/compiled.py
compiles the same function for steps of decode rows alone (full attention only): one step, two
ways to run it. A step it does not take (recurrent layers, a quantized cache, another family) runs
the model's own forward, packed (chat/model_step/resident.py) or row by row.

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
from transformers.cache_utils import DynamicSlidingWindowLayer

from cache_sessions.growing import GrowingLayer

PLAIN_FAMILIES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                  "Gemma2ForCausalLM")

Span = tuple[int, int, int]  # a row's (start, end) in the packed sequence, and the positions its cache holds


KNOWN_ATTENTION = ("sdpa", "eager")  # what `_attend` computes: the library's own attention functions


def plain_refusal(model: PreTrainedModel) -> str | None:
    """Why this model's steps do not run as the plain step (None: they do): not one of its
    families, layers or attention it does not compute, or a module it would run past (see
    `bypassed_modules`) that is not the family's own or has a hook."""
    if type(model).__name__ not in PLAIN_FAMILIES:
        return f"{type(model).__name__} is not one of the plain decoders ({', '.join(PLAIN_FAMILIES)})"
    config = model.config
    kinds = set(getattr(config, "layer_types", None) or ())
    if kinds - {"full_attention", "sliding_attention"}:
        return f"it has layers of kinds {sorted(kinds - {'full_attention', 'sliding_attention'})}"
    if getattr(config, "use_bidirectional_attention", False):
        return "its attention is bidirectional"
    if getattr(config, "_attn_implementation", None) not in (None, *KNOWN_ATTENTION):
        return f"its attention is {config._attn_implementation!r}, not one of {', '.join(KNOWN_ATTENTION)}"
    for name, module in bypassed_modules(model):
        own = type(module).forward
        if not type(module).__module__.startswith("transformers.models.") or \
                not getattr(own, "__module__", "").startswith("transformers."):
            return f"{name} is a {type(module).__name__} whose forward the plain step does not know"
    return hook_refusal(bypassed_modules(model))


def bypassed_modules(model: PreTrainedModel) -> list[tuple[str, torch.nn.Module]]:
    """The modules `plain_step` computes the work of without calling them (it calls their parts),
    named: the model, its decoder, each decoder layer and each attention block (those a packed
    step also calls with several rows at once)."""
    core = getattr(model, "model", None)
    modules: list[tuple[str, torch.nn.Module]] = [("the model", model)]
    if isinstance(core, torch.nn.Module):
        modules.append(("its decoder", core))
    for index, layer in enumerate(getattr(core, "layers", None) or ()):
        modules.append((f"decoder layer {index}", layer))
        if isinstance(getattr(layer, "self_attn", None), torch.nn.Module):
            modules.append((f"decoder layer {index}'s attention", layer.self_attn))
    return modules


def hook_refusal(modules: Sequence[tuple[str, torch.nn.Module]]) -> str | None:
    """Why a step that runs past `modules` would not compute what calling them computes: a
    forward hook on one of them (or on every module) would not fire, a forward set on one would
    not run. None: neither. Cheap enough to ask every step (hooks come and go)."""
    from torch.nn.modules import module as torch_module

    if torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks:
        return "a forward hook is registered on every module"
    for name, module in modules:
        if module._forward_hooks or module._forward_pre_hooks:
            return f"a forward hook is registered on {name}"
        if "forward" in module.__dict__:
            return f"{name}'s forward is replaced"
    return None


def layer_windows(model: PreTrainedModel) -> list[int | None]:
    """Each decoder layer's sliding window (None: full attention), as the model's own masks and
    `DynamicCache(config=...)` read its config: Mistral's window is every layer's, Qwen2's and
    Gemma2's layer kinds say which layers have it (Qwen2 clears it unless `use_sliding_window`)."""
    config = model.config
    window = getattr(config, "sliding_window", None)
    layers = config.num_hidden_layers
    if window is None:
        return [None] * layers
    kinds = getattr(config, "layer_types", None) or ["sliding_attention"] * layers
    return [window if kind == "sliding_attention" else None for kind in kinds]


def plain_step(model: PreTrainedModel, tokens: torch.Tensor, positions: torch.Tensor, spans: Sequence[Span],
               keys: Sequence[torch.Tensor | None], values: Sequence[torch.Tensor | None], logits_at: torch.Tensor,
               windows: Sequence[DynamicSlidingWindowLayer | None] = (), alone: Sequence[int] = ()) -> torch.Tensor:
    """`model`'s decoder on the packed `tokens` (at `positions`, both shaped (tokens,)); row r
    feeds `tokens[start:end]` of `spans[r] = (start, end, held)`. At a full-attention layer it
    writes the keys and values at positions held..held + (end - start) of its buffers
    (`keys[r * layers + layer]`, with room for them) and attends to their first held + (end -
    start) positions; at a sliding one it hands them to `windows[r * layers + layer]` and attends
    to what that returns. The logits after the tokens at `logits_at` (indices into `tokens`),
    shaped (len(logits_at), vocab). The last `alone[r]` tokens of row r attend one call each
    (`_attention_calls`)."""
    core, config = model.model, model.config
    layers, windowed = len(core.layers), layer_windows(model)
    hidden = core.embed_tokens(tokens)[None]
    cos, sin = core.rotary_emb(hidden, positions[None])
    masks = _causal_masks(spans, tokens.device)
    window_masks: dict[tuple[int, int], torch.Tensor | None] = {}  # by row and first token of a call
    softcap = getattr(config, "attn_logit_softcapping", None)
    for index, layer in enumerate(core.layers):
        attention, window = layer.self_attn, windowed[index]
        query, key, value = _projections(layer, hidden, cos, sin)
        heads, kv_heads = query.shape[1], key.shape[1]
        groups = heads // kv_heads
        outputs = []
        for row, (start, end, held) in enumerate(spans):
            length, slot = end - start, row * layers + index
            if window is None:
                row_keys, row_values = keys[slot], values[slot]
                row_keys.index_copy_(2, positions[start:end], key[:, :, start:end])
                row_values.index_copy_(2, positions[start:end], value[:, :, start:end])
                kept = held  # states before the row's first token
            else:
                row_keys, row_values = windows[slot].update(key[:, :, start:end], value[:, :, start:end])
                kept = row_keys.shape[2] - length
            for first, width in _attention_calls(length, alone[row] if row < len(alone) else 0):
                since, seen = _call_states(kept, first, width, window)
                if window is None:
                    mask = masks[row] if width == length else None if width == 1 else masks[row][:width, :seen]
                else:
                    if (row, first) not in window_masks:
                        window_masks[row, first] = _window_mask(held + first, width, seen - since, window, tokens.device)
                    mask = window_masks[row, first]
                stacked = query[:, :, start + first:start + first + width].reshape(
                    1, kv_heads, groups * width, attention.head_dim)
                output = _attend(stacked, row_keys[:, :, since:seen], row_values[:, :, since:seen],
                                 None if mask is None else mask.repeat(groups, 1), attention.scaling, softcap)
                outputs.append(output.reshape(heads, width, -1).transpose(0, 1).reshape(width, -1))
        hidden = _feed_forward(layer, hidden, attention.o_proj(torch.cat(outputs)[None]))
    logits = model.lm_head(core.norm(hidden[:, logits_at]))[0]
    final_cap = getattr(config, "final_logit_softcapping", None)
    return logits if final_cap is None else torch.tanh(logits / final_cap) * final_cap


def _projections(layer: torch.nn.Module, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A decoder layer's queries, keys (both rotated) and values for `hidden`, (1, heads, tokens,
    head_dim) each, as its attention's own forward makes them (Qwen3's q/k norms included)."""
    attention = layer.self_attn
    rotate = sys.modules[type(attention).__module__].apply_rotary_pos_emb
    normed = layer.input_layernorm(hidden)
    shape = (1, hidden.shape[1], -1, attention.head_dim)
    query, key = attention.q_proj(normed).view(shape), attention.k_proj(normed).view(shape)
    if hasattr(attention, "q_norm"):
        query, key = attention.q_norm(query), attention.k_norm(key)
    value = attention.v_proj(normed).view(shape).transpose(1, 2)
    query, key = rotate(query.transpose(1, 2), key.transpose(1, 2), cos, sin)
    return query, key, value


def _feed_forward(layer: torch.nn.Module, hidden: torch.Tensor, mixed: torch.Tensor) -> torch.Tensor:
    """The rest of a decoder layer after its attention's output `mixed`: the residuals and the MLP
    (Gemma2: a norm after attention, two around the MLP)."""
    if hasattr(layer, "pre_feedforward_layernorm"):
        hidden = hidden + layer.post_attention_layernorm(mixed)
        return hidden + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(hidden)))
    hidden = hidden + mixed
    return hidden + layer.mlp(layer.post_attention_layernorm(hidden))


def _attention_calls(length: int, alone: int) -> list[tuple[int, int]]:
    """A row's attention calls, (first token, tokens) within the row: its tokens but the last
    `alone` together, then each of those by itself, over the states up to it, as a decode row of
    its own would. The step then gives those tokens (a decode row's last input and its guesses)
    the bits decoding them one step at a time gives, where every other operation gives a row the
    same bits whatever rows are beside it (int8 weights: chat/model_step/runner.py). One call for the row
    rounds another way (SDPA's kernel blocks the queries otherwise), and with bf16 products a
    near-tie then goes the other way."""
    together = length - alone
    return ([(0, together)] if together else []) + [(first, 1) for first in range(together, length)]


def _call_states(kept: int, first: int, width: int, window: int | None) -> tuple[int, int]:
    """Which of a layer's states (after the row's update; `kept` of them before its first token)
    a call of `width` tokens from the row's `first` attends to, as (since, seen): up to its last
    query, and at a sliding layer from where that layer would hold them then (window - 1 states
    kept after each update; a call from the row's start reads all it returned, as before)."""
    seen = kept + first + width
    since = max(0, kept + first - (window - 1)) if window is not None and first else 0
    return since, seen


def _causal_masks(spans: Sequence[Span], device: torch.device) -> list[torch.Tensor | None]:
    """Each row's mask at a full-attention layer: a prompt piece's query i sees the held
    positions and its own up to i; a decode row (one query) sees everything (None)."""
    masks: list[torch.Tensor | None] = []
    for start, end, held in spans:
        if end - start == 1:
            masks.append(None)
        else:
            seen = torch.arange(held + end - start, device=device)
            masks.append(seen[None, :] <= seen[held:, None])
    return masks


def _window_mask(held: int, length: int, stored: int, window: int, device: torch.device) -> torch.Tensor | None:
    """Which of the `stored` states a sliding layer returned (the last ones up to position held +
    length) each of the row's `length` queries sees: its own position and before, fewer than
    `window` back (the model's own sliding mask). None where every query sees every state."""
    if length == 1 and stored <= window:
        return None
    query = torch.arange(held, held + length, device=device)[:, None]
    key = torch.arange(held + length - stored, held + length, device=device)[None, :]
    return (key <= query) & (query - key < window)


def _attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
            scale: float, softcap: float | None) -> torch.Tensor:
    """Attention of the stacked queries to one row's states; with Gemma2's soft-cap (the scores
    through tanh before the mask and a float32 softmax), as its own attention computes it."""
    if softcap is None:
        return torch.nn.functional.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale)
    scores = torch.tanh(torch.matmul(query, keys.transpose(2, 3)) * scale / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype), values)


def takes_states(sessions: Sequence[Any]) -> bool:
    """Whether every layer of these sessions holds what its ledger says in a form the step
    reads: a full-attention buffer it writes in place, or the library's own sliding window (a
    layer not started yet is started by the step)."""
    return all(type(layer) in (GrowingLayer, DynamicSlidingWindowLayer)
               and (layer.get_seq_length() if layer.is_initialized else 0) == len(session.token_ids)
               for session in sessions for layer in session.cache.layers)


def row_inputs(model: PreTrainedModel, rows: Sequence[tuple[Any, Sequence[int]]]) -> tuple[
        list[int], list[int], list[Span], list[torch.Tensor | None], list[torch.Tensor | None], list[Any]]:
    """`plain_step`'s tokens, positions, spans, buffers and sliding windows for these rows
    (sessions and what each feeds), every buffer grown to take its row's tokens; full-attention
    layers not started yet are started empty (a sliding one starts at its first update)."""
    tokens: list[int] = []
    positions: list[int] = []
    spans: list[Span] = []
    keys: list[torch.Tensor | None] = []
    values: list[torch.Tensor | None] = []
    windows: list[Any] = []
    windowed = layer_windows(model)
    for session, fed in rows:
        if not fed:
            raise ValueError("every row of a packed step feeds at least one token")
        held = len(session.token_ids)
        spans.append((len(tokens), len(tokens) + len(fed), held))
        tokens.extend(fed)
        positions.extend(range(held, held + len(fed)))
        for layer_index, (layer, window) in enumerate(zip(session.cache.layers, windowed, strict=True)):
            if window is not None:
                if not isinstance(layer, DynamicSlidingWindowLayer) or layer.sliding_window != window:
                    raise ValueError(f"layer {layer_index} slides over {window} positions; its cache layer does not")
                keys.append(None), values.append(None), windows.append(layer)
                continue
            if not layer.is_initialized:
                empty = _empty_states(model, layer_index)
                layer.update(empty, empty)
            key_buffer, value_buffer = layer.room_for(held + len(fed))
            keys.append(key_buffer), values.append(value_buffer), windows.append(None)
    return tokens, positions, spans, keys, values, windows


def _empty_states(model: PreTrainedModel, layer_index: int) -> torch.Tensor:
    attention = model.model.layers[layer_index].self_attn
    heads = model.config.num_key_value_heads
    return torch.empty(1, heads, 0, attention.head_dim, dtype=model.dtype, device=model.device)


def logit_places(spans: Sequence[Sequence[int]], logits_of: Sequence[int], tails: Sequence[int] | None = None
                 ) -> list[int]:
    """Where in a packed step's sequence its logits are read: after every token of the rows
    `logits_of` (indices into the rows, each `spans[r]` starting and ending its tokens), in that
    order, or with `tails` only after the last `tails[n]` tokens of the nth of them (a row that
    feeds the rest of its prompt with its first decode input wants one: the head's product over
    the whole vocabulary is a step's largest at a real vocabulary)."""
    places = []
    for number, index in enumerate(logits_of):
        start, end = spans[index][0], spans[index][1]
        places.extend(range(start if tails is None else max(start, end - tails[number]), end))
    return places


@torch.no_grad()
def run_plain(model: PreTrainedModel, rows: Sequence[tuple[Any, Sequence[int]]], logits_of: Sequence[int],
              tails: Sequence[int] | None = None, alone: Sequence[int] = ()) -> torch.Tensor:
    """Feed each session its tokens through `plain_step` (rows whose states `takes_states`); the
    logits `logit_places` reads, in that order, as `forward_rows` returns them; each row's last
    `alone[r]` tokens attend one by one (`plain_step`). The ledgers are the caller's; if this
    raises, a row's buffers may hold part of the step past what they say they hold (nothing
    reads it)."""
    tokens, positions, spans, keys, values, windows = row_inputs(model, rows)
    wanted = logit_places(spans, logits_of, tails)
    device = model.device
    logits = plain_step(model, torch.tensor(tokens, device=device), torch.tensor(positions, device=device), spans,
                        keys, values, torch.tensor(wanted, dtype=torch.long, device=device), windows, alone)
    for (session, fed), (_, _, held) in zip(rows, spans):
        for layer in session.cache.layers:
            if isinstance(layer, GrowingLayer):
                layer.filled(held + len(fed))
    return logits
