"""Decode through the public API against a bare eager loop of the same model.

One conversation on an idle engine (`ChatEngine`, its compiled decode graphs built or loaded
first), grown turn by turn to each `--lengths` history; at each, alternated `--repeats` times:

  api    `Conversation.regenerate`: the scheduler, the runner's step (compiled where a graph takes
         it), sampling, streaming; tokens/s from the conversation's own stats. Drafting is off
         (`--draft`): a greedy Retry would otherwise have its earlier reply verified as guesses,
         several tokens a step, which is not what a bare loop is compared for
  bare   transformers' `generate` (the model's own eager forward, greedy) on a copy of the same
         session's cache, prepared to the same prompt, on the engine's compute thread

Both decode `--new-tokens` greedy tokens after the same prompt; the ratio says what the engine
adds or takes away around the model step. The issue measured 1.07x (14.4 against 13.4 tokens/s)
at Qwen3-0.6B's shape with int8 weights, where the compiled step alone was 1.47x eager.

    GOMP_SPINCOUNT=300000 python -m benchmarks.api_decode --model real-qwen3-0.6b --weights int8
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from typing import Any

import torch

from benchmarks.models import Words, build_bench_tokenizer
from benchmarks.report import bare_generate_rate, cpu_flags, publish, target_table
from chat import ChatEngine
from chat.scheduling.drafting import DRAFT_MODES
from chat.models import build_model
from chat.model_step.weights import WEIGHT_FORMATS, apply_weight_format
from chat.scheduling.worker import ModelWorker

SYSTEM_PROMPT = "You are a helpful assistant."
TARGET = 1.35  # int8 decode at one user through the public API over a bare eager loop


def grow(conv: Any, words: Words, history: int, message_words: int) -> None:
    """Send messages (32-token replies) until the conversation's prompt holds `history` tokens."""
    while conv.stats is None or conv.stats.prompt_tokens < history:
        for _ in conv.send(words.sentence(message_words), max_new_tokens=32, do_sample=False):
            pass


def run(args: argparse.Namespace) -> dict:
    worker = ModelWorker()
    tokenizer = build_bench_tokenizer()
    model = worker.run(build_model, args.model, len(tokenizer), tokenizer.eos_token_id)
    worker.run(apply_weight_format, model, args.weights)
    model.generation_config.eos_token_id = None  # every reply runs to its length, both ways
    engine = ChatEngine(model, tokenizer, worker=worker, shared_prefixes=0, weights=args.weights, draft=args.draft)
    if engine.compiled is not None:
        engine.compiled.wait(1800)  # measured at the speed it serves once its graphs are built
    conv, words = engine.conversation(SYSTEM_PROMPT), Words(seed=1)
    load_before = os.getloadavg()
    lengths = []
    for history in args.lengths:
        grow(conv, words, history, args.message_words)
        prompt = engine.template.render(conv.messages[:-1]).ids
        api, bare = [], []
        for repeat in range(args.repeats):
            for way in ("bare", "api") if repeat % 2 == 0 else ("api", "bare"):
                if way == "bare":
                    bare.append(engine.worker.run(bare_generate_rate, model, conv.session, prompt, args.new_tokens))
                else:
                    for _ in conv.regenerate(max_new_tokens=args.new_tokens, do_sample=False):
                        pass
                    assert conv.stats.generated_tokens == args.new_tokens, conv.stats
                    api.append(conv.stats.decode_tokens_per_s)
        lengths.append({"prompt_tokens": len(prompt), "api_tokens_per_s": api, "bare_tokens_per_s": bare,
                        "api_over_bare": statistics.median(api) / statistics.median(bare)})
        print(f"{len(prompt)} tokens: api {statistics.median(api):.1f}, bare {statistics.median(bare):.1f} tokens/s",
              file=sys.stderr)
    return {"args": vars(args), "cpu_flags": cpu_flags(), "torch": torch.__version__,
            "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
            "load_before": load_before, "load_after": os.getloadavg(),
            "compiled_step": engine.status().get("compiled_step"), "lengths": lengths,
            "command": "python -m benchmarks.api_decode " + " ".join(sys.argv[1:])}


def markdown(result: dict) -> str:
    args = result["args"]
    lines = [f"{args['model']}, weights {args['weights']}; {result['machine']}; lscpu flags {result['cpu_flags']}; "
             f"load {result['load_before'][0]:.2f} → {result['load_after'][0]:.2f}; medians of {args['repeats']}, "
             f"{args['new_tokens']} greedy tokens, drafting {args['draft']}",
             "", "| history | public API tokens/s | bare `generate` tokens/s | API / bare |", "|---:|---:|---:|---:|"]
    for row in result["lengths"]:
        lines.append(f"| {row['prompt_tokens']:,} | {statistics.median(row['api_tokens_per_s']):.1f} | "
                     f"{statistics.median(row['bare_tokens_per_s']):.1f} | {row['api_over_bare']:.2f}x |")
    return "\n".join(lines + [""] + target_table(result["targets"]))


def targets(result: dict) -> list[tuple[str, str, bool]]:
    worst = min(row["api_over_bare"] for row in result["lengths"])
    return [(f"decode through the public API at least {TARGET}x a bare eager loop (the lowest of the lengths)",
             f"{worst:.2f}x", worst >= TARGET)]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="bench-full", help="a row of chat/models.py (bench-full, real-qwen3-0.6b)")
    parser.add_argument("--weights", default="int8", choices=WEIGHT_FORMATS)
    parser.add_argument("--draft", default="off", choices=DRAFT_MODES, help="the engine's drafting (chat/scheduling/drafting.py)")
    parser.add_argument("--lengths", type=lambda text: [int(n) for n in text.split(",")], default=[800, 2200],
                        help="tokens of history, comma-separated")
    parser.add_argument("--message-words", type=int, default=150)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    return publish(run(args), started, targets=targets, markdown=markdown, plot=lambda *_: None,
                   json_path=args.json_path, plot_path=None)


if __name__ == "__main__":
    main()
