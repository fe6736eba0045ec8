"""A decode step of `--rows` conversations, eager against compiled (chat/model_step/compiled.py), in one process.

Histories of `--history` tokens are prefilled once (untimed); then rounds alternate
the two modes' order, each round timing `--steps` decode steps of each and rolling them back
(`crop`) so every step sees the same lengths. Eager is the engine's plain step of the rows run
eagerly (chat/model_step/plain_step.py), compiled the same function's graph of the rows' bucket
(1, 2, 4 or 8 rows). The
compile time is every bucket's up to that one; with `--store DIR` the graphs are saved there,
and a second run with the same folder (a restart) loads them instead (`rows_loaded`).
Greedy agreement: `--agree` greedy tokens decoded by each from the same history, and with
`--demo-replies N` the trained demo model's replies to N questions of its evaluation split through
an engine with the step compiled against one without (benchmarks/agreement.py), fp32 and int8.

    python -m benchmarks.compiled_step                                          # bench-full, fp32
    python -m benchmarks.compiled_step --model real-qwen3-0.6b --weights int8 --history 300
    python -m benchmarks.compiled_step --demo-replies 100
    python -m benchmarks.compiled_step --model real-qwen3-0.6b --store /tmp/steps   # twice: compile, then load
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path

import torch

from benchmarks.agreement import demo_agreement
from benchmarks.report import publish, target_table
from benchmarks.step_anatomy import VOCAB, conversation
from chat.model_step.plain_step import run_plain
from chat.model_step.compiled import CompiledDecode
from chat import ChatEngine
from chat.models import build_model, parameter_count
from chat.model_step.weights import WEIGHT_FORMATS, apply_weight_format

MODES = ("eager", "compiled")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="bench-full", help="a row of chat/models.py")
    parser.add_argument("--weights", default="full", choices=WEIGHT_FORMATS)
    parser.add_argument("--history", type=int, default=300, help="tokens held before each step")
    parser.add_argument("--rows", type=int, default=1, help="conversations decoding together")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--agree", type=int, default=32, help="greedy tokens compared between the two")
    parser.add_argument("--demo-replies", type=int, default=0, help="demo replies compared, compiled against eager")
    parser.add_argument("--store", help="a folder the graphs are saved to, or loaded from if there")
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    model = apply_weight_format(build_model(args.model, VOCAB, None), args.weights)
    compiled = CompiledDecode(model, "on", max_rows=args.rows,
                              store=Path(args.store) if args.store else None)
    if not compiled.enabled:
        raise SystemExit(f"not compiled: {compiled.reason}")
    compiled.warm()
    rows = [(session, [token]) for session, token in (conversation(model, args.history, seed) for seed in range(args.rows))]
    steps = {"eager": lambda: run_plain(model, rows, list(range(args.rows))),
             "compiled": lambda: compiled.step(rows)}
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    with torch.no_grad():
        for round_ in range(args.rounds):
            for mode in MODES if round_ % 2 == 0 else MODES[::-1]:
                for _ in range(args.steps):
                    begun = time.perf_counter()
                    steps[mode]()
                    times[mode].append(time.perf_counter() - begun)
                    for session, _ in rows:  # the ledgers were never told: they still say where they were
                        session.cache.crop(-1)
    median_ms = {mode: statistics.median(values) * 1000 for mode, values in times.items()}
    result = {"args": vars(args), "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
              "torch": torch.__version__, "parameters": parameter_count(model), "median_step_ms": median_ms,
              "eager_over_compiled": median_ms["eager"] / median_ms["compiled"],
              "compile_s": sum(compiled.compile_s.values()), "graphs": compiled.graphs,
              "rows_loaded": sorted(compiled.loaded),
              "greedy_agreement": greedy_agreement(model, compiled, args.agree)}
    if args.demo_replies:
        result["demo_agreement"] = {weights: demo_agreement(
            {"eager": lambda: ChatEngine.load("demo", weights=weights, compile="off", max_batch_size=1),
             "compiled": lambda: compiled_engine(weights)}, args.demo_replies)["compiled"] for weights in ("full", "int8")}
    return publish(result, started, targets=targets, markdown=markdown, plot=lambda *_: None,
                   json_path=args.json_path, plot_path=None)


@torch.no_grad()
def greedy_agreement(model, compiled: CompiledDecode, count: int) -> dict[str, int]:
    """Greedy tokens from one history, decoded eager and compiled: how many agree before the first
    difference (float noise can flip a near-tie, after which the two go different ways)."""
    replies = {}
    for mode in MODES:
        session, token = conversation(model, 40, seed=1)
        reply = []
        for _ in range(count):
            if mode == "eager":
                logits = run_plain(model, [(session, [token])], [0])
            else:
                logits = compiled.step([(session, [token])])
            session.note_extended([token])
            token = int(logits[0].argmax())
            reply.append(token)
        replies[mode] = reply
    same = next((index for index, (a, b) in enumerate(zip(*replies.values())) if a != b), count)
    return {"tokens": count, "equal_before_first_difference": same}


def compiled_engine(weights: str) -> ChatEngine:
    engine = ChatEngine.load("demo", weights=weights, compile="on", max_batch_size=1)
    if not engine.compiled.wait(1800):
        raise RuntimeError(f"the demo's step did not compile: {engine.compiled.stats()}")
    return engine


def targets(result: dict) -> list[tuple[str, str, bool]]:
    ratio = result["eager_over_compiled"]
    return [("a compiled step faster than eager", f"{ratio:.2f}x", ratio > 1.0)]


def markdown(result: dict) -> str:
    agreement = result["greedy_agreement"]
    lines = ["| step | median |", "|---|---:|"]
    lines += [f"| {mode} | {ms:.1f} ms |" for mode, ms in result["median_step_ms"].items()]
    lines += ["", f"eager / compiled: {result['eager_over_compiled']:.2f}x; "
              f"{'loaded from disk' if result.get('rows_loaded') else 'compiled'} in {result['compile_s']:.1f} s "
              f"({result['graphs']} graphs); greedy tokens equal: {agreement['equal_before_first_difference']} of "
              f"{agreement['tokens']}", ""]
    for weights, demo in result.get("demo_agreement", {}).items():
        lines += [f"demo model, {weights} weights, {result['args']['demo_replies']} replies: "
                  f"{demo['identical']:.0%} identical to eager, {demo['prefix_share']:.1%} of each before a difference", ""]
    return "\n".join(lines + target_table(result["targets"]))


if __name__ == "__main__":
    main()
