"""A newcomer beside busy rows (#43): its prompt's end in a step of its own, against beside the rows.

One client streams long replies on every row of the batch; another client then sends one short
message (`benchmarks.fairness`'s newcomer scenario, the engine made as there: `--config`). Its
time to first token against the same message on an idle engine, both ways alternated in one
process: "apart" (the step that feeds a newcomer's prompt end runs it without the other decode
rows where their gap allows: `StepPlanner._rows_this_step`) and "beside" (every row in every
step: the code before). The count of such steps (`/status`'s `batch.newcomers_apart`) is kept
with each run (the busy client's own streams join as newcomers too), and what the busy streams
paid: their longest gap across the newcomer's first token over their median gap.

`python -m benchmarks.newcomer --help`.
"""

from __future__ import annotations

import argparse
import os

from benchmarks.fairness import SYSTEM_PROMPT, engine_for, newcomer_beside_streams_scenario
from benchmarks.models import build_bench_tokenizer
from benchmarks.report import alternated, arms_heading, arms_record
from chat.models import build_model
from chat.weights import WEIGHT_FORMATS, apply_weight_format
from chat.worker import ModelWorker

ARMS = ("apart", "beside")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="bench-full", help="a row of chat/models.py (bench-full, real-qwen3-0.6b)")
    parser.add_argument("--weights", default="full", choices=WEIGHT_FORMATS)
    parser.add_argument("--config", default="128/512", help="as benchmarks.fairness's --configs (one)")
    parser.add_argument("--reply-tokens", type=int, default=160, help="each long reply of the busy client")
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    worker, tokenizer = ModelWorker(), build_bench_tokenizer()
    model = worker.run(build_model, args.model, len(tokenizer), tokenizer.eos_token_id)
    worker.run(apply_weight_format, model, args.weights)
    model.generation_config.eos_token_id = None  # every reply runs to its length
    engine = engine_for(args.config, model, tokenizer, worker)
    list(engine.conversation(SYSTEM_PROMPT).send("Warm up.", max_new_tokens=4))  # untimed: lazy set-up
    load_before = os.getloadavg()
    runs: dict[str, list[dict]] = {name: [] for name in ARMS}
    for name in alternated(ARMS, args.repeats):
        engine.scheduler.planner.newcomers_apart = name == "apart"
        steps_apart = engine.status()["batch"]["newcomers_apart"]
        run = newcomer_beside_streams_scenario(engine, engine.scheduler.max_batch_size, args.reply_tokens)
        run["steps_apart"] = engine.status()["batch"]["newcomers_apart"] - steps_apart
        runs[name].append(run)
    return arms_record("newcomer", args, argv, None, runs, load_before, markdown)


def markdown(result: dict) -> str:
    apart, beside = result["summary"]["apart"], result["summary"]["beside"]
    lines = [arms_heading(result), "",
             "| | beside the rows (before) | apart (now) |", "|---|---:|---:|"]
    for label, key in (("newcomer's TTFT", "ttft_s"), ("the same message, idle engine", "idle_ttft_s")):
        lines.append(f"| {label} | {beside[key] * 1000:.0f} ms | {apart[key] * 1000:.0f} ms |")
    lines.append(f"| TTFT / idle | {beside['over_idle']:.2f}x | {apart['over_idle']:.2f}x |")
    lines.append(f"| the busy streams' gap across the newcomer's first token / their median | "
                 f"{beside['streams_gap_across_over_median']:.2f}x | {apart['streams_gap_across_over_median']:.2f}x |")
    each = {name: ", ".join(f"{run['over_idle']:.2f}x" for run in result["runs"][name]) for name in ARMS}
    lines.append(f"| each run's TTFT / idle | {each['beside']} | {each['apart']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
