"""Prefill while typing, in one run, through the library.

- **prepared**: a conversation with one earlier turn; a `--message`-token message sent as is,
  against the same message prepared first (`Conversation.prepare`, waited for), then sent. Time to
  first token of each, as the scheduler emits it, medians of `--repeats`.
- **typed**: a `--typed-chars` message typed at `--chars-per-s` characters a second, prepared
  when the page asks (`page_asks`: the page's own rule, at most every `PREPARE_EVERY_MS`), then
  sent `--send-after-ms` after the last character (each value a case: at typing pace the Enter is
  the next keystroke, 200 ms at 5 a second; sooner, it may land in the last draft's step): its
  time to first token against the decode step's, medians of `--repeats` (each run's ratio kept).
  `--page-rules now,before` adds the page's rule before (`page_asks_before`) as cases of their own.
- **typists**: one user streams `--reply-tokens` tokens alone, then again while four others type
  (each prepares a growing message every 200 ms): the streamer's median and worst gap between
  tokens in both.

`python -m benchmarks.prepare --help`.
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
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
from chat.model_step.weights import WEIGHT_FORMATS
from ui.page_assets import PREPARE_EVERY_MS

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
        wait_for(lambda: engine.batch_stats().preparing == 0)
        prepared = first_token_s(engine, conv, text, times)
        decode_step = statistics.median(gaps(times[session_id(conv)][-4:]))
    return {"unprepared_ttft_s": unprepared, "prepared_ttft_s": prepared, "decode_step_s": decode_step,
            "prepared_over_unprepared": prepared / unprepared, "prepared_prefilled": conv.stats.prefilled_tokens,
            "message_tokens": conv.stats.prompt_tokens - plain.stats.reused_tokens}


def page_asks(keystrokes: list[float], every_s: float = PREPARE_EVERY_MS / 1000,
              least_s: float = 0.02) -> list[tuple[float, int]]:
    """When the page (ui/page_assets.py) asks the server to prepare, for keystrokes at these
    times (seconds), and how many characters were typed by then: a keystroke with no ask pending
    sets one for `every_s` after the last ask (and at least `least_s` away); it takes the text
    as it stands when it fires."""
    asks: list[tuple[float, int]] = []
    pending, last = None, -math.inf
    for at in keystrokes:
        if pending is not None and pending <= at:
            asks.append((pending, bisect.bisect_right(keystrokes, pending)))  # (keystrokes in order)
            pending, last = None, pending
        if pending is None:
            pending = max(at + least_s, last + every_s)
    if pending is not None:
        asks.append((pending, len(keystrokes)))
    return asks


def page_asks_before(keystrokes: list[float]) -> list[tuple[float, int]]:
    """The page's rule before (kept as the benchmark's "before"): an ask 400 ms after the last
    keystroke, or at a keystroke once a second had passed since the last ask, if there was one."""
    asks: list[tuple[float, int]] = []
    pending, last = None, None
    for index, at in enumerate(keystrokes):
        if pending is not None and pending <= at:
            asks.append((pending, index))
            last = pending
        pending = None
        if last is not None and at - last > 1.0:
            asks.append((at, index + 1))
            last = at
        else:
            pending = at + 0.4
    if pending is not None:
        asks.append((pending, len(keystrokes)))
    return asks


PAGE_RULES = {"now": page_asks, "before": page_asks_before}


def typed_run(engine: ChatEngine, text: str, chars_per_s: float, send_after_s: float, rule: str = "now") -> dict:
    keystrokes = [index / chars_per_s for index in range(len(text))]
    with token_clock() as times:
        conv = fresh(engine)
        start = time.perf_counter()
        for at, typed in PAGE_RULES[rule](keystrokes):
            if at > keystrokes[-1] + send_after_s:
                break  # the Send came first
            time.sleep(max(0.0, start + at - time.perf_counter()))
            conv.prepare(text[:typed], **GREEDY)
        time.sleep(max(0.0, start + keystrokes[-1] + send_after_s - time.perf_counter()))
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
    parser.add_argument("--send-after-ms", default="200,100,50",
                        help="each a case: how long after the last character the Send comes")
    parser.add_argument("--page-rules", default="now",
                        help="whose asks: now (the page's rule), before (its earlier rule)")
    parser.add_argument("--typed-chars", type=int, default=100, help="characters of the typed message")
    parser.add_argument("--reply-tokens", type=int, default=120)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    engine, tokenizer = engine_at_size(args.model, args.weights)
    load_before = os.getloadavg()
    words = Words(seed=11)
    text = message_of(tokenizer, words, args.message)
    typed_text = message_of(tokenizer, words, 10)[: args.typed_chars]
    runs = [prepared_run(engine, text) for _ in range(args.repeats)]
    cases = [(rule, int(after)) for rule in args.page_rules.split(",") for after in args.send_after_ms.split(",")]
    typed = {f"send_after_{after}_ms" + ("" if rule == "now" else f"_{rule}"):
             median_of([typed_run(engine, typed_text, args.chars_per_s, after / 1000, rule) for _ in range(args.repeats)])
             for rule, after in cases}
    typists = typists_run(engine, words, args.reply_tokens)
    result = {"args": vars(args), "cpu_flags": cpu_flags(), "load_before": load_before, "load_after": os.getloadavg(),
              "machine": f"{platform.machine()}, {torch.get_num_threads()} threads", "torch": torch.__version__,
              "prepared": {key: statistics.median(run[key] for run in runs) for key in runs[0]},
              "typed": typed, "typists": typists}
    print(json.dumps({key: result[key] for key in ("prepared", "typed", "typists")}, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
