"""Decode steps as compiled graphs, reading each conversation's states in place (issue #31).

An eager decode step at Qwen3-0.6B's shape on a CPU is a few thousand small operations whose
dispatch costs as much as the matrix products (docs/performance.md). This module writes the
step of the plain decoder families (Llama, Qwen2, Qwen3: full attention, one token) as one
function of the model's own modules, gpt-fast's way: no cache object, no mask, no config read
at run time, so `torch.compile` traces it whole (`fullgraph=True`) and inductor may fuse what
lies between the products (norms, rotary embedding, residual adds, the int8 layers' rounding).

The states stay where they are: each full-attention layer of a session is a `GrowingLayer`,
whose buffer (with room past the filled positions) goes in as it is; the step writes the new
token's keys and values into it (`index_copy_`, done in place by inductor) and attends to the
filled part. Shapes are symbolic (`dynamic=True`): one graph serves every history length and
every buffer capacity. The row count is not: a graph decodes 1, 2, 4 or 8 rows (a step of 3
takes the 4-row graph with an idle row on scratch buffers), so compiles stay at one a bucket
(counted in `/status`), built one row first.

Steps with prompt pieces, or more rows than the largest bucket, go through the packed eager
forward (cache_sessions/resident.py).

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

# Held while a graph is built and while a step runs a built one, in this process: a step refuses
# to compile by setting dynamo's stance, which is global, so it must never overlap a build.
_GRAPHS = threading.Lock()


def check_compile_mode(mode: str) -> None:
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile is one of {', '.join(COMPILE_MODES)}, not {mode!r}")


def compile_refusal(model: PreTrainedModel, auto: bool = False) -> str | None:
    """Why this model's decode steps are not compiled here (None: they are); `auto`: by `auto`'s rule."""
    # int8 layers hold their weights as buffers (chat/weights.py): count those too
    parameters = sum(tensor.numel() for tensor in (*model.parameters(), *model.buffers()))
    if auto and parameters < AUTO_MIN_PARAMETERS:
        return f"auto: {parameters / 1e6:.1f} M parameters, compiled from {AUTO_MIN_PARAMETERS / 1e6:.0f} M"
    if type(model).__name__ not in PLAIN_DECODERS:
        return f"{type(model).__name__} is not one of the plain decoders ({', '.join(PLAIN_DECODERS)})"
    config = model.config
    if getattr(config, "use_sliding_window", False) or any(
            kind != "full_attention" for kind in getattr(config, "layer_types", None) or ()):
        return "it has sliding-window layers"
    if model.device.type != "cpu":
        return "only the CPU step is compiled and measured (a GPU wants CUDA graphs)"
    return None


def decode_rows(model: PreTrainedModel, tokens: torch.Tensor, positions: torch.Tensor, lengths: list[int],
                keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
    """The step every graph is compiled from: `model`'s decoder on one token for each row (a
    batch of `len(lengths)`), each layer of row r writing its keys and values at `positions[r]` of
    that row's buffer (`keys[r * layers + layer]`) and attending to its first `lengths[r]`
    positions. The query heads that share a key/value head are stacked on the query axis (one
    query sees every held position, so no mask), as cache_sessions/resident.py's `_grouped_sdpa`
    does."""
    core = model.model
    rows, layers = len(lengths), len(core.layers)
    hidden = core.embed_tokens(tokens)
    cos, sin = core.rotary_emb(hidden, positions.view(rows, 1))
    for index, layer in enumerate(core.layers):
        attention = layer.self_attn
        rotate = sys.modules[type(attention).__module__].apply_rotary_pos_emb
        normed = layer.input_layernorm(hidden)
        shape = (rows, 1, -1, attention.head_dim)
        query, key = attention.q_proj(normed).view(shape), attention.k_proj(normed).view(shape)
        if hasattr(attention, "q_norm"):
            query, key = attention.q_norm(query), attention.k_norm(key)
        value = attention.v_proj(normed).view(shape).transpose(1, 2)
        query, key = rotate(query.transpose(1, 2), key.transpose(1, 2), cos, sin)
        kv_heads, outputs = key.shape[1], []
        for row in range(rows):
            row_keys, row_values = keys[row * layers + index], values[row * layers + index]
            row_keys.index_copy_(2, positions[row:row + 1], key[row:row + 1])
            row_values.index_copy_(2, positions[row:row + 1], value[row:row + 1])
            outputs.append(torch.nn.functional.scaled_dot_product_attention(
                query[row:row + 1].reshape(1, kv_heads, -1, attention.head_dim),
                row_keys[:, :, :lengths[row]], row_values[:, :, :lengths[row]], scale=attention.scaling))
        hidden = hidden + attention.o_proj(torch.cat(outputs).reshape(rows, 1, -1))
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    return model.lm_head(core.norm(hidden))[:, -1]


def compiled_graphs() -> int:
    """Graphs compiled from `decode_rows` in this process (dynamo's cache entries for its code:
    one a guard set, so one a bucket, and any more a recompile; engines in one process share them)."""
    if not hasattr(torch._dynamo.eval_frame, "_debug_get_cache_entry_list"):
        return -1  # this torch no longer says
    return len(torch._dynamo.eval_frame._debug_get_cache_entry_list(decode_rows.__code__))


ROW_BUCKETS = (1, 2, 4, 8)  # rows a graph decodes; a step of 3 takes the 4-row graph with one idle row
_IDLE_LENGTH, _IDLE_CAPACITY = 5, 11  # an idle row's (sizes no model has: see `warm`)
# Warm-up lengths of the real rows, and their capacities: distinct from each other, from the idle
# row's and from every size of a model, since dynamo traces two equal sizes as one (duck sizing)
# and a later step where they differ would compile again.
_WARM_LENGTHS = ((37, 41, 43, 47, 53, 59, 61, 67), (71, 73, 79, 83, 89, 97, 101, 103))
_WARM_SPARE = (54, 56)


class CompiledDecode:
    """The compiled steps of one model (a graph per row bucket), compiled on a thread of their own
    (`start`) while the loop serves eager steps; the loop uses each (`takes`, `step`) once ready."""

    def __init__(self, model: PreTrainedModel, mode: str = "auto", max_rows: int = 1):
        check_compile_mode(mode)
        self.model, self.mode = model, mode
        self.reason = "off" if mode == "off" else compile_refusal(model, auto=mode == "auto")
        self.enabled = self.reason is None
        # the buckets up to the first that holds `max_rows` (more rows than the largest: eager)
        self.buckets = (tuple(b for b in ROW_BUCKETS if b < max_rows)
                        + tuple(b for b in ROW_BUCKETS if b >= max_rows)[:1])
        self.compile_s: dict[int, float] = {}
        self.error, self.steps = None, 0
        self._ready_rows: set[int] = set()
        self._all_ready = threading.Event()
        if not self.enabled:  # nothing will be compiled: `wait` returns at once
            self._all_ready.set()
        self._idle: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []
        self._thread: threading.Thread | None = None
        self._compiled = torch.compile(decode_rows, dynamic=True, fullgraph=True)

    # ---- what the loop reads ---------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        """Whether a conversation decoding alone runs compiled now."""
        return self.enabled and 1 in self._ready_rows

    def bucket(self, rows: int) -> int | None:
        """The graph a step of `rows` decode rows takes, if it is ready."""
        bucket = next((b for b in self.buckets if b >= rows), None)
        return bucket if self.enabled and bucket in self._ready_rows else None

    def takes(self, rows: Sequence[tuple[Any, Sequence[int]]], logits_of: Sequence[int]) -> bool:
        """Whether this step is decode rows only, as many as a ready graph holds, each on states
        the graph reads (every full-attention layer a grown-in-place buffer)."""
        if not rows or self.bucket(len(rows)) is None or list(logits_of) != list(range(len(rows))):
            return False
        sessions = [session for session, _ in rows]
        if len({id(session) for session in sessions}) != len(sessions) or any(len(fed) != 1 for _, fed in rows):
            return False
        return all(len(session.token_ids) > 1 and all(
            isinstance(layer, GrowingLayer) and layer.is_initialized
            and layer.get_seq_length() == len(session.token_ids) for layer in session.cache.layers)
            for session in sessions)

    @torch.no_grad()
    def step(self, rows: Sequence[tuple[Any, Sequence[int]]]) -> torch.Tensor | None:
        """Feed each session its one token (rows `takes` accepted); the logits after each, shaped
        (rows, vocab). The ledgers are the caller's (as with `forward_rows`). None, with nothing
        fed, while another graph is being built (this step runs eager), or where the graph would
        have to be compiled again: that would stall every user for a minute on the loop, so the
        steps stay eager from then on (and `/status` says why)."""
        bucket = self.bucket(len(rows))
        assert bucket is not None
        if not _GRAPHS.acquire(blocking=False):
            return None
        try:
            return self._step(rows, bucket)
        finally:
            _GRAPHS.release()

    def _step(self, rows: Sequence[tuple[Any, Sequence[int]]], bucket: int) -> torch.Tensor | None:
        tokens, positions, lengths, keys, values = [], [], [], [], []
        for session, fed in rows:
            held = len(session.token_ids)
            tokens.append(fed[0])
            positions.append(held)
            lengths.append(held + 1)
            for layer in session.cache.layers:
                key_buffer, value_buffer = layer.room_for(held + 1)
                keys.append(key_buffer)
                values.append(value_buffer)
        for idle_keys, idle_values in self._idle[: bucket - len(rows)]:
            tokens.append(0)
            positions.append(_IDLE_LENGTH - 1)
            lengths.append(_IDLE_LENGTH)
            keys.extend(idle_keys)
            values.extend(idle_values)
        device = self.model.device
        try:
            with torch.compiler.set_stance("fail_on_recompile"):  # refused before anything runs
                logits = self._compiled(self.model, torch.tensor(tokens, device=device).view(-1, 1),
                                        torch.tensor(positions, device=device), lengths, keys, values)
        except RuntimeError as error:
            if "recompile" not in str(error):
                raise
            self.error, self.enabled = f"a step would have compiled again: {error}"[:500], False
            log.warning("decode steps back to eager: %s", self.error)
            return None
        for session, _ in rows:
            for layer in session.cache.layers:
                layer.filled(len(session.token_ids) + 1)
        self.steps += 1
        return logits[: len(rows)]

    def stats(self) -> dict[str, Any]:
        """For `/status`: whether it is used, and what compiling cost."""
        return {"mode": self.mode, "enabled": self.enabled, "ready": self.ready,
                "rows_compiled": sorted(self._ready_rows) if self.enabled else [], "graphs": compiled_graphs(),
                "steps": self.steps, "compile_s": round(sum(self.compile_s.values()), 1) if self.compile_s else None,
                "not_compiled_because": self.reason or self.error}

    # ---- compiling beside the loop ---------------------------------------------------------------
    def start(self) -> None:
        """Compile on a thread of its own (the loop serves eager steps meanwhile), one row first,
        with inductor's on-disk cache in the app's cache folder unless one was chosen
        (TORCHINDUCTOR_CACHE_DIR), so a restart builds the graphs from it in seconds."""
        if not self.enabled or self._thread is not None:
            return
        cache_home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(cache_home, "rewind-chat", "inductor"))
        self._thread = threading.Thread(target=self.warm, name="compile-decode-step", daemon=True)
        self._thread.start()

    def wait(self, timeout: float | None = None) -> bool:
        """Until every bucket is compiled (or compiling failed); whether they all were."""
        self._all_ready.wait(timeout)
        return self.enabled and set(self.buckets) <= self._ready_rows

    @torch.no_grad()
    def warm(self) -> None:
        """Compile each bucket by running it on scratch buffers twice (the second, at other lengths
        and capacities, checks they reuse the graph)."""
        try:
            self._idle = [self._scratch(_IDLE_CAPACITY) for _ in range(max(self.buckets) - 1)]
            for bucket in self.buckets:
                started = time.perf_counter()
                with _GRAPHS:
                    self._build(bucket)
                self.compile_s[bucket] = time.perf_counter() - started
                self._ready_rows.add(bucket)
                log.info("decode step of %d row(s) compiled in %.1f s", bucket, self.compile_s[bucket])
                print(f"rewind-chat: decode step of {bucket} row{'s' if bucket > 1 else ''} compiled in "
                      f"{self.compile_s[bucket]:.1f} s", flush=True)
        except Exception as error:  # an eager engine is still a working one: say why, go on eager
            self.error = f"compiling failed: {type(error).__name__}: {error}"[:500]
            self.enabled = False
            log.warning("decode step not compiled: %s", self.error)
        finally:
            self._all_ready.set()

    def _build(self, bucket: int) -> None:
        """Run the `bucket`-row graph on scratch buffers twice: the first call builds it, the
        second (other lengths and capacities) checks it is reused."""
        device = self.model.device
        for lengths, spare in zip(_WARM_LENGTHS, _WARM_SPARE):
            lengths = list(lengths[:bucket])
            keys, values = [], []
            for length in lengths:
                row_keys, row_values = self._scratch(length + spare)
                keys.extend(row_keys)
                values.extend(row_values)
            self._compiled(self.model, torch.zeros(bucket, 1, dtype=torch.long, device=device),
                           torch.tensor([length - 1 for length in lengths], device=device), lengths, keys, values)

    def _scratch(self, capacity: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        config, layers = self.model.config, self.model.model.layers
        shape = (1, config.num_key_value_heads, capacity, layers[0].self_attn.head_dim)
        make: Callable[[], torch.Tensor] = lambda: torch.zeros(shape, dtype=self.model.dtype, device=self.model.device)
        return [make() for _ in layers], [make() for _ in layers]
