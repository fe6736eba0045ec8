"""Draft-and-verify decoding (chat/scheduling/drafting.py), in one run, through the library.

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
- **right**: the same fresh reply, every step guessing the next 8 tokens of the reply
  drafting-off gives: every guess right by construction, where a Retry's can part from the
  version it replaces (with int8 weights the first reply's first token came from a step of the
  whole prompt, the Retry's from a step of one token: other roundings).
- **wrong**: the same fresh reply, every step guessing 8 tokens of which the first is wrong (the
  reply drafting-off gives says what is right): what wrong guesses cost, and how fast auto stops.
- **demo** (`--demo N`): the trained demo model on N of its held-out conversations (chat/assets;
  demo_model/held_out.py), every turn greedy with thinking on, each conversation in every mode in
  rotating order, as one sum of reply tokens over reply seconds: its thinking copies the
  question's operands, so its guesses are real ones.

The reply is the same in every mode (greedy, or seeded sampling; checked here). Random weights:
the acceptance of real replies is a property of the model and the text, not measured here.

`python -m benchmarks.drafting --help`; results go to benchmarks/results/drafting-*.json.
"""

from __future__ import annotations

import argparse
import json
import random
import os
import platform
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch

import chat.scheduling.drafting

from benchmarks.models import Words, build_bench_tokenizer
from benchmarks.report import cpu_flags
from chat import ChatEngine
from chat.scheduling.drafting import DRAFT_MODES
from chat.models import build_model, parameter_count, script_reply

SCENARIOS = ("retry", "retry-sampled", "quote", "fresh", "right", "wrong")


def timed_reply(stream) -> tuple[float, int]:
    """Seconds from the reply's first delta to its end, and the deltas."""
    first, count = None, 0
    for _ in stream:
        first = first or time.perf_counter()
        count += 1
    return time.perf_counter() - (first or time.perf_counter()), count


@contextmanager
def guessing_from(truth: list[int], vocabulary: int, right: bool) -> Iterator[None]:
    """Every guess what `truth` has next (`right`), or a wrong first token (the one after the
    right one) then more of it."""
    own = chat.scheduling.drafting.Drafter.propose

    def from_truth(self, sequence, limit):
        if right:
            return truth[len(sequence):len(sequence) + limit]
        token = truth[len(sequence)] if len(sequence) < len(truth) else 0
        return [(token + 1) % vocabulary] * limit

    chat.scheduling.drafting.Drafter.propose = from_truth
    try:
        yield
    finally:
        chat.scheduling.drafting.Drafter.propose = own


def one_reply(model, tokenizer, mode: str, scenario: str, tokens: int, passage: str, compile: str,
              weights: str, truth: list[int] | None = None) -> dict:
    if scenario in ("right", "wrong"):
        assert truth is not None
        with guessing_from(truth, len(tokenizer), right=scenario == "right"):
            return one_reply(model, tokenizer, mode, "fresh", tokens, passage, compile, weights)
    engine = ChatEngine(model, tokenizer, draft=mode, compile=compile, weights=weights)
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
            "taken": after.guesses_taken - before.guesses_taken, "reply": conversation.reply_ids,
            "sequence": conversation.session.token_ids + conversation.reply_ids[-1:]}


def demo_runs(count: int) -> dict[str, dict]:
    """The demo model on `count` held-out conversations, every turn greedy with thinking on, each
    conversation in every mode in rotating order (one engine a mode, loaded once)."""
    from demo_model import held_out

    engines = {mode: ChatEngine.load("demo", draft=mode) for mode in DRAFT_MODES}
    chosen = held_out.conversations(random.Random(11), max(1, count // len(held_out.CATEGORIES)))[:count]
    runs = {mode: {"seconds": 0.0, "tokens": 0, "guessed": 0, "taken": 0, "replies": []} for mode in DRAFT_MODES}
    for number, conversation in enumerate(chosen):
        for mode in DRAFT_MODES[number % 3:] + DRAFT_MODES[:number % 3]:
            engine, run = engines[mode], runs[mode]
            chat = engine.conversation()
            for text in conversation.turns:
                before = engine.runtime.scheduler.stats()
                took, _ = timed_reply(chat.send(text, max_new_tokens=256, do_sample=False, enable_thinking=True))
                after = engine.runtime.scheduler.stats()
                run["seconds"] += took
                run["tokens"] += max(0, len(chat.reply_ids) - 1)
                run["guessed"] += after.guessed - before.guessed
                run["taken"] += after.guesses_taken - before.guesses_taken
                run["replies"].append(chat.reply_ids)
    return {mode: {"conversations": len(chosen), "replies": run["replies"], "reply_tokens": run["tokens"],
                   "tokens_per_s": run["tokens"] / run["seconds"],
                   "taken_over_guessed": run["taken"] / max(1, run["guessed"])} for mode, run in runs.items()}


def scenario_table(cells: dict[str, dict[str, list[dict]]]) -> dict[str, dict]:
    """Per scenario: whether every mode gave the reply drafting-off gave, and each mode's median
    tokens a second, its ratio to off, the share of guesses taken and the tokens a step."""
    table = {}
    for scenario, modes in cells.items():
        replies = {mode: [run["reply"] for run in runs] for mode, runs in modes.items()}
        speed = {mode: statistics.median(run["tokens_per_s"] for run in runs) for mode, runs in modes.items()}
        table[scenario] = {
            "same_reply": all(replies[mode] == replies["off"] for mode in replies), "tokens_per_s": speed,
            "over_off": {mode: speed[mode] / speed["off"] for mode in speed},
            "taken_over_guessed": {mode: (sum(r["taken"] for r in runs) / max(1, sum(r["guessed"] for r in runs)))
                                   for mode, runs in modes.items()},
            "tokens_per_step": {mode: statistics.median(r["tokens"] / max(1, r["steps"]) for r in runs)
                                for mode, runs in modes.items()}}
    return table


def demo_table(count: int) -> dict:
    """`demo_runs`, summed up as the table's rows are."""
    runs = demo_runs(count)
    return {"conversations": runs["off"]["conversations"], "reply_tokens": runs["off"]["reply_tokens"],
            "same_replies": all(run["replies"] == runs["off"]["replies"] for run in runs.values()),
            "tokens_per_s": {mode: run["tokens_per_s"] for mode, run in runs.items()},
            "over_off": {mode: run["tokens_per_s"] / runs["off"]["tokens_per_s"] for mode, run in runs.items()},
            "taken_over_guessed": {mode: run["taken_over_guessed"] for mode, run in runs.items()}}


def print_tables(result: dict) -> None:
    args, table, demo = result["args"], result["table"], result["demo"]
    print(f"{args['model']}, {args['tokens']} tokens a reply, medians of {args['repeats']}; CPU flags: "
          f"{result['cpu_flags']}; load {result['load_before'][0]:.1f} -> {result['load_after'][0]:.1f}")
    print("| scenario | same reply | off tok/s | ngram | auto | guesses taken (ngram / auto) | tokens a step (auto) |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for scenario, row in table.items():
        speed, ratio, taken = row["tokens_per_s"], row["over_off"], row["taken_over_guessed"]
        print(f"| {scenario} | {row['same_reply']} | {speed['off']:.1f} | {speed['ngram']:.1f} ({ratio['ngram']:.2f}x) "
              f"| {speed['auto']:.1f} ({ratio['auto']:.2f}x) | {taken['ngram']:.2f} / {taken['auto']:.2f} "
              f"| {row['tokens_per_step']['auto']:.2f} |")
    if demo:
        speed, ratio, taken = demo["tokens_per_s"], demo["over_off"], demo["taken_over_guessed"]
        print(f"demo model, {demo['conversations']} held-out conversations ({demo['reply_tokens']} reply tokens), "
              f"same replies: {demo['same_replies']}: off {speed['off']:.0f} tok/s, ngram {speed['ngram']:.0f} "
              f"({ratio['ngram']:.2f}x, {taken['ngram']:.2f} taken), auto {speed['auto']:.0f} ({ratio['auto']:.2f}x, "
              f"{taken['auto']:.2f} taken)")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="bench-full", help="a row of chat/models.py")
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--weights", default="full", help="the engine's --weights (full, int8)")
    parser.add_argument("--demo", type=int, default=0, help="held-out conversations of the demo model (0: none)")
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
    scenarios = args.scenarios.split(",")
    truth = None
    if {"right", "wrong"} & set(scenarios):  # the fresh reply, as drafting-off gives it: what is right
        truth = one_reply(model, tokenizer, "off", "fresh", args.tokens, passage, args.compile, args.weights)["sequence"]
    for repeat in range(args.repeats):
        modes = DRAFT_MODES[repeat % 3:] + DRAFT_MODES[:repeat % 3]  # rotating order
        for scenario in scenarios:
            for mode in modes:
                run = one_reply(quoting if scenario == "quote" else model, tokenizer, mode, scenario, args.tokens,
                                passage, args.compile, args.weights, truth)
                run.pop("sequence")
                cells.setdefault(scenario, {}).setdefault(mode, []).append(run)
    result = {"args": vars(args), "model": args.model, "parameters": parameter_count(model),
              "demo": demo_table(args.demo) if args.demo else {},
              "cpu_flags": cpu_flags(), "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
              "torch": torch.__version__, "load_before": load_before, "load_after": os.getloadavg(),
              "command": "python -m benchmarks.drafting " + " ".join(sys.argv[1:] if argv is None else argv),
              "table": scenario_table(cells)}
    print_tables(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
