"""One conversation's decode step as one compiled graph, reading its states in place (issue #31).

An eager decode step at Qwen3-0.6B's shape on a CPU is a few thousand small operations whose
dispatch costs as much as the matrix products (docs/performance.md). This module writes the
step of the plain decoder families (Llama, Qwen2, Qwen3: full attention, one token) as one
function of the model's own modules, gpt-fast's way: no cache object, no mask, no config read
at run time, so `torch.compile` traces it whole (`fullgraph=True`) and inductor fuses the norms,
rotary embedding, residual adds and the int8 layers' input rounding around the products.

The states stay where they are: each full-attention layer of the session is a `GrowingLayer`,
whose buffer (with room past the filled positions) goes in as it is; the step writes the new
token's keys and values into it (`index_copy_`, done in place by inductor) and attends to the
filled part. Shapes are symbolic (`dynamic=True`): one graph serves every history length and
every buffer capacity, so compiles stay at one per process (counted in `/status`).

It runs only when one conversation decodes alone (`takes`): several rows or prompt pieces go
through the packed eager forward (cache_sessions/resident.py), the step every test holds exact.

Exactness: the same operations as the eager forward on the same states, in another order of
floating-point sums (fused kernels), so logits differ by float noise (measured in
tests/test_compiled.py against a from-scratch forward); greedy replies can differ where two
tokens' logits are that close. docs/performance.md states what exact means per mode.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import Any, Callable, Sequence

import torch
from transformers import PreTrainedModel

from cache_sessions.growing import GrowingLayer

COMPILE_MODES = ("auto", "on", "off")
PLAIN_DECODERS = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
# `auto` compiles from this size up: measured slower on the 33.6 M benchmark model, faster at
# Qwen3-0.6B's shape (docs/performance.md, "One compiled step").
AUTO_MIN_PARAMETERS = 200_000_000

log = logging.getLogger(__name__)


def check_compile_mode(mode: str) -> None:
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile is one of {', '.join(COMPILE_MODES)}, not {mode!r}")


def compile_refusal(model: PreTrainedModel) -> str | None:
    """Why this model's decode step is not compiled here (None: it can be)."""
    if type(model).__name__ not in PLAIN_DECODERS:
        return f"{type(model).__name__} is not one of the plain decoders ({', '.join(PLAIN_DECODERS)})"
    config = model.config
    if getattr(config, "use_sliding_window", False) or any(
            kind != "full_attention" for kind in getattr(config, "layer_types", None) or ()):
        return "it has sliding-window layers"
    if model.device.type != "cpu":
        return "only the CPU step is compiled and measured (a GPU wants CUDA graphs)"
    return None


class CompiledDecode:
    """The compiled step of one model, compiled on a thread of its own (`start`) while the loop
    serves eager steps; the loop uses it (`takes`, `step`) once it is ready."""

    def __init__(self, model: PreTrainedModel, mode: str = "auto"):
        check_compile_mode(mode)
        self.model, self.mode = model, mode
        refusal = compile_refusal(model)
        parameters = sum(parameter.numel() for parameter in model.parameters())
        if mode == "off":
            self.reason = "off"
        elif refusal is not None:
            self.reason = refusal
        elif mode == "auto" and parameters < AUTO_MIN_PARAMETERS:
            self.reason = f"auto: {parameters / 1e6:.1f} M parameters, compiled from {AUTO_MIN_PARAMETERS / 1e6:.0f} M"
        else:
            self.reason = None
        self.enabled = self.reason is None
        self.compile_s, self.error, self.steps = None, None, 0
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self._compiled = torch.compile(self._forward, dynamic=True, fullgraph=True)

    # ---- what the loop reads ---------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    def takes(self, rows: Sequence[tuple[Any, Sequence[int]]], logits_of: Sequence[int]) -> bool:
        """Whether this step is one conversation decoding alone, on states the graph reads."""
        if not self.ready or len(rows) != 1 or len(rows[0][1]) != 1 or list(logits_of) != [0]:
            return False
        session = rows[0][0]
        held = len(session.token_ids)
        return held > 1 and all(isinstance(layer, GrowingLayer) and layer.is_initialized
                                and layer.get_seq_length() == held for layer in session.cache.layers)

    @torch.no_grad()
    def step(self, session: Any, token_id: int) -> torch.Tensor | None:
        """Feed `token_id` to `session`'s cache; the logits after it, shaped (1, vocab). The
        ledger is the caller's (as with `forward_rows`). None, with nothing fed, where the graph
        would have to be compiled again: that would stall every user for a minute on the loop,
        so the step stays eager from then on (and `/status` says why)."""
        held = len(session.token_ids)
        keys, values = zip(*(layer.room_for(held + 1) for layer in session.cache.layers))
        device = self.model.device
        try:
            with torch.compiler.set_stance("fail_on_recompile"):  # refused before anything runs
                logits = self._compiled(torch.tensor([[token_id]], device=device),
                                        torch.tensor([held], device=device), held + 1, list(keys), list(values))
        except RuntimeError as error:
            if "recompile" not in str(error):
                raise
            self.error, self.enabled = f"a step would have compiled again: {error}"[:500], False
            self._ready.clear()
            log.warning("decode step back to eager: %s", self.error)
            return None
        for layer in session.cache.layers:
            layer.filled(held + 1)
        self.steps += 1
        return logits

    def stats(self) -> dict[str, Any]:
        """For `/status`: whether it is used, and what compiling cost."""
        return {"mode": self.mode, "enabled": self.enabled, "ready": self.ready, "graphs": self.graphs(),
                "steps": self.steps,
                "compile_s": None if self.compile_s is None else round(self.compile_s, 1),
                "not_compiled_because": self.reason or self.error}

    # ---- compiling beside the loop ---------------------------------------------------------------
    def start(self) -> None:
        """Compile on a thread of its own (the loop serves eager steps meanwhile), with inductor's
        on-disk cache in the app's cache folder unless one was chosen (TORCHINDUCTOR_CACHE_DIR), so
        a restart builds the graph from it in seconds."""
        if not self.enabled or self._thread is not None:
            return
        cache_home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(cache_home, "rewind-chat", "inductor"))
        self._thread = threading.Thread(target=self.warm, name="compile-decode-step", daemon=True)
        self._thread.start()

    def wait(self, timeout: float | None = None) -> bool:
        return self._ready.wait(timeout)

    @torch.no_grad()
    def warm(self) -> None:
        """Compile by running the step on scratch buffers at two lengths (the second checks that a
        new length and capacity reuse the graph)."""
        started = time.perf_counter()
        try:
            # lengths and capacities equal to no size of the model: a size that matched one would
            # be traced as that size (dynamo's duck sizing), and a later step recompile
            for length, capacity in ((37, 91), (53, 133)):
                keys, values = self._scratch(capacity)
                token = torch.zeros(1, 1, dtype=torch.long, device=self.model.device)
                self._compiled(token, torch.tensor([length - 1], device=self.model.device), length, keys, values)
        except Exception as error:  # an eager engine is still a working one: say why, go on eager
            self.error = f"compiling failed: {type(error).__name__}: {error}"[:500]
            self.enabled = False
            log.warning("decode step not compiled: %s", self.error)
            return
        self.compile_s = time.perf_counter() - started
        log.info("decode step compiled in %.1f s", self.compile_s)
        print(f"rewind-chat: decode step compiled in {self.compile_s:.1f} s", flush=True)
        self._ready.set()

    def _scratch(self, capacity: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        config, layers = self.model.config, self.model.model.layers
        heads = config.num_key_value_heads
        shape = (1, heads, capacity, layers[0].self_attn.head_dim)
        make: Callable[[], torch.Tensor] = lambda: torch.zeros(shape, dtype=self.model.dtype, device=self.model.device)
        return [make() for _ in layers], [make() for _ in layers]

    @staticmethod
    def graphs() -> int:
        """Graphs compiled for the step in this process (dynamo's cache entries for its code: one
        a guard set, so a new one is a recompile; several engines in one process share the count)."""
        if not hasattr(torch._dynamo.eval_frame, "_debug_get_cache_entry_list"):
            return -1  # this torch no longer says
        return len(torch._dynamo.eval_frame._debug_get_cache_entry_list(CompiledDecode._forward.__code__))

    # ---- the step --------------------------------------------------------------------------------
    def _forward(self, token: torch.Tensor, position: torch.Tensor, length: int, keys: list[torch.Tensor],
                 values: list[torch.Tensor]) -> torch.Tensor:
        """The model's decoder on one token at `position`, each layer writing its keys and values
        at `position` of its buffer and attending to the first `length` positions. The query heads
        that share a key/value head are stacked on the query axis (one query sees every held
        position, so no mask), as cache_sessions/resident.py's `_grouped_sdpa` does."""
        core = self.model.model
        hidden = core.embed_tokens(token)
        cos, sin = core.rotary_emb(hidden, position.view(1, 1))
        for index, layer in enumerate(core.layers):
            attention = layer.self_attn
            rotate = sys.modules[type(attention).__module__].apply_rotary_pos_emb
            normed = layer.input_layernorm(hidden)
            shape = (1, 1, -1, attention.head_dim)
            query, key = attention.q_proj(normed).view(shape), attention.k_proj(normed).view(shape)
            if hasattr(attention, "q_norm"):
                query, key = attention.q_norm(query), attention.k_norm(key)
            value = attention.v_proj(normed).view(shape).transpose(1, 2)
            query, key = rotate(query.transpose(1, 2), key.transpose(1, 2), cos, sin)
            keys[index].index_copy_(2, position, key)
            values[index].index_copy_(2, position, value)
            kv_heads = key.shape[1]
            out = torch.nn.functional.scaled_dot_product_attention(
                query.reshape(1, kv_heads, -1, attention.head_dim), keys[index][:, :, :length],
                values[index][:, :, :length], scale=attention.scaling)
            hidden = hidden + attention.o_proj(out.reshape(1, 1, -1))
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return self.model.lm_head(core.norm(hidden))[:, -1]
