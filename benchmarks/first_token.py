"""A reply's first token in the step that feeds the end of its prompt, against a step apart.

Before, every reply's prompt was fed up to its last token, then a decode step fed that token and
chose the first one: two steps at least, even for a one-line follow-up on an idle engine. Now,
where the cache keeps nothing at the generation start (every layer full attention), the prompt's
last piece goes with that token in the first decode row (`CacheSession.feeds_with_first_step`).
This times both in one run, alternated (the "a step apart" arm patches that decision to False,
which is the code before it), through the public API, greedy, end token off:

- **follow-ups**: a conversation of `--turns` turns on an idle engine, a one-line message each:
  the time to first token of each turn (the first turn includes the system prompt);
- **newcomer beside every row**: benchmarks/fairness.py's scenario (one client streams on every
  row, another sends one message; its first token, and the same message on an idle engine);
- **stream**: benchmarks/fairness.py's (a user streams; another sends `--stream-prompt` tokens
  mid-stream): the streaming user's worst gap while the other prefills, over its median gap
  alone (that a prompt's end now rides in a decode row must not lengthen the others' steps).

`python -m benchmarks.first_token --help`.
"""

from __future__ import annotations

import argparse
import os
import statistics
from typing import ContextManager

from benchmarks.fairness import (SYSTEM_PROMPT, Sender, message_of, newcomer_beside_streams_scenario, session_id,
                                 stream_scenario, token_clock)
from benchmarks.models import Words
from benchmarks.report import alternated, arms_heading, arms_record, engine_at_size, patched
from cache_sessions.session import CacheSession
from chat import ChatEngine
from chat.model_step.weights import WEIGHT_FORMATS

ARMS = ("one step", "a step apart")


def arm(name: str) -> ContextManager[None]:
    """"a step apart": the prompt's last piece never goes with the first decode input."""
    return patched(CacheSession, "feeds_with_first_step", lambda *args, **kwargs: False, apply=name == "a step apart")


def follow_ups(engine: ChatEngine, questions: list[str], reply_tokens: int) -> list[dict]:
    """Each turn's time to first token and what it prefilled, one conversation on an idle engine."""
    turns = []
    with token_clock() as times:
        conv = engine.conversation(SYSTEM_PROMPT)
        for question in questions:
            sender = Sender(conv, question, reply_tokens)
            sender.join()
            first = times[session_id(conv)][-reply_tokens]
            turns.append({"ttft_s": first - sender.sent_at, "prefilled_tokens": conv.stats.prefilled_tokens,
                          "decode_step_s": 1 / conv.stats.decode_tokens_per_s})
        conv.close()
    return turns


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="bench-full", help="a row of chat/models.py (bench-full, real-qwen3-0.6b)")
    parser.add_argument("--weights", default="full", choices=WEIGHT_FORMATS)
    parser.add_argument("--turns", type=int, default=6, help="follow-up turns a repeat")
    parser.add_argument("--reply-tokens", type=int, default=8)
    parser.add_argument("--stream-tokens", type=int, default=160, help="the streams' replies in the newcomer scenario")
    parser.add_argument("--stream-prompt", type=int, default=3000, help="tokens sent mid-stream (0: no stream scenario)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    engine, tokenizer = engine_at_size(args.model, args.weights, shared_prefixes=0)
    list(engine.conversation(SYSTEM_PROMPT).send("Warm up.", max_new_tokens=4))  # untimed: lazy set-up
    words = Words(seed=5)
    questions = [words.sentence(12) for _ in range(args.turns)]
    long_text = message_of(tokenizer, words, args.stream_prompt) if args.stream_prompt else ""
    load_before = os.getloadavg()
    runs: dict[str, dict[str, list]] = {name: {"follow_ups": [], "newcomer": [], "stream": []} for name in ARMS}
    for name in alternated(ARMS, args.repeats):
        with arm(name):
            runs[name]["follow_ups"].append(follow_ups(engine, questions, args.reply_tokens))
            runs[name]["newcomer"].append(newcomer_beside_streams_scenario(
                engine, engine.scheduler.max_batch_size, args.stream_tokens))
            if long_text:
                runs[name]["stream"].append(stream_scenario(engine, long_text, args.stream_tokens))
    summary = {}
    for name in ARMS:
        turns = runs[name]["follow_ups"]
        summary[name] = {
            "first_turn_ttft_s": statistics.median(run[0]["ttft_s"] for run in turns),
            "later_turns_ttft_s": statistics.median(turn["ttft_s"] for run in turns for turn in run[1:]),
            "later_turns_prefilled_tokens": statistics.median(turn["prefilled_tokens"] for run in turns for turn in run[1:]),
            "decode_step_s": statistics.median(turn["decode_step_s"] for run in turns for turn in run),
            "newcomer_idle_ttft_s": statistics.median(run["idle_ttft_s"] for run in runs[name]["newcomer"]),
            "newcomer_ttft_s": statistics.median(run["ttft_s"] for run in runs[name]["newcomer"]),
            "newcomer_over_idle": statistics.median(run["over_idle"] for run in runs[name]["newcomer"]),
            "stream_worst_over_median_alone": statistics.median(
                run["worst_over_median_alone"] for run in runs[name]["stream"]) if long_text else None,
        }
    return arms_record("first_token", args, argv, summary, runs, load_before, markdown)


def markdown(result: dict) -> str:
    one, apart = result["summary"]["one step"], result["summary"]["a step apart"]
    rows = [("first turn: TTFT", "first_turn_ttft_s"), ("later turns: TTFT", "later_turns_ttft_s"),
            ("newcomer on an idle engine: TTFT", "newcomer_idle_ttft_s"),
            ("newcomer beside every row: TTFT", "newcomer_ttft_s")]
    lines = [arms_heading(result), "",
             "| | a step apart (before) | one step (now) | now / before |", "|---|---:|---:|---:|"]
    for label, key in rows:
        lines.append(f"| {label} | {apart[key] * 1000:.1f} ms | {one[key] * 1000:.1f} ms | {one[key] / apart[key]:.2f}x |")
    lines.append(f"| newcomer beside every row / idle | {apart['newcomer_over_idle']:.2f}x | "
                 f"{one['newcomer_over_idle']:.2f}x | |")
    if one["stream_worst_over_median_alone"] is not None:
        lines.append(f"| streaming: worst gap while another prefills / median alone | "
                     f"{apart['stream_worst_over_median_alone']:.2f}x | {one['stream_worst_over_median_alone']:.2f}x | |")
    lines.append(f"| a decode step (for scale) | {apart['decode_step_s'] * 1000:.1f} ms | "
                 f"{one['decode_step_s'] * 1000:.1f} ms | |")
    lines.append(f"| later turns: tokens prefilled | {apart['later_turns_prefilled_tokens']:.0f} | "
                 f"{one['later_turns_prefilled_tokens']:.0f} | |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
