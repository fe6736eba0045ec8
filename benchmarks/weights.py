"""Weights in bf16 (`--dtype bfloat16`), packed for oneDNN (`--weights packed`) and in int8
(`--weights int8`) against fp32 on the CPU, in one run.

  decode     one conversation of `--tokens` decoding 64 tokens through the engine's scheduler, on
             `--model` (bench-full; real-qwen3-0.6b for a real model's shape), tokens/s, medians of
             `--repeats` alternated runs
  memory     bytes of the weights, and of the states a token adds (the cache takes the model's dtype)
  agreement  `--replies` greedy replies of the trained demo model loaded each way, against fp32

    python -m benchmarks.weights
    python -m benchmarks.weights --model real-qwen3-0.6b --tokens 250 --repeats 2 --replies 0
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch

from benchmarks.agreement import demo_agreement
from benchmarks.kv_cache import VOCAB, bytes_per_token, decode_speed
from benchmarks.report import publish, target_table
from cache_sessions.kv_cache import KVCacheKind
from cache_sessions.tensors import filled_bytes
from chat import ChatEngine
from chat.models import build_model, parameter_count
from chat.model_step.weights import apply_weight_format
from chat.scheduling.worker import ModelWorker

# name: (dtype, weights) as `--dtype` and `--weights` take them; fp32 first (the reference).
FORMATS = {"float32": ("float32", "full"), "packed": ("float32", "packed"), "bfloat16": ("bfloat16", "full"),
           "int8": ("float32", "int8")}


def run(model_name: str, tokens: int, repeats: int, replies: int) -> dict:
    worker = ModelWorker()
    models = {name: worker.run(lambda dtype=dtype, weights=weights: apply_weight_format(
                  build_model(model_name, VOCAB, None).to(getattr(torch, dtype)), weights))
              for name, (dtype, weights) in FORMATS.items()}
    speeds: dict[str, list[float]] = {name: [] for name in FORMATS}
    for repeat in range(repeats):
        order = list(FORMATS)[repeat % len(FORMATS):] + list(FORMATS)[: repeat % len(FORMATS)]
        for name in order:
            speeds[name].append(decode_speed(models[name], worker, KVCacheKind(), tokens))
    agreement = demo_agreement({name: lambda dtype=dtype, weights=weights: ChatEngine.load(
                                    "demo", dtype=dtype, weights=weights)
                                for name, (dtype, weights) in FORMATS.items()}, replies) if replies else {}
    return {"model": model_name, "parameters": parameter_count(models["float32"]), "tokens": tokens,
            "decode_tokens_per_s": {name: statistics.median(values) for name, values in speeds.items()},
            "runs": speeds, "repeats": repeats, "replies": replies, "agreement": agreement,
            "weight_bytes": {name: filled_bytes([*model.parameters(), *model.buffers()])
                             for name, model in models.items()},
            "state_bytes_per_token": {name: worker.run(bytes_per_token, model, KVCacheKind(), tokens)
                                      for name, model in models.items()},
            "torch": torch.__version__, "threads": torch.get_num_threads(), "cpu": platform.processor(),
            "load_before": os.getloadavg(), "command": "python -m benchmarks.weights " + " ".join(sys.argv[1:])}


def markdown(result: dict) -> str:
    speeds, weights, states = result["decode_tokens_per_s"], result["weight_bytes"], result["state_bytes_per_token"]
    lines = [f"{result['model']} ({result['parameters'] / 1e6:.1f} M parameters), one conversation of "
             f"{result['tokens']} tokens, medians of {result['repeats']}:", "",
             "| weights | decode tokens/s | weights | states a token |", "|---|---:|---:|---:|"]
    lines += [f"| {name} | {speeds[name]:.1f} | {weights[name] / 2**20:.0f} MiB | {states[name] / 1024:.1f} KiB |"
              for name in FORMATS]
    for name, agree in list(result["agreement"].items())[1:]:
        lines += ["", f"Demo model, {name} against fp32, {result['replies']} greedy replies: {agree['identical']:.0%} "
                      f"identical, {agree['prefix_share']:.0%} of reply tokens before the first difference."]
    return "\n".join(lines + ["", *target_table(result["targets"])])


def targets(result: dict) -> list[tuple[str, str, bool]]:
    speeds = result["decode_tokens_per_s"]
    return [(f"{name} weights decode faster than fp32 on this CPU", f"{speeds[name] / speeds['float32']:.2f}x",
             speeds[name] > speeds["float32"]) for name in list(FORMATS)[1:]]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="bench-full", help="a row of chat/models.py (bench-full, real-qwen3-0.6b)")
    parser.add_argument("--tokens", type=int, default=250)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--replies", type=int, default=100)
    parser.add_argument("--json", dest="json_path", default=None)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    with torch.no_grad():
        result = run(args.model, args.tokens, args.repeats, args.replies)
    return publish(result, started, targets=targets, markdown=markdown, plot=lambda *_: None,
                   json_path=args.json_path, plot_path=None)


if __name__ == "__main__":
    main()
