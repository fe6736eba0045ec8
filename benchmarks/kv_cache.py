"""`--kv-cache`: what each kind costs and saves, in one run.

For `dynamic` (exact), `quantized` 8 bits and `quantized` 4 bits:

  bytes a token     the states one token adds, on `--model` (bench-full; real-qwen3-0.6b for a real
                    model's shape), measured on a conversation of `--tokens`
  resident          conversations of `--tokens` each that an engine keeps under one cache budget
                    (`--budget-mb`): new ones are opened until the budget starts evicting
  agreement         of `--replies` greedy replies of the trained demo model (arithmetic questions of
                    the demo's evaluation split, thinking on), how many are token for token those of
                    the dynamic cache; and the share of reply tokens before the first difference
  decode            one conversation of `--tokens` decoding 64 tokens through the engine's
                    scheduler, tokens/s, medians of `--repeats` alternated runs

    python -m benchmarks.kv_cache
    python -m benchmarks.kv_cache --model real-qwen3-0.6b --tokens 1024 --budget-mb 2048 --repeats 2
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import threading
import time

import torch

from benchmarks.agreement import demo_agreement
from benchmarks.report import publish, target_table
from cache_sessions.kv_cache import KVCacheKind
from cache_sessions.session import CacheSession
from cache_sessions.tensors import filled_bytes
from chat import ChatEngine
from chat.models import build_model, parameter_count
from chat.dialogue.options import GenerationOptions
from chat.scheduling.scheduler import DecodeScheduler
from chat.scheduling.worker import ModelWorker
from chat.model_step.feeding import rewind_and_prefill

KINDS = {"dynamic": KVCacheKind(), "quantized-8": KVCacheKind("quantized", 8),
         "quantized-4": KVCacheKind("quantized", 4)}
VOCAB = 8192


def prompt_of(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(length + 1)]


def bytes_per_token(model, kind: KVCacheKind, tokens: int) -> float:
    session = CacheSession(model, max_checkpoints=0, kv_cache=kind)
    rewind_and_prefill(model, session, prompt_of(tokens, 0))
    return filled_bytes(session.tensors()) / tokens


def resident(model, worker: ModelWorker, kind: KVCacheKind, tokens: int, budget: int) -> int:
    """Open conversations of `tokens` each (a first turn through the scheduler: its prompt and one
    token) under `budget` until one is evicted; how many kept their states."""
    scheduler = DecodeScheduler(model, worker, budget_bytes=budget, max_checkpoints=0, kv_cache=kind)
    sessions: list[CacheSession] = []
    while len(sessions) < 1_000:
        session = scheduler.caches.new_session()
        request = scheduler.submit(session, prompt_of(tokens, len(sessions)), GenerationOptions(max_new_tokens=1),
                                   threading.Event())
        for _ in request.tokens():
            pass
        request.finish()
        scheduler.call(scheduler.caches.settle)
        sessions.append(session)
        if scheduler.caches.stats().evictions:
            return sum(1 for s in sessions if s.token_ids)
    raise RuntimeError("the budget never filled")


def _demo_engine(kind: KVCacheKind):
    return lambda: ChatEngine.load("demo", kv_cache=kind.name, kv_bits=kind.bits)


def decode_speed(model, worker: ModelWorker, kind: KVCacheKind, tokens: int) -> float:
    scheduler = DecodeScheduler(model, worker, max_checkpoints=0, kv_cache=kind)
    session = scheduler.caches.new_session()
    prompt = prompt_of(tokens, 7)
    scheduler.call(session.rewind_to, prompt)
    request = scheduler.submit(session, prompt, GenerationOptions(max_new_tokens=64, do_sample=False),
                               threading.Event())
    arrivals = [time.perf_counter() for _ in request.tokens()]
    request.finish()
    return 1 / statistics.median(b - a for a, b in zip(arrivals, arrivals[1:]))


def run(model_name: str, tokens: int, budget_mb: float, replies: int, repeats: int) -> dict:
    worker = ModelWorker()
    model = worker.run(build_model, model_name, VOCAB, None)  # no end token: decodes run to their length
    per_token = {name: worker.run(bytes_per_token, model, kind, tokens) for name, kind in KINDS.items()}
    kept = {name: resident(model, worker, kind, tokens, int(budget_mb * 2**20)) for name, kind in KINDS.items()}
    speeds: dict[str, list[float]] = {name: [] for name in KINDS}
    for repeat in range(repeats):
        names = list(KINDS)[repeat % len(KINDS):] + list(KINDS)[: repeat % len(KINDS)]
        for name in names:
            speeds[name].append(decode_speed(model, worker, KINDS[name], tokens))
    return {"model": model_name, "parameters": parameter_count(model), "tokens": tokens, "budget_mb": budget_mb,
            "bytes_per_token": per_token, "resident": kept,
            "agreement": demo_agreement({name: _demo_engine(kind) for name, kind in KINDS.items()}, replies)
            if replies else {}, "replies": replies,
            "decode_tokens_per_s": {name: statistics.median(values) for name, values in speeds.items()},
            "runs": speeds, "repeats": repeats, "torch": torch.__version__, "cpu": platform.processor(),
            "load_before": os.getloadavg(), "command": "python -m benchmarks.kv_cache " + " ".join(sys.argv[1:])}


def markdown(result: dict) -> str:
    agree = result["agreement"]
    lines = [f"{result['model']} ({result['parameters'] / 1e6:.1f} M parameters), conversations of "
             f"{result['tokens']} tokens, a budget of {result['budget_mb']:.0f} MiB; agreement: "
             f"{result['replies']} greedy replies of the demo model:", "",
             "| --kv-cache | bytes a token | resident | identical replies | reply before the first difference "
             "| decode tokens/s |", "|---|---:|---:|---:|---:|---:|"]
    for name in KINDS:
        row = agree.get(name, {})
        lines.append(f"| {name} | {result['bytes_per_token'][name] / 1024:.1f} KiB | {result['resident'][name]} | "
                     f"{row.get('identical', float('nan')):.0%} | {row.get('prefix_share', float('nan')):.0%} | "
                     f"{result['decode_tokens_per_s'][name]:.1f} |")
    return "\n".join(lines + ["", *target_table(result["targets"])])


def targets(result: dict) -> list[tuple[str, str, bool]]:
    ratio = result["resident"]["quantized-8"] / result["resident"]["dynamic"]
    return [("quantized (8 bits) keeps at least 3x the conversations of dynamic under one budget",
             f"{ratio:.2f}x", ratio >= 3)]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="bench-full", help="a row of chat/models.py (bench-full, real-qwen3-0.6b)")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--budget-mb", type=float, default=256.0)
    parser.add_argument("--replies", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", dest="json_path", default=None)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    with torch.no_grad():
        result = run(args.model, args.tokens, args.budget_mb, args.replies, args.repeats)
    return publish(result, started, targets=targets, markdown=markdown, plot=lambda *_: None,
                   json_path=args.json_path, plot_path=None)


if __name__ == "__main__":
    main()
