"""Decode speed against the length of the history, one row and a full batch, in one run.

Two ways, through the engine's own scheduler (chat/scheduling/scheduler.py) and cache sessions:

  before   the library's `DynamicLayer`: a `torch.cat` of the whole history per token, every row
  engine   full-attention states written in place (cache_sessions/growing.py)

Each row's history is prefilled once per length and put into every way's sessions as a segment
(a copy; nothing recomputed), so only decoding is timed: `--tokens` greedy tokens per row, no end
token. Runs alternate the ways, `--repeats` times; medians of tokens/s (all rows together).

    python -m benchmarks.decode_speed                                # bench-full, 250 and 3,000 tokens, 1 and 8 rows
    python -m benchmarks.decode_speed --model real-qwen3-0.6b --rows 1,4
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import random
import statistics
import sys
import threading
import time
from typing import Iterator
from unittest import mock

import torch
from transformers import DynamicCache

from benchmarks.report import publish, target_table
from cache_sessions.kv_cache import KVCacheKind
from cache_sessions.segments import Segment
from cache_sessions.session import CacheSession
from chat.models import build_model, parameter_count
from chat.dialogue.options import GenerationOptions
from chat.scheduling.scheduler import DecodeScheduler
from chat.scheduling.worker import ModelWorker
from chat.model_step.feeding import rewind_and_prefill

WAYS = ("before", "engine")
VOCAB = 8192


@contextlib.contextmanager
def way(name: str) -> Iterator[None]:
    """Sessions and batches made inside use the way's cache layers."""
    if name == "engine":
        yield
        return
    with mock.patch.object(KVCacheKind, "new_cache", lambda kind, model: DynamicCache(config=model.config)):
        yield


def histories(model, worker: ModelWorker, length: int, rows: int) -> list[tuple[list[int], Segment]]:
    """Each row's prompt (its history + the token a decode step feeds) and its states. Rows of a
    batch differ in length, as conversations do (the first `length`, the last 3/4 of it), so the
    batch is left-padded and attention gets a mask."""
    def prefill(row: int) -> tuple[list[int], Segment]:
        rng = random.Random(length * 100 + row)
        prompt = [rng.randrange(VOCAB) for _ in range(length - row * length // (4 * rows) + 1)]
        session = CacheSession(model, max_checkpoints=0)
        rewind_and_prefill(model, session, prompt)
        return prompt, session.cut_segment(0)

    with way("engine"):
        return [worker.run(prefill, row) for row in range(rows)]


def decode(model, worker: ModelWorker, rows: list[tuple[list[int], Segment]], tokens: int) -> float:
    """Tokens/s of all rows decoding together: rows / the median time of a step (the gaps between
    the first row's tokens as they arrive; every step gives every row one), so a hiccup of the
    host moves one gap, not the figure."""
    scheduler = DecodeScheduler(model, worker, max_batch_size=len(rows), prefill_chunk=256)
    sessions = [scheduler.caches.new_session() for _ in rows]
    for session, (_, segment) in zip(sessions, rows):
        scheduler.call(session.append_segment, segment)
    options = GenerationOptions(max_new_tokens=tokens, do_sample=False)
    requests = [scheduler.submit(session, prompt, options, threading.Event())
                for session, (prompt, _) in zip(sessions, rows)]
    arrivals = [time.perf_counter() for _ in requests[0].tokens()]
    for request in requests[1:]:
        for _ in request.tokens():  # to its end (`finish` alone would stop it)
            pass
    for request in requests:
        request.finish()
    # every row reused its whole history (only the last prompt token fed) and decoded every token
    assert all(r.prefill.reused_tokens == len(r.prompt_ids) - 1 and r.token_count == tokens for r in requests)
    for session in sessions:
        scheduler.caches.close(session)
    scheduler.call(scheduler.caches.settle)
    return len(rows) / statistics.median(later - earlier for earlier, later in zip(arrivals, arrivals[1:]))


def run(model_name: str, lengths: list[int], row_counts: list[int], tokens: int, repeats: int) -> dict:
    worker = ModelWorker()
    model = worker.run(build_model, model_name, VOCAB, None)  # no end token: every row decodes `tokens`
    cells: dict[str, list[float]] = {}
    for length in lengths:
        for rows in row_counts:
            states = histories(model, worker, length, rows)
            for repeat in range(repeats):
                for name in WAYS[repeat % len(WAYS):] + WAYS[: repeat % len(WAYS)]:  # rotating order
                    with way(name):
                        cells.setdefault(f"{name}/{length}/{rows}", []).append(decode(model, worker, states, tokens))
            del states
    medians = {key: statistics.median(values) for key, values in cells.items()}
    return {"model": model_name, "parameters": parameter_count(model), "lengths": lengths, "rows": row_counts,
            "tokens": tokens, "repeats": repeats, "tokens_per_s": medians, "runs": cells,
            "torch": torch.__version__, "threads": torch.get_num_threads(), "cpu": platform.processor(),
            "load_before": os.getloadavg(), "command": "python -m benchmarks.decode_speed " + " ".join(sys.argv[1:])}


def markdown(result: dict) -> str:
    speeds = result["tokens_per_s"]
    lines = [f"{result['model']} ({result['parameters'] / 1e6:.1f} M parameters), {result['tokens']} greedy tokens a "
             f"row, tokens/s of all rows together, medians of {result['repeats']}:", "",
             "| history (longest row) | rows | " + " | ".join(WAYS) + " | engine / before |",
             "|---:|---:|" + "---:|" * (len(WAYS) + 1)]
    for length in result["lengths"]:
        for rows in result["rows"]:
            cell = [speeds[f"{name}/{length}/{rows}"] for name in WAYS]
            lines.append(f"| {length} | {rows} | " + " | ".join(f"{value:.1f}" for value in cell)
                         + f" | {cell[-1] / cell[0]:.2f}x |")
    return "\n".join(lines + ["", *target_table(result["targets"])])


def targets(result: dict) -> list[tuple[str, str, bool]]:
    """The issue's target is one conversation's; a batch's figures are for information (at 8 rows of
    3,000 tokens, the states each step reads approach the size of the weights)."""
    speeds, short, long = result["tokens_per_s"], min(result["lengths"]), max(result["lengths"])
    if 1 not in result["rows"]:
        return []
    ratio = speeds[f"engine/{long}/1"] / speeds[f"engine/{short}/1"]
    return [(f"one conversation: decode at {long} tokens of history >= 0.75x the speed at {short}",
             f"{ratio:.2f}x", ratio >= 0.75)]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="bench-full", help="a row of chat/models.py (bench-full, real-qwen3-0.6b)")
    parser.add_argument("--lengths", default="250,3000", help="tokens of history, comma-separated")
    parser.add_argument("--rows", default="1,8", help="rows decoding together, comma-separated")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", dest="json_path", default=None)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    result = run(args.model, [int(n) for n in args.lengths.split(",")], [int(n) for n in args.rows.split(",")],
                 args.tokens, args.repeats)
    return publish(result, started, targets=targets, markdown=markdown, plot=lambda *_: None,
                   json_path=args.json_path, plot_path=None)


if __name__ == "__main__":
    main()
