"""Int8 prompts: the product each host runs fastest (kernels chosen by the host,
prompts at the compute limit), in one run.

`--weights int8` multiplies a decode step's few rows with the weight-only int8 kernel; a prompt
piece's many rows go through `Int8Linear.prompt_product`, whose kernel the engine times at start
(`chat.model_step.weights.choose_prompt_kernel`): "fp32" (the levels turned into fp32) or "bf16" (turned into
bf16, summed by the CPU's bf16 product). This prefills a `--prompt`-token prompt in one piece into
an empty cache of `--model` (real-qwen3-0.6b: Qwen3-0.6B's shape) with each kernel forced, and the
fp32 model as it is, alternated, `--repeats` times: milliseconds (median), prompt tokens a second,
and what that is of a square product's GFLOP/s in the same precision (the practical peak; 2,048
rows by default, `--peak-size`: a host without bf16 products takes about a minute for each bf16 one).
It also reports the largest difference of the last position's logits between the two kernels.

`python -m benchmarks.prompt_kernels --help`; results go to benchmarks/results/prompt-kernels*.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.report import cpu_flags
from chat.models import build_model, parameter_count
from chat.model_step.weights import Int8Linear, apply_weight_format, prompt_kernel_choice

VOCAB = 8192


@torch.no_grad()
def matmul_peak_gflops(dtype: torch.dtype, size: int = 2048, repeats: int = 5) -> float:
    """What these cores reach on one large square product in `dtype`: the practical peak."""
    a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
    a @ b
    runs = []
    for _ in range(repeats):
        started = time.perf_counter()
        a @ b
        runs.append(time.perf_counter() - started)
    return 2 * size**3 / statistics.median(runs) / 1e9


@torch.no_grad()
def prefill_ms(model, prompt: torch.Tensor) -> tuple[float, torch.Tensor]:
    started = time.perf_counter()
    logits = model(input_ids=prompt, use_cache=True, logits_to_keep=1).logits[0, -1]
    return (time.perf_counter() - started) * 1000, logits


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="real-qwen3-0.6b", help="a row of chat/models.py")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--peak-size", type=int, default=2048, help="rows of the square product timed as the peak")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    full = build_model(args.model, VOCAB, None)
    int8 = apply_weight_format(build_model(args.model, VOCAB, None), "int8")
    chosen = prompt_kernel_choice()
    prompt = torch.randint(0, VOCAB, (1, args.prompt))
    load_before = os.getloadavg()
    ways = ["fp32-model", "int8/fp32", "int8/bf16"]
    times: dict[str, list[float]] = {way: [] for way in ways}
    last: dict[str, torch.Tensor] = {}
    layers = [module for module in int8.modules() if isinstance(module, Int8Linear)]
    for repeat in range(args.repeats + 1):  # the first round warms up, untimed
        for way in ways[repeat % 3:] + ways[:repeat % 3]:
            for layer in layers:
                layer.prompt_kernel = way.split("/")[-1]
            ms, logits = prefill_ms(full if way == "fp32-model" else int8, prompt)
            last[way] = logits
            if repeat:
                times[way].append(ms)
    medians = {way: statistics.median(values) for way, values in times.items()}
    peaks = {dtype: matmul_peak_gflops(getattr(torch, name), args.peak_size)
             for dtype, name in (("fp32", "float32"), ("bf16", "bfloat16"))}
    flops = 2 * parameter_count(full) * args.prompt  # the products' multiply-adds, attention aside
    result = {"args": vars(args), "model": args.model, "parameters": parameter_count(full),
              "cpu_flags": cpu_flags(), "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
              "torch": torch.__version__, "load_before": load_before, "load_after": os.getloadavg(),
              "command": "python -m benchmarks.prompt_kernels " + " ".join(sys.argv[1:] if argv is None else argv),
              "engine_chose": chosen, "prefill_ms": medians, "runs": times,
              "prompt_tokens_per_s": {way: args.prompt / (ms / 1000) for way, ms in medians.items()},
              "gflops": {way: flops / (ms / 1000) / 1e9 for way, ms in medians.items()},
              "peak_gflops_square_matmul": peaks, "peak_size": args.peak_size,
              "bf16_over_fp32_kernel": medians["int8/fp32"] / medians["int8/bf16"],
              "kernels_logit_max_difference": float((last["int8/bf16"] - last["int8/fp32"]).abs().max())}
    print(f"{args.model}, a {args.prompt}-token prompt in one piece, medians of {args.repeats}; CPU flags: "
          f"{result['cpu_flags']}; load {load_before[0]:.1f} -> {result['load_after'][0]:.1f}; engine chose "
          f"{chosen['chosen'] if chosen else None} ({chosen['ms'] if chosen else {}} ms at 256 rows)")
    for way in ways:
        peak = peaks["bf16" if way == "int8/bf16" else "fp32"]
        print(f"  {way:11s} {medians[way]:8.0f} ms  {result['prompt_tokens_per_s'][way]:6.0f} tokens/s  "
              f"{result['gflops'][way]:6.0f} GFLOP/s (products; {result['gflops'][way] / peak:.2f}x a {args.peak_size}-square "
              f"{'bf16' if way == 'int8/bf16' else 'fp32'} product's {peak:.0f})")
    print(f"  int8 prompt, bf16 kernel against fp32 kernel: {result['bf16_over_fp32_kernel']:.2f}x; "
          f"logits differ by {result['kernels_logit_max_difference']:.3g} at most")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
