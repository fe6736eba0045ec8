"""What the benchmarks share: timing a `generate` stream, peak memory, the CPU's vector extensions,
and writing the result."""

from __future__ import annotations

import copy
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
from transformers.generation.streamers import BaseStreamer

from benchmarks.models import build_bench_tokenizer
from chat import ChatEngine
from chat.models import build_model
from chat.model_step.weights import apply_weight_format
from chat.scheduling.worker import ModelWorker
from chat.model_step.feeding import rewind_and_prefill


class TokenClock(BaseStreamer):
    """Time of each token `generate` streams (the first `put` is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if self._prompt_seen:
            self.times.append(time.perf_counter())
        self._prompt_seen = True

    def end(self) -> None:
        pass


def decode_rate(times: list[float]) -> float:
    return (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 and times[-1] > times[0] else 0.0


@torch.no_grad()
def bare_generate_rate(model: torch.nn.Module, session: Any, prompt: list[int], new_tokens: int) -> float:
    """Plain `generate` (greedy) on a copy of `session`'s cache, prepared as the session would (it
    then holds `prompt[:-1]`): the tokens/s a bare loop of the same model decodes at there."""
    copied = copy.deepcopy(session, memo={id(model): model})
    rewind_and_prefill(model, copied, prompt)
    clock, ids = TokenClock(), torch.tensor([prompt])
    model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=copied.cache,
                   max_new_tokens=new_tokens, do_sample=False, streamer=clock)
    return decode_rate(clock.times)


@contextmanager
def patched(owner: Any, name: str, value: Any, apply: bool = True) -> Iterator[None]:
    """`owner.name` is `value` inside (where `apply`), as it was after: a benchmark's "before" arm,
    the code before a change switched back in for one run."""
    if not apply:
        yield
        return
    own = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, own)


def engine_at_size(model_name: str, weights: str, **options: Any) -> tuple[ChatEngine, Any]:
    """A `ChatEngine` over the row `model_name` of chat/models.py with the benchmark tokenizer, its
    weights in `weights`, every reply run to its length (no end token), and its decode graphs built
    before anything is timed (from 200 M parameters they take a core meanwhile). `options`: the
    engine's. Returns the engine and the tokenizer."""
    worker = ModelWorker()
    tokenizer = build_bench_tokenizer()
    model = worker.run(build_model, model_name, len(tokenizer), tokenizer.eos_token_id)
    worker.run(apply_weight_format, model, weights)
    model.generation_config.eos_token_id = None
    engine = ChatEngine(model, tokenizer, worker=worker, **options)
    if engine.compiled is not None:
        engine.compiled.wait(1800)
    return engine, tokenizer


def alternated(arms: Sequence[str], repeats: int) -> Iterator[str]:
    """Each arm once a repeat, the order turned every repeat (no arm always first)."""
    for repeat in range(repeats):
        turn = repeat % len(arms)
        yield from [*arms[turn:], *arms[:turn]]


def arms_heading(result: dict) -> str:
    """A run of alternated arms' first line: model, weights, host, flags, load, repeats."""
    return (f"{result['args']['model']}, weights {result['args']['weights']}; {result['machine']}; lscpu flags "
            f"{result['cpu_flags']}; load {result['load_before'][0]:.2f} → {result['load_after'][0]:.2f}; "
            f"medians of {result['args']['repeats']} alternated repeats")


def arm_medians(runs: list[dict]) -> dict:
    """Each figure's median over an arm's runs."""
    return {key: statistics.median(run[key] for run in runs) for key in runs[0]}


def arms_record(module: str, args: Any, argv: list[str] | None, summary: dict | None, runs: dict, load_before: tuple,
                markdown: Callable[[dict], str]) -> dict:
    """A run of alternated arms as a benchmark keeps it: its arguments, the host's flags and load
    before and after, the summary (None: each arm's medians) and every run, the command; printed
    as `markdown`, written to `args.json` if given."""
    summary = summary if summary is not None else {name: arm_medians(arm_runs) for name, arm_runs in runs.items()}
    result = {"args": vars(args), "cpu_flags": cpu_flags(), "machine": f"{platform.machine()}, "
              f"{torch.get_num_threads()} threads", "torch": torch.__version__, "load_before": load_before,
              "load_after": os.getloadavg(), "summary": summary, "runs": runs,
              "command": f"python -m benchmarks.{module} " + " ".join(sys.argv[1:] if argv is None else argv)}
    print(markdown(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return result


def cpu_flags() -> str:
    """The vector extensions `lscpu` reports (what decides which kernels are fast)."""
    try:
        flags = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    line = next((line for line in flags.splitlines() if line.startswith("Flags:")), "")
    wanted = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "fma")
    return " ".join(flag for flag in line.split()[1:] if flag in wanted) or "none of avx2/avx512/amx"


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def target_table(targets: list[tuple[str, str, bool]]) -> list[str]:
    lines = ["| target | measured | met |", "|---|---|:---:|"]
    return lines + [f"| {target} | {measured} | {'yes' if met else '**no**'} |" for target, measured, met in targets]


def publish(result: dict, started: float, *, targets: Callable[[dict], list], markdown: Callable[[dict], str],
            plot: Callable[[dict, str], None], json_path: str | None, plot_path: str | None) -> dict:
    """Close a run: memory, wall time and targets into `result`; the table to stdout; files."""
    result["peak_rss_bytes"] = peak_rss_bytes()
    result["wall_s"] = time.perf_counter() - started
    result["targets"] = targets(result)
    print(markdown(result))
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=1))
    if plot_path:
        plot(result, plot_path)
    return result
