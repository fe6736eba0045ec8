"""What a cold start costs the users while the compiled steps build, with the compiling
thread yielding the CPU (nice 19, the engine's way) and competing as an equal, in one run.

Each start is a process of its own with an empty cache folder (`XDG_CACHE_HOME`: nothing compiled
before, inductor's cache empty too), the two ways alternated `--repeats` times. In it: the model
(`--model`, random weights, `--weights`), then

  eager    an engine with `--compile on` whose compiling has not started yet: one
           conversation's greedy replies of `--tokens` tokens, decode tokens/s (the speed a user
           gets before any graph is ready)
  during   its compiling started (the one-row graph builds on its own thread), and the same
           replies one after another until the graph is ready: tokens/s of the replies that
           ended before it was
  compiled the same replies once the graph is ready

Ratios against `eager` in the same process; the compile time of the one-row graph beside them.

    python -m benchmarks.cold_start --model real-qwen3-0.6b --weights int8 --json benchmarks/results/cold-start.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks.report import publish, target_table

WAYS = ("yield", "contend")  # the compiling thread at nice 19, or at the steps' own priority


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="bench-full", help="a row of chat/models.py")
    parser.add_argument("--weights", default="full")
    parser.add_argument("--tokens", type=int, default=32, help="tokens a reply")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--ways", nargs="+", choices=WAYS, default=list(WAYS))
    parser.add_argument("--child", choices=WAYS, help=argparse.SUPPRESS)
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(one_start(args)), flush=True)
        return {}
    started = time.perf_counter()
    runs: dict[str, list[dict]] = {way: [] for way in args.ways}
    for repeat in range(args.repeats):
        for way in args.ways if repeat % 2 == 0 else args.ways[::-1]:
            cache = tempfile.mkdtemp(prefix="rewind-cold-")
            try:
                command = [sys.executable, "-m", "benchmarks.cold_start", "--child", way, "--model", args.model,
                           "--weights", args.weights, "--tokens", str(args.tokens)]
                env = dict(os.environ, XDG_CACHE_HOME=cache)
                env.pop("TORCHINDUCTOR_CACHE_DIR", None)  # inductor's cache in the empty folder too
                done = subprocess.run(command, env=env, capture_output=True, text=True)
                if done.returncode != 0:
                    raise RuntimeError(f"the {way} start failed:\n{done.stderr[-3000:]}")
                runs[way].append(json.loads(done.stdout.strip().splitlines()[-1]))
            finally:
                shutil.rmtree(cache, ignore_errors=True)
    summary = {way: {key: statistics.median(run[key] for run in rows) for key in
                     ("during_over_eager", "compiled_over_eager", "compile_s", "eager_tokens_per_s")}
               for way, rows in runs.items()}
    result = {"args": {k: v for k, v in vars(args).items() if k != "child"}, "runs": runs, "median": summary}
    return publish(result, started, targets=targets, markdown=markdown, plot=lambda *_: None,
                   json_path=args.json_path, plot_path=None)


def one_start(args: argparse.Namespace) -> dict:
    """In the child: eager replies, then replies while the one-row graph builds, then compiled."""
    import chat.model_step.compiled
    from benchmarks.models import build_bench_tokenizer
    from benchmarks.step_anatomy import VOCAB
    from chat import ChatEngine
    from chat.models import build_model
    from chat.model_step.weights import apply_weight_format

    if args.child == "contend":
        chat.model_step.compiled.COMPILE_NICE = 0
    tokenizer = build_bench_tokenizer()
    model = apply_weight_format(build_model(args.model, VOCAB, None), args.weights)

    def reply_rate(engine) -> float:
        conversation = engine.conversation("You are terse.")
        for _ in conversation.send("Tell me about the weather in some detail.", max_new_tokens=args.tokens,
                                   do_sample=False):
            pass
        return conversation.stats.decode_tokens_per_s

    start = chat.model_step.compiled.CompiledDecode.start
    chat.model_step.compiled.CompiledDecode.start = lambda self: None  # not yet: eager first
    engine = ChatEngine(model, tokenizer, max_batch_size=1, compile="on")
    chat.model_step.compiled.CompiledDecode.start = start
    reply_rate(engine)  # warm-up
    eager = statistics.median(reply_rate(engine) for _ in range(3))
    engine.compiled.start()
    during = []
    while not engine.compiled.ready and engine.compiled.enabled:
        rate = reply_rate(engine)
        if not engine.compiled.ready:
            during.append(rate)
    compiled = statistics.median(reply_rate(engine) for _ in range(3))
    status = engine.status()["compiled_step"]
    return {"eager_tokens_per_s": eager, "during_tokens_per_s_median": statistics.median(during) if during else None,
            "during_tokens_per_s_worst": min(during, default=None), "compiled_tokens_per_s": compiled,
            "during_over_eager": statistics.median(during) / eager if during else float("nan"),
            "compiled_over_eager": compiled / eager, "compile_s": engine.compiled.compile_s.get(1, float("nan")),
            "compile_priority": status["compile_priority"], "replies_during": len(during)}


def targets(result: dict) -> list[tuple[str, str, bool]]:
    if "yield" not in result["median"]:
        return []
    ratio = result["median"]["yield"]["during_over_eager"]
    return [("while the graph builds, a user decodes at >= 0.8x eager speed (nice 19)", f"{ratio:.2f}x", ratio >= 0.8)]


def markdown(result: dict) -> str:
    lines = ["| compiling thread | eager tokens/s | during the build / eager | compiled / eager | one-row graph built in |",
             "|---|---:|---:|---:|---:|"]
    for way, row in result["median"].items():
        lines.append(f"| {way} | {row['eager_tokens_per_s']:.1f} | {row['during_over_eager']:.2f}x | "
                     f"{row['compiled_over_eager']:.2f}x | {row['compile_s']:.1f} s |")
    return "\n".join(lines + [""] + target_table(result["targets"]))


if __name__ == "__main__":
    main()
