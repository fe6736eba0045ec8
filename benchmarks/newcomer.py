"""A newcomer beside busy rows: how its message is fed, three ways alternated.

One client streams long replies on every row of the batch; another client then sends one short
message (`benchmarks.fairness`'s newcomer scenario, the engine made as there: `--config`). Its
time to first token against the same message on an idle engine, the arms alternated in one
process (`--arms`):

- "whole" (now): a message that fits one step within `StepBudget.whole_tokens` goes whole
  (`PromptPieces._whole_or`), and its prompt's end runs apart from the rows where their gap allows;
- "apart": cut to the step budget as any prompt, its prompt's end apart where the gap allows
  (`StepPlanner._rows_this_step`);
- "beside": cut to the budget, every row in every step (the code before both).

One untimed run of the scenario comes first: until steps of rows beside prompt tokens have
been timed, the step budget guesses (the first run after a start paid that, in whichever arm it
fell). The count of steps apart (`/status`'s `batch.newcomers_apart`) is kept with each run (the busy
client's own streams join as newcomers too), and what the busy streams paid: each one's worst
gap ending between the newcomer's Send and a step and a half after its first token (the median
over the streams) over their median gap.

`python -m benchmarks.newcomer --help`.
"""

from __future__ import annotations

import argparse
import os

from benchmarks.fairness import SYSTEM_PROMPT, engine_for, newcomer_beside_streams_scenario
from benchmarks.models import build_bench_tokenizer
from benchmarks.report import alternated, arms_heading, arms_record
from chat.models import build_model
from chat.model_step.weights import WEIGHT_FORMATS, apply_weight_format
from chat.scheduling.worker import ModelWorker

ARMS = ("whole", "apart", "beside")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="bench-full", help="a row of chat/models.py (bench-full, real-qwen3-0.6b)")
    parser.add_argument("--weights", default="full", choices=WEIGHT_FORMATS)
    parser.add_argument("--config", default="128/512", help="as benchmarks.fairness's --configs (one)")
    parser.add_argument("--reply-tokens", type=int, default=160, help="each long reply of the busy client")
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--arms", default=",".join(ARMS), help=f"some of {', '.join(ARMS)}, comma-separated")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    arms = args.arms.split(",")
    if not arms or set(arms) - set(ARMS):
        parser.error(f"--arms: some of {', '.join(ARMS)}")
    worker, tokenizer = ModelWorker(), build_bench_tokenizer()
    model = worker.run(build_model, args.model, len(tokenizer), tokenizer.eos_token_id)
    worker.run(apply_weight_format, model, args.weights)
    model.generation_config.eos_token_id = None  # every reply runs to its length
    engine = engine_for(args.config, model, tokenizer, worker)
    list(engine.conversation(SYSTEM_PROMPT).send("Warm up.", max_new_tokens=4))  # untimed: lazy set-up
    # untimed too: the engine's first steps of rows beside prompt tokens, which the step budget has
    # not timed yet (the first run after a start paid that, in whichever arm it fell)
    newcomer_beside_streams_scenario(engine, engine.scheduler.max_batch_size, args.reply_tokens)
    load_before = os.getloadavg()
    runs: dict[str, list[dict]] = {name: [] for name in arms}
    planner = engine.scheduler.planner
    for name in alternated(arms, args.repeats):
        planner.newcomers_apart, planner.whole_messages = name != "beside", name == "whole"
        steps_apart = engine.status()["batch"]["newcomers_apart"]
        run = newcomer_beside_streams_scenario(engine, engine.scheduler.max_batch_size, args.reply_tokens)
        run["steps_apart"] = engine.status()["batch"]["newcomers_apart"] - steps_apart
        runs[name].append(run)
    return arms_record("newcomer", args, argv, None, runs, load_before, markdown)


def markdown(result: dict) -> str:
    summary, arms = result["summary"], list(result["summary"])
    lines = [arms_heading(result), "", "| | " + " | ".join(arms) + " |", "|---|" + "---:|" * len(arms)]
    for label, key in (("newcomer's TTFT", "ttft_s"), ("the same message, idle engine", "idle_ttft_s")):
        lines.append(f"| {label} | " + " | ".join(f"{summary[arm][key] * 1000:.0f} ms" for arm in arms) + " |")
    lines.append("| TTFT / idle | " + " | ".join(f"{summary[arm]['over_idle']:.2f}x" for arm in arms) + " |")
    lines.append("| the busy streams' worst gap near the newcomer's first token / their median | "
                 + " | ".join(f"{summary[arm]['streams_worst_gap_near_over_median']:.2f}x" for arm in arms) + " |")
    lines.append("| each run's TTFT / idle | " + " | ".join(
        ", ".join(f"{run['over_idle']:.2f}x" for run in result["runs"][arm]) for arm in arms) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
