"""What planning a reply costs on a history longer than the context, in one run.

For histories of N turns (every message `--chars` characters) restored from saved data, one Send
with the oldest turns left out to fit the context: the plan as the app makes it
(chat/dialogue/fitting.py) against the old way (drop one oldest turn, render and tokenize everything
again, until it fits), done here for the sizes it finishes in reasonable time. Then the issue's
case: a restored 250-turn, 2,000,000-character history on the demo model, one Send, planned and
answered. Medians of `--repeats`; the per-turn cost shows whether planning grows linearly.

`python -m benchmarks.planning --help`; results go to benchmarks/results/planning.*.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from chat import ChatEngine, GenerationOptions, Send
from chat.dialogue.fitting import REFIT_SHARE
from chat.dialogue.history import History, ReplyVersion
from chat.dialogue.plans import Planner

WORDS = "what is forty seven plus thirty eight the answer step by step is eighty five".split()


def history_of(turns: int, chars: int) -> History:
    history = History()
    for turn in range(turns):
        words = " ".join(WORDS[(turn + i) % len(WORDS)] for i in range(chars // 4))
        path = history.entries + [history.node("user", words[:chars])]
        version = ReplyVersion(words[:chars], "", None, None, False, False)
        history.record_reply(path, history.node("assistant"), version)
    return history


def old_way(planner: Planner, history: History, question: str, options: GenerationOptions) -> int:
    """Drop the oldest turn and render everything again until it fits (what planning did before),
    once any must go down to `REFIT_SHARE` of the room, as the app now cuts (chat/dialogue/fitting.py)."""
    template, limit = planner.template, planner.context_limit
    messages = history.messages + [{"role": "user", "content": question}]
    room = limit - options.max_new_tokens
    dropped = 0
    while len(template.render(messages, enable_thinking=options.enable_thinking).ids) > room:
        users = [i for i, m in enumerate(messages) if m["role"] == "user"]
        del messages[users[0]:users[1]]
        dropped += 1
        room = int((limit - options.max_new_tokens) * REFIT_SHARE)  # the newest turn alone fits it here
    return dropped


def timed(function: Any, repeats: int) -> tuple[float, Any]:
    times, result = [], None
    for _ in range(repeats):
        started = time.perf_counter()
        result = function()
        times.append(time.perf_counter() - started)
    return statistics.median(times), result


def sizes_run(engine: ChatEngine, turn_counts: list[int], chars: int, old_up_to: int, repeats: int) -> list[dict]:
    options = GenerationOptions(max_new_tokens=256)
    question = "And now a short question?"
    rows = []
    for turns in turn_counts:
        history = history_of(turns, chars)
        plan_s, plan = timed(lambda: engine.planner.plan(Send(question, fit_context=True), history, options, 0),
                             repeats)
        row = {"turns": turns, "chars": 2 * turns * chars, "plan_s": plan_s, "dropped_turns": plan.dropped_turns,
               "prompt_tokens": len(plan.request.prompt_ids), "plan_s_per_turn": plan_s / turns}
        if turns <= old_up_to:
            old_s, dropped = timed(lambda: old_way(engine.planner, history, question, options), 1)
            assert dropped == plan.dropped_turns, (dropped, plan.dropped_turns)  # the same cut
            row.update(old_s=old_s, speedup=old_s / plan_s)
        rows.append(row)
        print(f"{turns} turns: plan {plan_s * 1000:.1f} ms" + (f", old way {row['old_s']:.2f} s" if "old_s" in row
                                                                else ""), file=sys.stderr)
    return rows


def restored_send(engine: ChatEngine, repeats: int) -> dict:
    """The issue's case: 250 turns, 2,000,000 characters, restored, then one Send."""
    data = history_of(250, 4000)
    from chat.dialogue import saved

    saved_data = json.loads(json.dumps(saved.to_dict(data)))
    restore_s, conv = timed(lambda: engine.restore(saved_data), repeats)
    options = GenerationOptions(max_new_tokens=32, do_sample=False)
    plan_s, plan = timed(lambda: conv.plan(Send("What is 47 + 38?", fit_context=True), options), repeats)
    started = time.perf_counter()
    list(conv.run(plan))
    reply_s = time.perf_counter() - started
    return {"turns": 250, "chars": sum(len(m["content"]) for m in saved_data["messages"]), "restore_s": restore_s,
            "plan_s": plan_s, "dropped_turns": plan.dropped_turns, "prompt_tokens": conv.stats.prompt_tokens,
            "ttft_s": conv.stats.ttft_s, "reply_s": reply_s}


def markdown(result: dict) -> str:
    lines = [f"Planning one Send on a history longer than the context ({result['config']['model']}, context "
             f"{result['config']['context_limit']} tokens, {result['config']['threads']} threads).", ""]
    for series in result["series"]:
        lines += [f"Every message {series['chars_per_message']} characters:", "",
                  "| turns | characters | dropped | plan | per turn | old way | speed-up |",
                  "|---:|---:|---:|---:|---:|---:|---:|"]
        for row in series["rows"]:
            old = f"{row['old_s'] * 1000:.0f} ms | {row['speedup']:.1f}x" if "old_s" in row else "not run | "
            lines.append(f"| {row['turns']} | {row['chars']:,} | {row['dropped_turns']} | "
                         f"{row['plan_s'] * 1000:.1f} ms | {row['plan_s_per_turn'] * 1e6:.0f} µs | {old} |")
        lines.append("")
    case = result["restored_send"]
    lines += [f"Restored {case['turns']} turns, {case['chars']:,} characters, one Send: restore "
              f"{case['restore_s'] * 1000:.0f} ms, plan {case['plan_s'] * 1000:.0f} ms ({case['dropped_turns']} turns "
              f"left out, {case['prompt_tokens']} prompt tokens), first token {case['ttft_s'] * 1000:.0f} ms after the "
              f"plan, whole reply {case['reply_s']:.2f} s."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--turns", default="10,50,250")
    parser.add_argument("--chars", default="200,1000,4000", help="characters per message, one series each")
    parser.add_argument("--old-up-to", type=int, default=50, help="run the old way up to this many turns")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default="benchmarks/results/planning.json")
    parser.add_argument("--markdown", default="benchmarks/results/planning.md")
    args = parser.parse_args(argv)
    engine = ChatEngine.load(args.model)
    result: dict[str, Any] = {"config": {"model": args.model, "context_limit": engine.context_limit,
                                         "threads": torch.get_num_threads(), "python": platform.python_version(),
                                         "torch": torch.__version__}, "series": []}
    for chars in [int(c) for c in args.chars.split(",")]:
        rows = sizes_run(engine, [int(t) for t in args.turns.split(",")], chars, args.old_up_to, args.repeats)
        result["series"].append({"chars_per_message": chars, "rows": rows})
    result["restored_send"] = restored_send(engine, args.repeats)
    text = markdown(result)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")
    return result


if __name__ == "__main__":
    main()
