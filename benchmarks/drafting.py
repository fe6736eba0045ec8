"""Draft-and-verify decoding (issue #45 item 2, chat/drafting.py), in one run, through the library.

Each scenario is one reply of `--tokens` tokens (end token off, so every reply runs its length)
in a conversation with one earlier turn, timed from its first token to its last, with
`--draft` off, ngram and auto in rotating order, `--repeats` times; the figure is the median
reply tokens a second, and each mode's ratio to off.

- **retry**: a greedy reply, then Retry (greedy): the same reply, guessed from the version it
  replaces. The best case: every guess right.
- **retry-sampled**: a reply sampled at temperature 0.7 (seed 1), then Retry under seed 2: the
  earlier version is right only in part.
- **quote**: the model is made (`script_reply`) to answer by quoting a passage of the message,
  as a reply that restates code or text does: guessed from the prompt by its n-grams.
- **fresh**: a new message answered freely: random weights repeat little of anything, so this is
  what guessing costs where it finds nothing (auto's probes and the lookups).

The reply is the same in every mode (greedy, or seeded sampling; checked here). Random weights:
the acceptance of real replies is a property of the model and the text, not measured here.

`python -m benchmarks.drafting --help`; results go to benchmarks/results/drafting-*.json.
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
from pathlib import Path

import torch

from benchmarks.models import Words, build_bench_tokenizer
from chat import ChatEngine
from chat.drafting import DRAFT_MODES
from chat.models import build_model, parameter_count, script_reply

SCENARIOS = ("retry", "retry-sampled", "quote", "fresh")


def cpu_flags() -> str:
    """The vector extensions `lscpu` reports (what decides which kernels are fast)."""
    try:
        flags = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    line = next((line for line in flags.splitlines() if line.startswith("Flags:")), "")
    wanted = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "fma")
    return " ".join(flag for flag in line.split()[1:] if flag in wanted) or "none of avx2/avx512/amx"


def timed_reply(stream) -> tuple[float, int]:
    """Seconds from the reply's first delta to its end, and the deltas."""
    first, count = None, 0
    for _ in stream:
        first = first or time.perf_counter()
        count += 1
    return time.perf_counter() - (first or time.perf_counter()), count


def one_reply(model, tokenizer, mode: str, scenario: str, tokens: int, passage: str, compile: str) -> dict:
    engine = ChatEngine(model, tokenizer, draft=mode, compile=compile)
    conversation = engine.conversation("You are a helpful assistant.")
    greedy = dict(max_new_tokens=tokens, do_sample=False)
    sampled = dict(max_new_tokens=tokens, do_sample=True, temperature=0.7)
    if scenario in ("retry", "retry-sampled"):
        first = dict(greedy) if scenario == "retry" else dict(sampled, seed=1)
        list(conversation.send("Tell me about the weather today.", **first))
        again = dict(greedy) if scenario == "retry" else dict(sampled, seed=2)
        before = engine.runtime.scheduler.stats()
        seconds, _ = timed_reply(conversation.regenerate(**again))
    else:
        list(conversation.send("An earlier question?", max_new_tokens=4, do_sample=False))
        before = engine.runtime.scheduler.stats()
        message = f"Quote this back to me: {passage}" if scenario == "quote" else "Now tell me something new."
        seconds, _ = timed_reply(conversation.send(message, **greedy))
    after = engine.runtime.scheduler.stats()
    generated = len(conversation.reply_ids)
    return {"seconds": seconds, "tokens": generated, "tokens_per_s": (generated - 1) / seconds,
            "steps": after.steps - before.steps, "guessed": after.guessed - before.guessed,
            "taken": after.guesses_taken - before.guesses_taken, "reply": conversation.reply_ids}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="bench-full", help="a row of chat/models.py")
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--compile", default="off", help="the engine's --compile (auto: a graph built beside "
                        "each run from 200 M parameters, minutes of a core)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    tokenizer = build_bench_tokenizer()
    model = build_model(args.model, len(tokenizer), tokenizer.eos_token_id)
    model.generation_config.eos_token_id = None  # every reply runs to its length
    words = Words(seed=3)
    passage = " ".join(words.sentence(10) for _ in range(12))
    quoting = script_reply(build_model(args.model, len(tokenizer), tokenizer.eos_token_id), tokenizer, passage,
                           end_turn=False)
    quoting.generation_config.eos_token_id = None
    load_before = os.getloadavg()
    cells: dict[str, dict[str, list[dict]]] = {}
    for repeat in range(args.repeats):
        modes = DRAFT_MODES[repeat % 3:] + DRAFT_MODES[:repeat % 3]  # rotating order
        for scenario in args.scenarios.split(","):
            for mode in modes:
                run = one_reply(quoting if scenario == "quote" else model, tokenizer, mode, scenario, args.tokens,
                                passage, args.compile)
                cells.setdefault(scenario, {}).setdefault(mode, []).append(run)
    table = {}
    for scenario, modes in cells.items():
        replies = {mode: [run["reply"] for run in runs] for mode, runs in modes.items()}
        same = all(replies[mode] == replies["off"] for mode in replies)
        speed = {mode: statistics.median(run["tokens_per_s"] for run in runs) for mode, runs in modes.items()}
        table[scenario] = {
            "same_reply": same, "tokens_per_s": speed,
            "over_off": {mode: speed[mode] / speed["off"] for mode in speed},
            "taken_over_guessed": {mode: (sum(r["taken"] for r in runs) / max(1, sum(r["guessed"] for r in runs)))
                                   for mode, runs in modes.items()},
            "tokens_per_step": {mode: statistics.median(r["tokens"] / max(1, r["steps"]) for r in runs)
                                for mode, runs in modes.items()}}
    result = {"args": vars(args), "model": args.model, "parameters": parameter_count(model),
              "cpu_flags": cpu_flags(), "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
              "torch": torch.__version__, "load_before": load_before, "load_after": os.getloadavg(),
              "command": "python -m benchmarks.drafting " + " ".join(sys.argv[1:] if argv is None else argv),
              "table": table}
    print(f"{args.model}, {args.tokens} tokens a reply, medians of {args.repeats}; CPU flags: {result['cpu_flags']}; "
          f"load {load_before[0]:.1f} -> {result['load_after'][0]:.1f}")
    print("| scenario | same reply | off tok/s | ngram | auto | guesses taken (ngram / auto) | tokens a step (auto) |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for scenario, row in table.items():
        speed, ratio, taken = row["tokens_per_s"], row["over_off"], row["taken_over_guessed"]
        print(f"| {scenario} | {row['same_reply']} | {speed['off']:.1f} | {speed['ngram']:.1f} ({ratio['ngram']:.2f}x) "
              f"| {speed['auto']:.1f} ({ratio['auto']:.2f}x) | {taken['ngram']:.2f} / {taken['auto']:.2f} "
              f"| {row['tokens_per_step']['auto']:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
