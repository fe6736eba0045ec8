"""Decode steps as compiled graphs, reading each conversation's states in place.

An eager decode step at Qwen3-0.6B's shape on a CPU is a few thousand small operations whose
dispatch costs as much as the matrix products (docs/performance.md). The step of the plain
decoder families is one function of the model's own modules (chat/model_step/plain_step.py,
gpt-fast's way: no cache object, no config read at run time), the one the engine also runs
eagerly; this compiles it for steps of decode rows alone, so `torch.compile` traces it whole
(`fullgraph=True`) and inductor may fuse what lies between the products (norms, rotary
embedding, residual adds, the int8 layers' rounding).

The states stay where they are: each full-attention layer of a session is a `GrowingLayer`,
whose buffer (with room past the filled positions) goes in as it is; the step writes the new
token's keys and values into it (`index_copy_`, done in place by inductor) and attends to the
filled part. Shapes are symbolic (`dynamic=True`): one graph serves every history length and
every buffer capacity. The row count is not: a graph decodes 1, 2, 4 or 8 rows (a step of 3
takes the 4-row graph with an idle row on scratch buffers), so compiles stay at one a bucket
(counted in `/status`), built one row first.

Each graph is compiled ahead of time (dynamo's `aot_compile`) and saved in the app's cache folder
under a key of everything it was traced from (torch, the model's config and dtype, the source of
every module class it calls, this file): a restart loads it in seconds instead of tracing 28
layers again (most of a minute at Qwen3-0.6B's shape even with inductor's on-disk cache). A
loaded graph checks its guards at every call as a compiled one does; a graph that will not load
is compiled again.

Steps with prompt pieces, or more rows than the largest bucket, run the same step eagerly
(chat/model_step/runner.py).

Exactness: the same operations as the eager forward on the same states, in another order of
floating-point sums (fused kernels), so logits differ by float noise (measured in
tests/test_compiled.py against a from-scratch forward); greedy replies can differ where two
tokens' logits are that close. docs/performance.md states what exact means per mode.
"""

from __future__ import annotations

import hashlib
import inspect
import io
import json
import logging
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import transformers
from transformers import PreTrainedModel

from chat.model_step.plain_step import layer_windows, plain_refusal, plain_step, takes_states
from cache_sessions.sealed import Sealer, UntrustedFolder, private_folder

COMPILE_MODES = ("auto", "on", "off")
# `auto` compiles from this size up: measured slower on the 33.6 M benchmark model, faster at
# Qwen3-0.6B's shape (docs/performance.md, "One compiled step").
AUTO_MIN_PARAMETERS = 200_000_000

log = logging.getLogger(__name__)

# The compiling thread's nice value: it takes what the steps leave of the CPU, so users decode at
# eager speed while graphs build instead of sharing the cores with the compiler
# (benchmarks/cold_start.py measures both). 0: it competes as an equal.
COMPILE_NICE = 19

# Held while a graph is built or loaded: one at a time in this process (dynamo's configuration is
# global). Steps do not take it: a graph compiled ahead of time runs without dynamo, so the
# one-row graph serves while the larger ones are still being built.
_BUILDING = threading.Lock()


def check_compile_mode(mode: str) -> None:
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile is one of {', '.join(COMPILE_MODES)}, not {mode!r}")


def compile_refusal(model: PreTrainedModel, auto: bool = False) -> str | None:
    """Why this model's decode steps are not compiled here (None: they are); `auto`: by `auto`'s rule."""
    # int8 layers hold their weights as buffers (chat/model_step/weights.py): count those too
    parameters = sum(tensor.numel() for tensor in (*model.parameters(), *model.buffers()))
    if auto and parameters < AUTO_MIN_PARAMETERS:
        return f"auto: {parameters / 1e6:.1f} M parameters, compiled from {AUTO_MIN_PARAMETERS / 1e6:.0f} M"
    refusal = plain_refusal(model)
    if refusal is not None:
        return refusal
    if any(window is not None for window in layer_windows(model)) or type(model).__name__ == "Gemma2ForCausalLM":
        return "compiled for full-attention Llama, Mistral, Qwen2 and Qwen3 only (a sliding window's states are not buffers)"
    if model.device.type != "cpu":
        return "only the CPU step is compiled and measured (a GPU wants CUDA graphs)"
    return None


def decode_inputs(model: PreTrainedModel, tokens: list[int], positions: list[int], keys: list[torch.Tensor],
                  values: list[torch.Tensor]) -> tuple:
    """`plain_step`'s arguments for a step of decode rows: row r feeds `tokens[r]` at `positions[r]`
    (what its buffers hold), and every row's logits are kept."""
    device, rows = model.device, len(tokens)
    return (model, torch.tensor(tokens, device=device), torch.tensor(positions, device=device),
            [(row, row + 1, held) for row, held in enumerate(positions)], keys, values,
            torch.arange(rows, device=device))


def _saved_guards(guards: Sequence[Any]) -> list[bool]:
    """The guards a saved graph keeps: dynamo's own choice for a saved graph (none on globals or
    on object identity), less those on oneDNN-packed weights (chat/model_step/weights.py), which it cannot
    write down; their shapes are in the graph's key (the model's config and weights format)."""
    from torch._dynamo.guards import CheckFunctionManager

    unsaved = CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES
    return [not (guard.is_global or guard.guard_type in unsaved
                 or (isinstance(guard.value, torch.Tensor) and guard.value.is_mkldnn)) for guard in guards]


def default_store() -> Path:
    """Where compiled graphs are kept between runs: the app's cache folder (chat/host.py puts
    inductor's cache beside it, before torch loads)."""
    cache_home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache_home) / "rewind-chat" / "compiled-steps"


def trusted_inductor_cache() -> str | None:
    """Keep inductor's cache (kernels it loads and runs) out of reach of other users: its folder
    made or checked private, else a fresh private one for this process. Why it moved, if it did."""
    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if chosen is None:
        return None
    try:
        private_folder(Path(chosen))
        return None
    except (UntrustedFolder, OSError) as error:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="rewind-chat-inductor-")  # 0700
        log.warning("inductor's cache moved to %s for this process: %s", os.environ["TORCHINDUCTOR_CACHE_DIR"], error)
        return f"{type(error).__name__}: {error}"


def graph_key(model: PreTrainedModel, rows: int) -> str:
    """What a saved graph was traced from, hashed: a graph is loaded only by a process that would
    trace the same one (same torch, transformers and CPU kind; same config, dtype and weights
    format; the same source of `plain_step` and of every module class the model is made of)."""
    config = json.loads(model.config.to_json_string(use_diff=False))
    for unread in ("_name_or_path", "transformers_version", "torch_dtype", "dtype"):
        config.pop(unread, None)
    sources = []
    for kind in sorted({type(module) for module in model.modules()} | {type(model)}, key=lambda k: k.__qualname__):
        try:
            sources.append((kind.__qualname__, Path(inspect.getfile(kind)).read_bytes()))
        except (OSError, TypeError):  # a class with no file: its name only
            sources.append((kind.__qualname__, b""))
    digest = hashlib.sha256()
    for part in (torch.__version__, transformers.__version__, sys.version, torch.backends.cpu.get_cpu_capability(),
                 str(model.dtype), json.dumps(config, sort_keys=True), str(rows), Path(__file__).read_bytes(),
                 Path(inspect.getfile(plain_step)).read_bytes(),
                 *(name.encode() + source for name, source in sources)):
        digest.update(part if isinstance(part, bytes) else str(part).encode())
        digest.update(b"\0")
    return f"{type(model).__name__}-{rows}-rows-{digest.hexdigest()[:24]}"


def sealed_store(store: Path | None) -> tuple[Sealer | None, str | None]:
    """`store` as a private, sealed folder, or None (graphs compiled, neither loaded nor saved)
    where there is none or it cannot be trusted; and why not, logged once."""
    if store is None:
        return None, None
    try:
        return Sealer(store), None
    except (UntrustedFolder, OSError) as error:
        refused = f"{type(error).__name__}: {error}"[:300]
        log.warning("compiled decode steps are neither loaded nor saved: %s", refused)
        return None, refused


ROW_BUCKETS = (1, 2, 4, 8)  # rows a graph decodes; a step of 3 takes the 4-row graph with one idle row
_IDLE_LENGTH, _IDLE_CAPACITY = 5, 11  # an idle row's (sizes no model has: see `warm`)
# Warm-up lengths of the real rows, and their capacities: distinct from each other, from the idle
# row's and from every size of a model, since dynamo traces two equal sizes as one (duck sizing)
# and a later step where they differ would compile again.
_WARM_LENGTHS = ((37, 41, 43, 47, 53, 59, 61, 67), (71, 73, 79, 83, 89, 97, 101, 103))
_WARM_SPARE = (54, 56)


class GraphMaker:
    """Makes one model's graph for a bucket of rows: loaded from `store` where a process that
    traced the same one saved it, else compiled ahead of time and saved there; either way run on
    scratch buffers at other lengths and capacities than it was traced at, since its guards must
    take them. Not thread-safe: callers hold `_BUILDING`."""

    def __init__(self, model: PreTrainedModel, store: Sealer | None):
        """`store`: the private folder graphs are sealed into and read back from (None: neither)."""
        self.model, self.store = model, store
        self.keep_saved: set[str] = set()  # files that loaded and refused this model: never saved over
        self._compiler = torch.compile(plain_step, dynamic=True, fullgraph=True,
                                       options={"guard_filter_fn": _saved_guards})

    def name(self, bucket: int) -> str | None:
        """The `bucket`-row graph's file name (None: no store). Hashes the model's sources: once a bucket."""
        return None if self.store is None else f"{graph_key(self.model, bucket)}.graph"

    def load(self, bucket: int, name: str | None) -> Callable[..., torch.Tensor] | None:
        """The graph of `bucket` saved as `name`, checked on scratch buffers; None where there is
        none, its seal does not verify (never unpickled: a file this app did not write for this
        name could run anything), or it will not load (a torch that reads it otherwise): it is
        compiled again, and the new one sealed over it."""
        if self.store is None or name is None:
            return None
        try:
            payload = self.store.read(name)
            if payload is None:
                return None
            graph = torch.compiler.load_compiled_function(io.BytesIO(payload))
        except Exception as error:
            log.warning("the saved decode step %s was not used (%s: %s); compiling it again",
                        self.store.folder / name, type(error).__name__, str(error)[:300])
            return None
        try:
            self._run_scratch(graph, bucket, 1)
        except Exception as error:
            # it is this app's own graph for this key, and it refuses this model: the key misses
            # something the graph depends on. Compiled again in memory, not sealed over it, or two
            # such models in turn would each compile again at every start
            self.keep_saved.add(name)
            log.warning("the saved decode step %s does not take this model (%s: %s); compiling it again, "
                        "not saved over", self.store.folder / name, type(error).__name__, str(error)[:300])
            return None
        return graph

    def build(self, bucket: int, name: str | None) -> Callable[..., torch.Tensor]:
        """Compile the `bucket`-row graph ahead of time on scratch buffers, check that it takes
        other lengths and capacities, and seal it into the store as `name` if there is one (a
        failed save costs the next start a compile, nothing more)."""
        # floats read from the model (its norms' epsilon, attention's scale) are constants of the
        # graph, not inputs: an ahead-of-time trace cannot start again to specialize them
        with torch._dynamo.config.patch(specialize_float=True):
            graph = self._compiler.aot_compile((self._scratch_inputs(bucket, 0), {}))
        self._run_scratch(graph, bucket, 1)
        if self.store is not None and name is not None and name not in self.keep_saved:
            try:
                self.store.write(name, type(graph).serialize(graph).serialized_data)
            except Exception as error:
                log.warning("the decode step was not saved as %s (%s: %s)", name, type(error).__name__, error)
        return graph

    def scratch(self, capacity: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Zeroed key and value buffers of every layer for one row of `capacity` positions."""
        config, layers = self.model.config, self.model.model.layers
        shape = (1, config.num_key_value_heads, capacity, layers[0].self_attn.head_dim)
        make: Callable[[], torch.Tensor] = lambda: torch.zeros(shape, dtype=self.model.dtype, device=self.model.device)
        return [make() for _ in layers], [make() for _ in layers]

    def _scratch_inputs(self, bucket: int, which: int) -> tuple:
        """`plain_step`'s arguments for `bucket` decode rows on zeroed buffers: lengths `_WARM_LENGTHS[which]`."""
        lengths, spare = list(_WARM_LENGTHS[which][:bucket]), _WARM_SPARE[which]
        keys, values = [], []
        for length in lengths:
            row_keys, row_values = self.scratch(length + spare)
            keys.extend(row_keys)
            values.extend(row_values)
        return decode_inputs(self.model, [0] * bucket, [length - 1 for length in lengths], keys, values)

    def _run_scratch(self, graph: Callable[..., torch.Tensor], bucket: int, which: int) -> None:
        logits = graph(*self._scratch_inputs(bucket, which))
        if logits.shape != (bucket, self.model.config.vocab_size) or not torch.isfinite(logits).all():
            raise RuntimeError(f"the {bucket}-row graph gave logits of shape {tuple(logits.shape)}")


class CompiledDecode:
    """The compiled steps of one model (a graph per row bucket), compiled on a thread of their own
    (`start`) while the loop serves eager steps; the loop uses each (`takes`, `step`) once ready."""

    def __init__(self, model: PreTrainedModel, mode: str = "auto", max_rows: int = 1, store: Path | None = None):
        """`store`: the folder graphs are saved to and loaded from (None: neither, unless `start`
        chooses the app's cache folder)."""
        check_compile_mode(mode)
        self.model, self.mode = model, mode
        self.reason = "off" if mode == "off" else compile_refusal(model, auto=mode == "auto")
        self.enabled = self.reason is None
        # the buckets up to the first that holds `max_rows` (more rows than the largest: eager)
        self.buckets = (tuple(b for b in ROW_BUCKETS if b < max_rows)
                        + tuple(b for b in ROW_BUCKETS if b >= max_rows)[:1])
        self.store = store
        self.store_refused: str | None = None  # why `store` was not used (another user can write it)
        self.compile_s: dict[int, float] = {}
        self.loaded: set[int] = set()  # the buckets whose graph came from `store`
        self._graphs: dict[int, Callable[..., torch.Tensor]] = {}
        self.error, self.steps = None, 0
        self._ready_rows: set[int] = set()
        self._all_ready = threading.Event()
        if not self.enabled:  # nothing will be compiled: `wait` returns at once
            self._all_ready.set()
        self._idle: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []
        self._thread: threading.Thread | None = None
        self.priority: str | None = None  # the compiling thread's, once it runs

    # ---- what the loop reads ---------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        """Whether a conversation decoding alone runs compiled now."""
        return self.enabled and 1 in self._ready_rows

    def bucket(self, rows: int) -> int | None:
        """The graph a step of `rows` decode rows takes, if it is ready."""
        bucket = next((b for b in self.buckets if b >= rows), None)
        return bucket if self.enabled and bucket in self._ready_rows else None

    @property
    def graphs(self) -> int:
        """Graphs this model's steps hold: one a bucket, never more (a graph is never compiled
        again for a length or a capacity: its guards refuse the step instead)."""
        return len(self._graphs)

    def takes(self, rows: Sequence[tuple[Any, Sequence[int]]], logits_of: Sequence[int]) -> bool:
        """Whether this step is decode rows only, as many as a ready graph holds, each on states
        the graph reads (every full-attention layer a grown-in-place buffer)."""
        if not rows or self.bucket(len(rows)) is None or list(logits_of) != list(range(len(rows))):
            return False
        sessions = [session for session, _ in rows]
        if len({id(session) for session in sessions}) != len(sessions) or any(len(fed) != 1 for _, fed in rows):
            return False
        return all(len(session.token_ids) > 1 for session in sessions) and takes_states(sessions)

    @torch.no_grad()
    def step(self, rows: Sequence[tuple[Any, Sequence[int]]]) -> torch.Tensor | None:
        """Feed each session its one token (rows `takes` accepted); the logits after each, shaped
        (rows, vocab). The ledgers are the caller's (as with `forward_rows`). None, with nothing
        fed, where the graph's guards refuse these states (another dtype, say): a new graph would
        stall every user for a minute on the loop, so the steps stay eager from then on (and
        `/status` says why)."""
        bucket = self.bucket(len(rows))
        assert bucket is not None
        tokens, positions, keys, values = [], [], [], []
        for session, fed in rows:
            held = len(session.token_ids)
            tokens.append(fed[0])
            positions.append(held)
            for layer in session.cache.layers:
                key_buffer, value_buffer = layer.room_for(held + 1)
                keys.append(key_buffer)
                values.append(value_buffer)
        for idle_keys, idle_values in self._idle[: bucket - len(rows)]:
            tokens.append(0)
            positions.append(_IDLE_LENGTH - 1)
            keys.extend(idle_keys)
            values.extend(idle_values)
        try:
            logits = self._graphs[bucket](*decode_inputs(self.model, tokens, positions, keys, values))
        except Exception as error:
            # a failed guard is checked before anything runs; any other failure may have written
            # this step's keys and values past the filled part of a buffer, which nothing reads:
            # either way nothing was fed, and the eager forward takes this step and every later
            # one (raising again at every step ended every row each time)
            why = ("a step would have compiled again (its guards failed)" if "GuardManager check failed" in str(error)
                   else f"the compiled step failed ({type(error).__name__})")
            self.error = f"{why}: {error}"[:500]
            self.enabled = False
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
                "rows_compiled": sorted(self._ready_rows) if self.enabled else [], "graphs": self.graphs,
                "rows_loaded": sorted(self.loaded), "store_refused": self.store_refused,
                "steps": self.steps, "compile_s": round(sum(self.compile_s.values()), 1) if self.compile_s else None,
                "compile_priority": self.priority,
                "not_compiled_because": self.reason or self.error}

    # ---- compiling beside the loop ---------------------------------------------------------------
    def start(self) -> None:
        """Compile on a thread of its own (the loop serves eager steps meanwhile), one row first.
        Graphs are kept in the app's cache folder unless a `store` was given, and inductor's own
        on-disk cache beside them unless one was chosen (TORCHINDUCTOR_CACHE_DIR)."""
        if not self.enabled or self._thread is not None:
            return
        if self.store is None:
            self.store = default_store()
        self.store_refused = trusted_inductor_cache()
        trace_inductors_placeholder()
        self._thread = threading.Thread(target=self._warm_beside, name="compile-decode-step", daemon=True)
        self._thread.start()

    def wait(self, timeout: float | None = None) -> bool:
        """Until every bucket is compiled (or compiling failed); whether they all were."""
        self._all_ready.wait(timeout)
        return self.enabled and set(self.buckets) <= self._ready_rows

    def _warm_beside(self) -> None:
        """`warm` on the compiling thread, at the lowest CPU priority where the OS allows it (after
        `probe_vector_instructions`, at the steps' priority)."""
        probe_vector_instructions()
        self.priority = _lower_thread_priority(COMPILE_NICE)
        self.warm()

    @torch.no_grad()
    def warm(self) -> None:
        """Load or compile each bucket's graph (`GraphMaker`), one row first."""
        try:
            sealer, refused = sealed_store(self.store)
            self.store_refused = refused or self.store_refused
            maker = GraphMaker(self.model, sealer)
            self._idle = [maker.scratch(_IDLE_CAPACITY) for _ in range(max(self.buckets) - 1)]
            for bucket in self.buckets:
                started = time.perf_counter()
                name = maker.name(bucket)
                with _BUILDING:
                    graph = maker.load(bucket, name)
                    if graph is not None:
                        self.loaded.add(bucket)
                    self._graphs[bucket] = graph or maker.build(bucket, name)
                self.compile_s[bucket] = time.perf_counter() - started
                self._ready_rows.add(bucket)
                how = "loaded from disk" if bucket in self.loaded else "compiled"
                log.info("decode step of %d row(s) %s in %.1f s", bucket, how, self.compile_s[bucket])
                print(f"rewind-chat: decode step of {bucket} row{'s' if bucket > 1 else ''} {how} in "
                      f"{self.compile_s[bucket]:.1f} s", flush=True)
        except Exception as error:  # an eager engine is still a working one: say why, go on eager
            self.error = f"compiling failed: {type(error).__name__}: {error}"[:500]
            self.enabled = False
            log.warning("decode step not compiled: %s", self.error)
        finally:
            self._all_ready.set()


def trace_inductors_placeholder() -> None:
    """Have inductor trace its placeholder graph here, before the compiling thread starts.

    Lowering a graph, inductor builds one placeholder with `torch.fx.symbolic_trace`, once a process
    (`InterpreterShim._dummy_gm`, cached). While it traces, `torch.nn.Module.__call__` is patched for
    the whole process, and an eager step running on the loop at that moment fails with "NameError:
    module is not installed as a submodule" (a cold start's replies failed so, 2 runs in 15). Traced
    here it is never traced on the compiling thread. torch's later tracers (make_fx) patch too, but
    their patched call runs the module as it is."""
    try:
        from torch._inductor.loop_body import InterpreterShim
        InterpreterShim._dummy_gm()
    except (ImportError, AttributeError) as error:  # another torch: the race may be back, say so
        log.warning("inductor's placeholder graph not traced ahead (%s): an eager step may fail "
                    "while the first graph lowers", error)


def probe_vector_instructions() -> None:
    """Have inductor find which vector instructions this CPU runs, once a process: it builds a
    small program for each and loads it in a child process, which inherits the calling thread's
    priority. At the compiling thread's nice 19 beside a busy loop those children got almost no
    CPU: the probe had not ended after 400 s (two busy processes on 2 cores; at nice 0, 6.7 s), and
    a child that passes 60 s counts as a failed probe, so the graph would be generated without
    those instructions and saved so. Probed first, at the steps' priority, it is cached for the
    compile. A failure here is the compile's to meet and report."""
    try:
        from torch._inductor.cpu_vec_isa import pick_vec_isa
        pick_vec_isa()
    except Exception as error:  # (the compile meets it again and says why)
        log.warning("inductor's probe of vector instructions failed here: %s", error)


def _lower_thread_priority(nice: int) -> str:
    """Set the calling thread's nice value (Linux: a thread's own; what a compile forks inherits
    it); what it is now, or why it is unchanged."""
    if nice <= 0:
        return "as the steps'"
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
        return f"nice {os.getpriority(os.PRIO_PROCESS, threading.get_native_id())}"
    except (AttributeError, OSError) as error:  # no such call here, or not allowed
        return f"as the steps' ({type(error).__name__}: {error})"[:200]
