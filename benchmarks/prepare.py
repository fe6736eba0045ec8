"""Prefill while typing (issue #45, item 1), in one run, through the library.

- **prepared**: a conversation with one earlier turn; a `--message`-token message sent as is,
  against the same message prepared first (`Conversation.prepare`, waited for), then sent. Time to
  first token of each, as the scheduler emits it, medians of `--repeats`.
- **typed**: a `--typed-chars` message typed at `--chars-per-s` characters a second, prepared
  every `--pause-chars` characters (the page prepares once a second while typing goes on), then
  sent at once after the last character: its time to first token against the decode step's,
  medians of `--repeats` (each run's ratio kept beside them).
- **typists**: one user streams `--reply-tokens` tokens alone, then again while four others type
  (each prepares a growing message every 200 ms): the streamer's median and worst gap between
  tokens in both.

`python -m benchmarks.prepare --help`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import threading
import time
from pathlib import Path

import torch

from benchmarks.fairness import Sender, gaps, message_of, session_id, token_clock, wait_for
from benchmarks.models import Words
from benchmarks.report import cpu_flags, engine_at_size
from chat import ChatEngine
from chat.weights import WEIGHT_FORMATS

SYSTEM = "You are a helpful assistant."
GREEDY = dict(max_new_tokens=4, do_sample=False)


def first_token_s(engine: ChatEngine, conv, text: str, times: dict) -> float:
    sender = Sender(conv, text, 4)
    sender.join()
    return times[session_id(conv)][-4] - sender.sent_at if len(times[session_id(conv)]) >= 4 else float("nan")


def fresh(engine: ChatEngine):
    conv = engine.conversation(SYSTEM)
    for _ in conv.send("An earlier question?", **GREEDY):
        pass
    return conv


def prepared_run(engine: ChatEngine, text: str) -> dict:
    with token_clock() as times:
        plain = fresh(engine)
        unprepared = first_token_s(engine, plain, text, times)
        conv = fresh(engine)
        conv.prepare(text, **GREEDY)
        wait_for(lambda: engine.batch_stats().drafts == 0)
        prepared = first_token_s(engine, conv, text, times)
        decode_step = statistics.median(gaps(times[session_id(conv)][-4:]))
    return {"unprepared_ttft_s": unprepared, "prepared_ttft_s": prepared, "decode_step_s": decode_step,
            "prepared_over_unprepared": prepared / unprepared, "prepared_prefilled": conv.stats.prefilled_tokens,
            "message_tokens": conv.stats.prompt_tokens - plain.stats.reused_tokens}


def typed_run(engine: ChatEngine, text: str, chars_per_s: float, pause_chars: int) -> dict:
    with token_clock() as times:
        conv = fresh(engine)
        for end in range(pause_chars, len(text) + pause_chars, pause_chars):
            time.sleep(pause_chars / chars_per_s)
            conv.prepare(text[:end], **GREEDY)
        ttft = first_token_s(engine, conv, text, times)
        decode_step = statistics.median(gaps(times[session_id(conv)][-4:]))
    return {"typed_ttft_s": ttft, "decode_step_s": decode_step, "typed_over_decode_step": ttft / decode_step,
            "typed_prefilled": conv.stats.prefilled_tokens}


def median_of(runs: list[dict]) -> dict:
    """Each field's median over the runs, and every run's ratio beside it (the typed case's
    first token depends on where in a draft's step the Send lands)."""
    result = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
    result["runs_over_decode_step"] = [run["typed_over_decode_step"] for run in runs]
    return result


def typists_run(engine: ChatEngine, words: Words, reply_tokens: int) -> dict:
    with token_clock() as times:
        alone = engine.conversation(SYSTEM)
        Sender(alone, "Tell me a long story.", reply_tokens).join()
        streamer = engine.conversation(SYSTEM)
        typists = [fresh(engine) for _ in range(4)]
        texts = [message_of(engine.tokenizer, words, 300) for _ in typists]
        done = threading.Event()

        def type_on(conv, text: str) -> None:
            end = 20
            while not done.is_set():
                conv.prepare(text[:end], **GREEDY)
                end = min(len(text), end + 20)
                time.sleep(0.2)

        threads = [threading.Thread(target=type_on, args=pair, daemon=True) for pair in zip(typists, texts)]
        streaming = Sender(streamer, "Tell me a long story.", reply_tokens)
        for thread in threads:
            thread.start()
        streaming.join()
        done.set()
        for thread in threads:
            thread.join()
    alone_gaps, busy_gaps = gaps(times[session_id(alone)]), gaps(times[session_id(streamer)])
    return {"median_gap_alone_s": statistics.median(alone_gaps), "worst_gap_alone_s": max(alone_gaps),
            "median_gap_typists_s": statistics.median(busy_gaps), "worst_gap_typists_s": max(busy_gaps),
            "worst_over_worst_alone": max(busy_gaps) / max(alone_gaps)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="bench-full", help="a row of chat/models.py (bench-full, real-qwen3-0.6b)")
    parser.add_argument("--weights", default="full", choices=WEIGHT_FORMATS)
    parser.add_argument("--message", type=int, default=1000, help="tokens of the message")
    parser.add_argument("--chars-per-s", type=float, default=5.0)
    parser.add_argument("--pause-chars", type=int, default=5,
                        help="characters typed between two prepares (the page prepares once a second while typing)")
    parser.add_argument("--typed-chars", type=int, default=200, help="characters of the typed message")
    parser.add_argument("--reply-tokens", type=int, default=120)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    engine, tokenizer = engine_at_size(args.model, args.weights)
    load_before = os.getloadavg()
    words = Words(seed=11)
    text = message_of(tokenizer, words, args.message)
    typed = message_of(tokenizer, words, 10)[: args.typed_chars]
    runs = [prepared_run(engine, text) for _ in range(args.repeats)]
    typed_runs = [typed_run(engine, typed, args.chars_per_s, args.pause_chars) for _ in range(args.repeats)]
    typists = typists_run(engine, words, args.reply_tokens)
    result = {"args": vars(args), "cpu_flags": cpu_flags(), "load_before": load_before, "load_after": os.getloadavg(),
              "machine": f"{platform.machine()}, {torch.get_num_threads()} threads", "torch": torch.__version__,
              "prepared": {key: statistics.median(run[key] for run in runs) for key in runs[0]},
              "typed": median_of(typed_runs), "typists": typists}
    print(json.dumps({key: result[key] for key in ("prepared", "typed", "typists")}, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
