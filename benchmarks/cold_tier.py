"""The cold tier against re-prefilling (issue #23), in one run: an idle conversation of `--tokens`
tokens whose cache the budget pushed out. With `--cache-dir` its next turn first reads the
states back from disk; without, it computes them again (a prefill of the whole history).

  prefill   the states computed from scratch (what an evicted conversation's next turn costs)
  spill     written to the cold tier (safetensors + the session's structure), memory freed
  resume    read back, on the model's device; checked equal to what was written, bit for bit

Runs alternate (prefill, spill, resume) `--repeats` times; medians, and resume/prefill as a ratio.
Before each resume the file is flushed and dropped from the page cache (posix_fadvise), so the
read comes from the disk (as far as the kernel honours the hint).

    python -m benchmarks.cold_tier --model bench-full --tokens 4096
    python -m benchmarks.cold_tier --model real-qwen3-0.6b --tokens 4096   # Qwen3-0.6B's shape
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.models import build_bench_tokenizer
from benchmarks.report import publish, target_table
from cache_sessions.cold import ColdStore
from cache_sessions.session import CacheSession
from cache_sessions.tensors import filled_bytes
from chat.models import build_model, parameter_count


def run(model_name: str, tokens: int, repeats: int, folder: str) -> dict:
    tokenizer = build_bench_tokenizer()
    model = build_model(model_name, len(tokenizer), tokenizer.convert_tokens_to_ids("<|im_end|>"))
    rng = random.Random(0)
    prompt = [rng.randrange(len(tokenizer)) for _ in range(tokens + 1)]  # the states cover all but the last
    store = ColdStore(folder, max_bytes=1 << 40)
    runs: dict[str, list[float]] = {"prefill_s": [], "spill_s": [], "resume_s": []}
    file_bytes = state_bytes = 0
    for _ in range(repeats):
        session = CacheSession(model, max_checkpoints=0)
        started = time.perf_counter()
        session.prepare(prompt)
        runs["prefill_s"].append(time.perf_counter() - started)
        state_bytes = filled_bytes(session.tensors())  # without the room the buffers keep to grow
        written = [t.clone() for t in session.tensors()]
        started = time.perf_counter()
        assert store.spill(session)
        runs["spill_s"].append(time.perf_counter() - started)
        file_bytes = store.stats().bytes
        for path in Path(folder).glob("session-*.cold"):  # read back from the disk, not the page cache
            with open(path, "rb") as file:
                os.fsync(file.fileno())
                os.posix_fadvise(file.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        started = time.perf_counter()
        assert store.resume(session)
        runs["resume_s"].append(time.perf_counter() - started)
        back = list(session.tensors())
        assert len(back) == len(written) and all(torch.equal(a, b) for a, b in zip(written, back))
        del session, written, back
    store.close()
    medians = {name: statistics.median(values) for name, values in runs.items()}
    return {"model": model_name, "parameters": parameter_count(model), "tokens": tokens, "repeats": repeats,
            "state_bytes": state_bytes, "file_bytes": file_bytes, "bytes_per_token": state_bytes / tokens,
            **medians, "runs": runs, "resume_vs_prefill": medians["resume_s"] / medians["prefill_s"],
            "torch": torch.__version__, "threads": torch.get_num_threads(), "cpu": platform.processor(),
            "load_before": os.getloadavg(), "command": "python -m benchmarks.cold_tier " + " ".join(sys.argv[1:])}


def markdown(result: dict) -> str:
    return "\n".join([
        f"{result['model']} ({result['parameters'] / 1e6:.1f} M parameters), {result['tokens']} tokens of history, "
        f"{result['state_bytes'] / 2**20:.0f} MiB of states ({result['bytes_per_token'] / 1024:.0f} KiB a token), "
        f"file {result['file_bytes'] / 2**20:.0f} MiB; medians of {result['repeats']}:",
        "", "| re-prefill | spill to disk | resume from disk | resume / re-prefill |", "|---:|---:|---:|---:|",
        f"| {result['prefill_s']:.2f} s | {result['spill_s']:.2f} s | {result['resume_s']:.2f} s | "
        f"{result['resume_vs_prefill']:.3f}x |", "", *target_table(result["targets"])])


def targets(result: dict) -> list[tuple[str, str, bool]]:
    return [("resuming from disk is faster than computing the states again",
             f"{result['resume_vs_prefill']:.3f}x the time", result["resume_vs_prefill"] < 1.0)]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="bench-full", help="a row of chat/models.py (bench-full, real-qwen3-0.6b)")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cache-dir", default=None, help="where the files go (default: a temporary folder)")
    parser.add_argument("--json", dest="json_path", default=None)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch, torch.no_grad():
        result = run(args.model, args.tokens, args.repeats, args.cache_dir or scratch)
    return publish(result, started, targets=targets, markdown=markdown, plot=lambda *_: None,
                   json_path=args.json_path, plot_path=None)


if __name__ == "__main__":
    main()
