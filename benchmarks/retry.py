"""A Retry's first token from the logits kept after its prompt, against feeding the prompt's
last token again.

A reply's first logits, after its prompt's last token, stay with its cache
(`CacheSession.keep_next_logits`); a Retry of it keeps the whole prompt and chooses its first
token from them with no model step, as does the Send of a message prepared whole while it was
typed. This times both ways in one run, alternated, through the public API, greedy, end token
off, guessing off (the "fed again" arm makes `CacheSession.next_logits` find nothing, which is the code before):

- **Retry**: a conversation of `--turns` turns (a `--message`-token message each); the last reply
  retried `--retries` times: its time to first token, against a decode step of the same reply;
- **prepared Send**: a `--message`-token message prepared (waited for), then sent.

`python -m benchmarks.retry --help`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import ContextManager

from benchmarks.fairness import SYSTEM_PROMPT, gaps, message_of, session_id, token_clock, wait_for
from benchmarks.models import Words
from benchmarks.report import alternated, arms_heading, arms_record, engine_at_size, patched
from cache_sessions.session import CacheSession
from chat import ChatEngine
from chat.model_step.weights import WEIGHT_FORMATS

ARMS = ("kept", "fed again")


def arm(name: str) -> ContextManager[None]:
    """"fed again": no logits are found kept, so the prompt's last token is fed again."""
    return patched(CacheSession, "next_logits", lambda *args, **kwargs: None, apply=name == "fed again")


def first_token_s(engine: ChatEngine, conv, stream_of, reply_tokens: int) -> tuple[float, float]:
    """Time to first token of the reply `stream_of(conv)` starts, and its median decode step."""
    with token_clock() as times:
        started = time.perf_counter()
        for _ in stream_of(conv):
            pass
        tokens = times[session_id(conv)][-reply_tokens:]
    return tokens[0] - started, statistics.median(gaps(tokens))


def one_run(engine: ChatEngine, messages: list[str], prepared_text: str, options: dict, retries: int) -> dict:
    conv = engine.conversation(SYSTEM_PROMPT)
    for message in messages:
        list(conv.send(message, **options))
    retry = [first_token_s(engine, conv, lambda c: c.regenerate(**options), options["max_new_tokens"])
             for _ in range(retries)]
    retry_prefilled = conv.stats.prefilled_tokens
    conv.prepare(prepared_text, **options)
    wait_for(lambda: engine.batch_stats().preparing == 0)
    prepared, _ = first_token_s(engine, conv, lambda c: c.send(prepared_text, **options), options["max_new_tokens"])
    conv.close()
    return {"retry_ttft_s": statistics.median(ttft for ttft, _ in retry),
            "decode_step_s": statistics.median(step for _, step in retry), "prepared_ttft_s": prepared,
            "retry_prefilled_tokens": retry_prefilled}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="bench-full", help="a row of chat/models.py (bench-full, real-qwen3-0.6b)")
    parser.add_argument("--weights", default="full", choices=WEIGHT_FORMATS)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--message", type=int, default=150, help="tokens of each message")
    parser.add_argument("--reply-tokens", type=int, default=8)
    parser.add_argument("--retries", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    # no guesses: a Retry's later tokens would come several a step, and its decode step is the scale
    engine, tokenizer = engine_at_size(args.model, args.weights, shared_prefixes=0, draft="off")
    options = dict(max_new_tokens=args.reply_tokens, do_sample=False)
    list(engine.conversation(SYSTEM_PROMPT).send("Warm up.", **options))  # untimed: lazy set-up
    words = Words(seed=7)
    messages = [message_of(tokenizer, words, args.message) for _ in range(args.turns)]
    prepared_text = message_of(tokenizer, words, args.message)
    load_before = os.getloadavg()
    runs: dict[str, list[dict]] = {name: [] for name in ARMS}
    for name in alternated(ARMS, args.repeats):
        with arm(name):
            runs[name].append(one_run(engine, messages, prepared_text, options, args.retries))
    return arms_record("retry", args, argv, None, runs, load_before, markdown)


def markdown(result: dict) -> str:
    kept, fed = result["summary"]["kept"], result["summary"]["fed again"]
    lines = [arms_heading(result), "",
             "| | fed again (before) | kept (now) | now / before |", "|---|---:|---:|---:|"]
    for label, key in (("Retry: TTFT", "retry_ttft_s"), ("prepared Send: TTFT", "prepared_ttft_s"),
                       ("a decode step (for scale)", "decode_step_s")):
        lines.append(f"| {label} | {fed[key] * 1000:.1f} ms | {kept[key] * 1000:.1f} ms | {kept[key] / fed[key]:.2f}x |")
    lines.append(f"| Retry: prompt tokens computed | {fed['retry_prefilled_tokens']:.0f} | "
                 f"{kept['retry_prefilled_tokens']:.0f} | |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
