"""A conversation far past the model's context: what each turn prefills, in one run.

Through the library (`send(..., fit_context=True)`, the page's path), greedy: `--turns` turns of
`--message-tokens`-token messages and `--reply-tokens`-token replies at `--context`. For each
`--shares` entry the fitting's `REFIT_SHARE` is set to it (chat/dialogue/fitting.py): 1.0 drops only what
the next turn needs, so the prompt's start moves every turn past the context (the way it worked
before the cut was kept: nearly the whole context prefilled every turn); 0.5, the default, drops
down to half the room and keeps that cut while it fits. Reports, over the turns past the
context: the mean prompt tokens prefilled per turn against the context, the mean and worst time
to first token, and whether every turn was answered.

`python -m benchmarks.past_context --help`; results go to benchmarks/results/past-context.*.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
from pathlib import Path

import torch

import chat.dialogue.fitting
from benchmarks.models import Words, build_bench_tokenizer
from chat import ChatEngine
from chat.models import build_model


def message_of(tokenizer, words: Words, tokens: int) -> str:
    text = ""
    while len(tokenizer(text).input_ids) < tokens:
        text += words.sentence(12) + " "
    return text


def run(model, tokenizer, share: float, context: int, turns: int, message_tokens: int, reply_tokens: int) -> dict:
    chat.dialogue.fitting.REFIT_SHARE = share
    engine = ChatEngine(model, tokenizer, context_limit=context)
    conv = engine.conversation("You are a helpful assistant.")
    words, past = Words(seed=5), []
    for _ in range(turns):
        for _ in conv.send(message_of(tokenizer, words, message_tokens), fit_context=True,
                           max_new_tokens=reply_tokens, do_sample=False):
            pass
        if conv.stats.dropped_turns:
            past.append({"prefilled": conv.stats.prefilled_tokens, "ttft_s": conv.stats.ttft_s,
                         "dropped_turns": conv.stats.dropped_turns})
    prefilled = [turn["prefilled"] for turn in past]
    return {"share": share, "turns": turns, "turns_past_context": len(past),
            "answered": len(conv.messages) == 1 + 2 * turns,
            "mean_prefilled": statistics.mean(prefilled), "mean_prefilled_over_context": statistics.mean(prefilled) / context,
            "mean_ttft_s": statistics.mean(turn["ttft_s"] for turn in past),
            "worst_ttft_s": max(turn["ttft_s"] for turn in past), "per_turn": past}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="bench-full", help="a row of chat/models.py")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--turns", type=int, default=40)
    parser.add_argument("--message-tokens", type=int, default=150)
    parser.add_argument("--reply-tokens", type=int, default=32)
    parser.add_argument("--shares", default="1.0,0.5", help="comma-separated REFIT_SHARE values")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    tokenizer = build_bench_tokenizer()
    model = build_model(args.model, len(tokenizer), tokenizer.eos_token_id)
    model.generation_config.eos_token_id = None  # every reply runs to its length
    kept = chat.dialogue.fitting.REFIT_SHARE
    try:
        runs = [run(model, tokenizer, float(share), args.context, args.turns, args.message_tokens, args.reply_tokens)
                for share in args.shares.split(",")]
    finally:
        chat.dialogue.fitting.REFIT_SHARE = kept
    result = {"args": vars(args), "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
              "torch": torch.__version__, "runs": runs}
    for row in runs:
        print(f"share {row['share']}: {row['turns_past_context']} turns past the context, all answered: "
              f"{row['answered']}; prefilled a turn {row['mean_prefilled']:.0f} "
              f"({row['mean_prefilled_over_context']:.2f}x the context); TTFT mean {row['mean_ttft_s'] * 1000:.0f} ms, "
              f"worst {row['worst_ttft_s'] * 1000:.0f} ms")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
