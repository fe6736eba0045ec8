"""The cold tier against re-prefilling, in one run: an idle conversation of `--tokens`
tokens whose cache the budget pushed out. With `--cache-dir` its next turn first reads the
states back from disk; without, it computes them again (a prefill of the whole history).

  prefill   the states computed from scratch (what an evicted conversation's next turn costs)
  spill     what the engine's loop spends on a spill: handing the states to the writer thread
  write     until the file is written and the memory freed (beside the loop)
  resume    read back, on the model's device; checked equal to what was written, bit for bit

And what a spill costs the others (`--stall-tokens`): on an engine with a cold tier,
a conversation of that many tokens goes to disk while another user streams a reply; that user's
worst gap between tokens while the file is written, against its median gap.

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
from chat.model_step.feeding import rewind_and_prefill


def run(model_name: str, tokens: int, repeats: int, folder: str) -> dict:
    tokenizer = build_bench_tokenizer()
    model = build_model(model_name, len(tokenizer), tokenizer.convert_tokens_to_ids("<|im_end|>"))
    rng = random.Random(0)
    prompt = [rng.randrange(len(tokenizer)) for _ in range(tokens + 1)]  # the states cover all but the last
    store = ColdStore(folder, max_bytes=1 << 40)
    runs: dict[str, list[float]] = {"prefill_s": [], "spill_s": [], "write_s": [], "resume_s": []}
    file_bytes = state_bytes = 0
    for _ in range(repeats):
        session = CacheSession(model, max_checkpoints=0)
        started = time.perf_counter()
        rewind_and_prefill(model, session, prompt)
        runs["prefill_s"].append(time.perf_counter() - started)
        state_bytes = filled_bytes(session.tensors())  # without the room the buffers keep to grow
        written = [t.clone() for t in session.tensors()]
        started = time.perf_counter()
        assert store.spill(session)
        runs["spill_s"].append(time.perf_counter() - started)
        store.flush()
        runs["write_s"].append(time.perf_counter() - started)
        file_bytes = store.stats().bytes
        for path in store.own.glob("session-*.cold"):  # read back from the disk, not the page cache
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


def stall(model_name: str, tokens: int, folder: str, reply_tokens: int = 300) -> dict:
    """A conversation of `tokens` tokens spilled while another user streams: the streaming user's
    gaps while the file is written, against its median gap."""
    from benchmarks.fairness import Sender, message_of, session_id, token_clock
    from benchmarks.models import Words
    from chat import ChatEngine
    from chat.scheduling.worker import ModelWorker

    tokenizer = build_bench_tokenizer()
    worker = ModelWorker()
    model = worker.run(build_model, model_name, len(tokenizer), tokenizer.convert_tokens_to_ids("<|im_end|>"))
    model.generation_config.eos_token_id = None
    engine = ChatEngine(model, tokenizer, worker=worker, shared_prefixes=0, cache_dir=folder,
                        cache_dir_bytes=1 << 40)
    idle, streamer = engine.conversation(None), engine.conversation(None)
    list(idle.send(message_of(tokenizer, Words(seed=5), tokens), max_new_tokens=1, do_sample=False))
    idle_bytes = engine.scheduler.call(idle.session.nbytes)
    with token_clock() as times:
        stream = Sender(streamer, "Tell me a long story.", reply_tokens)
        while len(times.get(session_id(streamer), [])) < reply_tokens // 3:
            time.sleep(0.001)
        started = time.perf_counter()
        engine.caches.budget_bytes = engine.caches.stats().cache_bytes - idle_bytes // 2  # the idle one must go
        engine.caches.enforce_budget()
        handed_over = time.perf_counter()
        engine.caches.cold_store.flush()
        written = time.perf_counter()
        engine.caches.budget_bytes = None
        stream.join()
    stamps = times[session_id(streamer)]
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    during = [b - a for a, b in zip(stamps, stamps[1:]) if b > started and a < written]
    median = statistics.median(gaps)
    cold = engine.caches.stats().cold
    assert cold is not None and cold.spilled == 1
    return {"tokens": tokens, "file_bytes": cold.bytes, "loop_s": handed_over - started, "write_s": written - started,
            "median_gap_s": median, "worst_gap_during_write_s": max(during, default=0.0),
            "gaps_during_write": len(during), "worst_over_median": max(during, default=0.0) / median}


def markdown(result: dict) -> str:
    lines = []
    if "stall" in result:
        st = result["stall"]
        lines = [f"A {st['file_bytes'] / 2**20:.0f} MiB spill ({st['tokens']} tokens) while another user streams: "
                 f"the loop spent {st['loop_s'] * 1000:.0f} ms on it, the file took {st['write_s']:.2f} s; the "
                 f"streaming user's worst gap meanwhile {st['worst_gap_during_write_s'] * 1000:.0f} ms "
                 f"({st['gaps_during_write']} gaps) against a median of {st['median_gap_s'] * 1000:.0f} ms "
                 f"({st['worst_over_median']:.1f}x).", ""]
    return "\n".join(lines + [
        f"{result['model']} ({result['parameters'] / 1e6:.1f} M parameters), {result['tokens']} tokens of history, "
        f"{result['state_bytes'] / 2**20:.0f} MiB of states ({result['bytes_per_token'] / 1024:.0f} KiB a token), "
        f"file {result['file_bytes'] / 2**20:.0f} MiB; medians of {result['repeats']}:",
        "", "| re-prefill | spill (the loop's part) | file written | resume from disk | resume / re-prefill |",
        "|---:|---:|---:|---:|---:|",
        f"| {result['prefill_s']:.2f} s | {result['spill_s'] * 1000:.1f} ms | {result['write_s']:.2f} s | "
        f"{result['resume_s']:.2f} s | {result['resume_vs_prefill']:.3f}x |", "", *target_table(result["targets"])])


def targets(result: dict) -> list[tuple[str, str, bool]]:
    rows = [("resuming from disk is faster than computing the states again",
             f"{result['resume_vs_prefill']:.3f}x the time", result["resume_vs_prefill"] < 1.0)]
    if "stall" in result:
        st = result["stall"]
        rows.append(("a spill adds at most one step to a streaming user's worst gap (<= 2x its median)",
                     f"{st['worst_over_median']:.1f}x", st["worst_over_median"] <= 2))
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="bench-full", help="a row of chat/models.py (bench-full, real-qwen3-0.6b)")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cache-dir", default=None, help="where the files go (default: a temporary folder)")
    parser.add_argument("--stall-tokens", type=int, default=0,
                        help="also spill a conversation of this many tokens while another streams (0: not run)")
    parser.add_argument("--stall-reply", type=int, default=300, help="tokens the streaming user's reply runs")
    parser.add_argument("--json", dest="json_path", default=None)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch, torch.no_grad():
        result = run(args.model, args.tokens, args.repeats, args.cache_dir or scratch)
        if args.stall_tokens:
            result["stall"] = stall(args.model, args.stall_tokens, str(Path(args.cache_dir or scratch) / "engine"),
                                    args.stall_reply)
    return publish(result, started, targets=targets, markdown=markdown, plot=lambda *_: None,
                   json_path=args.json_path, plot_path=None)


if __name__ == "__main__":
    main()
