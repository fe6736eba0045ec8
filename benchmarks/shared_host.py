"""Decode speed on a shared host: quiet, and with another process busy on the same cores.

A free Space shares its 2 vCPUs with whatever else the host runs. PyTorch's OpenMP workers spin
while they wait for work by default (`OMP_WAIT_POLICY` unset: 300,000 turns, then sleep), so two
processes that both spin take turns badly; workers that sleep at once are slow to wake for each
of a step's products (oneDNN's, `--weights packed`, most). Each setting runs in a fresh process (OpenMP reads its settings when torch
loads): one conversation of `--history` tokens decodes `--tokens` greedy tokens through the
engine's scheduler. The competitor is another torch process multiplying matrices on 2 threads,
with default settings (another tenant, not ours to tune). Runs alternate; medians of tokens/s.

    python -m benchmarks.shared_host
    python -m benchmarks.shared_host --model real-qwen3-0.6b --weights packed --tokens 32 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

from benchmarks.report import publish, target_table

# name -> (environment added, torch threads)
# OpenMP (GCC's libgomp, torch's on Linux) with no wait policy: a worker spins GOMP_SPINCOUNT
# times after its work, then sleeps; 300,000 is its own default. Every setting is spelt out, so
# chat/host.py (imported first by every benchmark) leaves it as given.
OPENMP_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
SETTINGS = {
    "default": ({"GOMP_SPINCOUNT": "300000"}, 2),
    "passive": ({"OMP_WAIT_POLICY": "PASSIVE"}, 2),
    "passive, 1 thread": ({"OMP_WAIT_POLICY": "PASSIVE"}, 1),
    "brief spin": ({"GOMP_SPINCOUNT": "100000"}, 2),
}
LOADS = ("quiet", "busy")
COMPETITOR = ("import torch\ntorch.set_num_threads(2)\na = torch.randn(1024, 1024)\n"
              "while True:\n    a @ a\n")


def child(model_name: str, history: int, tokens: int, threads: int, weights: str) -> float:
    """In the measured process: decode speed of one conversation, through the engine's scheduler."""
    import random
    import threading

    import torch

    from chat.models import build_model
    from chat.dialogue.options import GenerationOptions
    from chat.scheduling.scheduler import DecodeScheduler
    from chat.model_step.weights import apply_weight_format
    from chat.scheduling.worker import ModelWorker

    worker = ModelWorker()
    worker.run(torch.set_num_threads, threads)
    model = worker.run(lambda: apply_weight_format(build_model(model_name, 8192, None), weights))
    scheduler = DecodeScheduler(model, worker)
    session = scheduler.caches.new_session()
    rng = random.Random(0)
    prompt = [rng.randrange(8192) for _ in range(history + 1)]
    request = scheduler.submit(session, prompt, GenerationOptions(max_new_tokens=tokens, do_sample=False),
                               threading.Event())
    for _ in request.tokens():
        pass
    request.finish()
    return (tokens - 1) / (request.last_token_at - request.first_token_at)


def measure(setting: str, load: str, model_name: str, history: int, tokens: int, weights: str) -> float:
    extra, threads = SETTINGS[setting]
    bare = {key: value for key, value in os.environ.items() if key not in OPENMP_VARIABLES}
    competitor = None
    if load == "busy":
        competitor = subprocess.Popen([sys.executable, "-c", COMPETITOR], env=bare)
    try:
        output = subprocess.run([sys.executable, "-m", "benchmarks.shared_host", "--child", "--model", model_name,
                                 "--history", str(history), "--tokens", str(tokens), "--threads", str(threads),
                                 "--weights", weights],
                                env=bare | extra, capture_output=True, text=True, check=True, timeout=600).stdout
    finally:
        if competitor is not None:
            competitor.kill()
            competitor.wait()
    return json.loads(output.strip().splitlines()[-1])["tokens_per_s"]


def run(model_name: str, history: int, tokens: int, repeats: int, weights: str) -> dict:
    cells: dict[str, list[float]] = {}
    names = list(SETTINGS)
    for repeat in range(repeats):
        for load in LOADS:
            for setting in names[repeat % len(names):] + names[: repeat % len(names)]:  # rotating order
                cells.setdefault(f"{setting}/{load}", []).append(measure(setting, load, model_name, history, tokens, weights))
    return {"model": model_name, "weights": weights, "history": history, "tokens": tokens, "repeats": repeats,
            "tokens_per_s": {key: statistics.median(values) for key, values in cells.items()}, "runs": cells,
            "settings": {name: {"env": env, "threads": threads} for name, (env, threads) in SETTINGS.items()},
            "competitor": COMPETITOR, "cpu": platform.processor(), "cores": os.cpu_count(),
            "load_before": os.getloadavg(), "command": "python -m benchmarks.shared_host " + " ".join(sys.argv[1:])}


def markdown(result: dict) -> str:
    speeds = result["tokens_per_s"]
    lines = [f"{result['model']}, one conversation of {result['history']} tokens decoding {result['tokens']} tokens; "
             f"tokens/s, medians of {result['repeats']}:", "", "| setting | quiet | busy | busy / quiet |",
             "|---|---:|---:|---:|"]
    for name in SETTINGS:
        quiet, busy = speeds[f"{name}/quiet"], speeds[f"{name}/busy"]
        lines.append(f"| {name} | {quiet:.1f} | {busy:.1f} | {busy / quiet:.2f}x |")
    return "\n".join(lines + ["", *target_table(result["targets"])])


def targets(result: dict) -> list[tuple[str, str, bool]]:
    speeds = result["tokens_per_s"]
    busy = speeds["passive/busy"] / speeds["default/busy"]
    quiet = speeds["passive/quiet"] / speeds["default/quiet"]
    return [("the app's setting (passive) holds up under a busy neighbour", f"{busy:.2f}x the default's speed",
             busy >= 1.0),
            ("and costs nothing when the host is quiet (within 5 %)", f"{quiet:.2f}x", quiet >= 0.95)]


def main(argv: list[str] | None = None) -> dict | None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="bench-full")
    parser.add_argument("--history", type=int, default=250)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--weights", default="full", help="full, packed or int8 (chat/model_step/weights.py)")
    parser.add_argument("--json", dest="json_path", default=None)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps({"tokens_per_s": child(args.model, args.history, args.tokens, args.threads, args.weights)}), flush=True)
        os._exit(0)  # the engine's compute thread is a daemon inside OpenMP: a normal exit can abort
    started = time.perf_counter()
    result = run(args.model, args.history, args.tokens, args.repeats, args.weights)
    return publish(result, started, targets=targets, markdown=markdown, plot=lambda *_: None,
                   json_path=args.json_path, plot_path=None)


if __name__ == "__main__":
    main()
