"""Fairness between users of one engine: what one user's long prompt costs the others, in one run.

Two scenarios, as a shared Space's users would meet them, through the library's public API
(`Conversation.send`, each conversation consumed in its own thread), greedy, end token off:

- **stream**: a user streams a long reply; after its 20th token another user sends a ~3,000
  token message. The streaming user's gaps between tokens: the worst while the other prefills,
  against its median gap, in the same reply and alone.
- **short after long**: a ~4,000-token message, then 50 ms later a one-line message from
  another user. The short one's time to first token against the long one's; the long one's
  against its own alone.
- **long beside one-liners**: the ~4,000-token message from one client while another sends
  one-line messages back to back from two conversations: the long one's TTFT against alone.
- **newcomer beside every row**: one client streams a long reply on every row of the batch,
  another then sends one message: its TTFT against the same message on an idle engine.

Tokens are timed as the scheduler emits them (not as text: a random model's bytes may decode to
text only at the end). Each `--configs` entry (`prefill_chunk/prefill_chunk_alone` in packed
steps, the first a cap under the measured step budget; `fixed:` the same without measuring;
or `before`: one chunk size while others decode, a whole prefill alone, oldest first, as the
scheduler did before its prompt budget was timed, in packed steps: the gathered batch it ran on then has left the engine) runs both scenarios `--repeats` times on the same model (medians); ratios
are within one run. The streaming user's worst gap alone is the machine's own noise floor.
`python -m benchmarks.fairness --help`.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import threading
import time
from contextlib import contextmanager
from typing import Iterator

import torch

from benchmarks.models import Words, build_bench_tokenizer
from benchmarks.report import publish, target_table
from chat import ChatEngine, Conversation
from chat.models import build_model
from chat.scheduling.scheduler import GenerationRequest
from chat.scheduling.step_budget import DEFAULT_ALONE_STEP_S, DEFAULT_GAP_FACTOR
from chat.model_step.weights import WEIGHT_FORMATS, apply_weight_format
from chat.scheduling.worker import ModelWorker

SYSTEM_PROMPT = "You are a helpful assistant. Answer briefly and stay on topic."


@contextmanager
def token_clock() -> Iterator[dict[int, list[float]]]:
    """The time of every token each request emits, keyed by the request's session id."""
    times: dict[int, list[float]] = {}
    emit = GenerationRequest._emit

    def timed(request: GenerationRequest, token_id: int) -> None:
        times.setdefault(id(request.session), []).append(time.perf_counter())
        emit(request, token_id)

    GenerationRequest._emit = timed  # type: ignore[method-assign]
    try:
        yield times
    finally:
        GenerationRequest._emit = emit  # type: ignore[method-assign]


class Sender(threading.Thread):
    """Sends one message on its own thread and drains the stream, as a browser would."""

    def __init__(self, conv: Conversation, text: str, max_new_tokens: int):
        super().__init__(daemon=True)
        self.conv, self.text, self.max_new_tokens = conv, text, max_new_tokens
        self.sent_at = 0.0
        self.start()

    def run(self) -> None:
        self.sent_at = time.perf_counter()
        for _ in self.conv.send(self.text, max_new_tokens=self.max_new_tokens, do_sample=False):
            pass


def message_of(tokenizer, words: Words, tokens: int) -> str:
    """Made-up sentences of about `tokens` tokens."""
    text = ""
    while len(tokenizer(text).input_ids) < tokens:
        text += words.sentence(40) + " "
    return text


def session_id(conv: Conversation) -> int:
    return id(conv.source.session)


def wait_for(condition, timeout: float = 600.0) -> None:
    deadline = time.perf_counter() + timeout
    while not condition():
        if time.perf_counter() > deadline:
            raise TimeoutError("the benchmark's condition never came")
        time.sleep(0.001)


def stream_scenario(engine: ChatEngine, long_text: str, reply_tokens: int) -> dict:
    """A user streams `reply_tokens`; after its 20th token another sends `long_text`."""
    with token_clock() as times:
        alone_conv = engine.conversation(SYSTEM_PROMPT)
        Sender(alone_conv, "Tell me a long story.", reply_tokens).join()
        alone_gaps = gaps(times[session_id(alone_conv)])
        streamer, prefiller = engine.conversation(SYSTEM_PROMPT), engine.conversation(SYSTEM_PROMPT)
        streaming = Sender(streamer, "Tell me a long story.", reply_tokens)
        wait_for(lambda: len(times.get(session_id(streamer), [])) >= 20)
        long_one = Sender(prefiller, long_text, 4)
        streaming.join(), long_one.join()
    stream_times, long_times = times[session_id(streamer)], times[session_id(prefiller)]
    window = sorted(b - a for a, b in zip(stream_times, stream_times[1:]) if b > long_one.sent_at and a < long_times[0])
    median, median_alone = statistics.median(gaps(stream_times)), statistics.median(alone_gaps)
    worst = window[-1] if window else 0.0
    for conv in (alone_conv, streamer, prefiller):
        conv.close()
    return {"prompt_tokens": prefiller.stats.prompt_tokens, "median_gap_s": median, "median_gap_alone_s": median_alone,
            "worst_gap_alone_s": max(alone_gaps), "worst_gap_while_prefilling_s": worst,
            "p90_gap_while_prefilling_s": window[int(0.9 * (len(window) - 1))] if window else 0.0,
            "gaps_while_prefilling": len(window), "long_ttft_s": long_times[0] - long_one.sent_at,
            "worst_over_median": worst / median, "worst_over_median_alone": worst / median_alone}


def short_after_long_scenario(engine: ChatEngine, long_text: str, delay_s: float) -> dict:
    """`long_text`, then `delay_s` later a one-line message from another conversation."""
    with token_clock() as times:
        alone = engine.conversation(SYSTEM_PROMPT)
        long_alone = Sender(alone, long_text, 4)
        long_alone.join()
        long_alone_ttft = times[session_id(alone)][0] - long_alone.sent_at
        long_conv, short_conv = engine.conversation(SYSTEM_PROMPT), engine.conversation(SYSTEM_PROMPT)
        long_one = Sender(long_conv, long_text, 4)
        time.sleep(delay_s)
        short_one = Sender(short_conv, "What time is it?", 16)
        long_one.join(), short_one.join()
    long_ttft = times[session_id(long_conv)][0] - long_one.sent_at
    short_ttft = times[session_id(short_conv)][0] - short_one.sent_at
    for conv in (alone, long_conv, short_conv):
        conv.close()
    return {"prompt_tokens": long_conv.stats.prompt_tokens, "long_ttft_alone_s": long_alone_ttft,
            "long_ttft_s": long_ttft, "short_ttft_s": short_ttft, "short_over_long": short_ttft / long_ttft,
            "long_over_alone": long_ttft / long_alone_ttft}


def long_beside_one_liners_scenario(engine: ChatEngine, long_text: str) -> dict:
    """`long_text` from one client while another client sends one-line messages back to
    back from two conversations (one always waiting to be prefilled) until the long one's first
    token. The long one's time to first token against its own alone."""
    with token_clock() as times:
        alone = engine.conversation(SYSTEM_PROMPT, client="192.0.2.1")
        long_alone = Sender(alone, long_text, 4)
        long_alone.join()
        alone_ttft = times[session_id(alone)][0] - long_alone.sent_at
        long_conv = engine.conversation(SYSTEM_PROMPT, client="192.0.2.1")
        chatty = [engine.conversation(None, client="198.51.100.2") for _ in range(2)]
        long_one = Sender(long_conv, long_text, 4)
        sent = [0]

        def keep_sending(conv: Conversation) -> None:
            while not times.get(session_id(long_conv)):
                for _ in conv.send(f"What time is it now, {sent[0]}?", max_new_tokens=1, do_sample=False):
                    pass
                sent[0] += 1

        senders = [threading.Thread(target=keep_sending, args=(conv,), daemon=True) for conv in chatty]
        for sender in senders:
            sender.start()
        long_one.join()
        for sender in senders:
            sender.join()
    ttft = times[session_id(long_conv)][0] - long_one.sent_at
    for conv in (alone, long_conv, *chatty):
        conv.close()
    return {"long_ttft_alone_s": alone_ttft, "long_ttft_s": ttft, "long_over_alone": ttft / alone_ttft,
            "one_liners_meanwhile": sent[0]}


def newcomer_beside_streams_scenario(engine: ChatEngine, streams: int, reply_tokens: int) -> dict:
    """One client streams `streams` long replies (every row of the batch); another client
    then sends one message. Its time to first token against the same message on an idle engine."""
    with token_clock() as times:
        idle = engine.conversation(SYSTEM_PROMPT, client="203.0.113.9")
        alone = Sender(idle, "What time is it?", 4)
        alone.join()
        idle_ttft = times[session_id(idle)][0] - alone.sent_at
        hog = [engine.conversation(SYSTEM_PROMPT, client="192.0.2.1") for _ in range(streams)]
        senders = [Sender(conv, f"Tell me long story number {i}.", reply_tokens) for i, conv in enumerate(hog)]
        wait_for(lambda: all(times.get(session_id(conv)) for conv in hog))
        newcomer = engine.conversation(SYSTEM_PROMPT, client="203.0.113.9")
        late = Sender(newcomer, "What time is it?", 4)
        late.join()
        first = times[session_id(newcomer)][0]
        ttft = first - late.sent_at
        running = sum(sender.is_alive() for sender in senders)
        for sender in senders:
            sender.join()
    # what the busy client's streams paid: each one's longest gap ending between the newcomer's
    # Send and a step and a half after its first token (the step that carried its prompt's end,
    # whose tokens come just before the newcomer's, or the step after one it ran apart in), the
    # median of those (one stream is paused for the newcomer's row: its gap the newcomer's whole
    # reply), against their median gap. (The gap across the newcomer's first token alone missed
    # the step that carried it: the streams' tokens of that step come first.)
    streams = [times[session_id(conv)] for conv in hog]
    median_gap = statistics.median(gap for stream in streams for gap in gaps(stream))
    near = [max((b - a for a, b in zip(stream, stream[1:]) if late.sent_at < b <= first + 1.5 * median_gap),
                default=0.0) for stream in streams]
    for conv in (idle, newcomer, *hog):
        conv.close()
    return {"idle_ttft_s": idle_ttft, "ttft_s": ttft, "over_idle": ttft / idle_ttft,
            "streams_still_running": running,
            "streams_worst_gap_near_over_median": statistics.median(near) / median_gap}


def medians(runs: list[dict]) -> dict:
    """Each figure's median over repeated runs (one noisy step on a shared machine moves a worst
    gap several fold: the median of the worst says what a user meets most often)."""
    return {key: statistics.median(run[key] for run in runs) for key in runs[0]}


def gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times, times[1:])]


def engine_for(config: str, model, tokenizer, worker: ModelWorker,
               alone_step_s: float = DEFAULT_ALONE_STEP_S) -> ChatEngine:
    """`before`: the scheduler's earlier choices (256 tokens a step while others decode, a whole
    prefill alone, oldest first); `fixed:A/B`:
    `A` prompt tokens a step while others decode; `A/B`: packed, at most `A` while others decode
    and `B` alone, fewer when timed steps say so (chat/scheduling/step_budget.py); `alone-fixed:A/B`: the
    same with `B` tokens alone always (as before the alone steps were timed)."""
    kind, _, sizes = config.rpartition(":")
    chunk, alone, order = (256, 10**9, "arrival") if sizes == "before" else (*map(int, sizes.split("/")), "shortest")
    timed = not kind or kind == "alone-fixed"
    return ChatEngine(model, tokenizer, worker=worker, shared_prefixes=0, prefill_chunk=chunk,
                      prefill_chunk_alone=alone, prefill_order=order,
                      step_gap_factor=DEFAULT_GAP_FACTOR if timed and sizes != "before" else None,
                      alone_step_s=alone_step_s if not kind else None)


def markdown(result: dict) -> str:
    lines = [f"Model: {result['args']['model']}, {result['machine']}; torch {result['torch']}.", "",
             f"Medians of {result['args']['repeats']} repeats of each scenario.", "",
             "| config | streaming: gap alone (median / worst) | gap while another prefills (p90 / worst) "
             "| worst / median alone | short after long: short TTFT | long TTFT | short / long | long / alone "
             "| long beside one-liners / alone | newcomer beside every row / idle |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for run in result["runs"]:
        s, b = run["stream"], run["short_after_long"]
        lines.append(f"| `{run['config']}` | {s['median_gap_alone_s'] * 1000:.0f} / {s['worst_gap_alone_s'] * 1000:.0f} ms"
                     f" | {s['p90_gap_while_prefilling_s'] * 1000:.0f} / {s['worst_gap_while_prefilling_s'] * 1000:.0f}"
                     f" ms | {s['worst_over_median_alone']:.1f}x | "
                     f"{b['short_ttft_s']:.2f} s | {b['long_ttft_s']:.2f} s | {b['short_over_long']:.2f}x | "
                     f"{b['long_over_alone']:.2f}x | {run['long_beside_one_liners']['long_over_alone']:.2f}x | "
                     f"{run['newcomer_beside_streams']['over_idle']:.2f}x |")
    return "\n".join(lines + [""] + target_table(result["targets"]))


def targets(result: dict) -> list[tuple[str, str, bool]]:
    default = next(run for run in result["runs"] if run["config"] == result["default"])
    s, b = default["stream"], default["short_after_long"]
    return [("worst gap while another prefills <= 4x the median gap (alone)",
             f"{s['worst_over_median_alone']:.1f}x", s["worst_over_median_alone"] <= 4),
            ("one-line message after a long one: TTFT <= 0.2x the long one's", f"{b['short_over_long']:.2f}x",
             b["short_over_long"] <= 0.2),
            ("the long one's TTFT <= 1.2x alone", f"{b['long_over_alone']:.2f}x", b["long_over_alone"] <= 1.2),
            ("a long prompt beside another client's one-liners: TTFT <= 3x alone",
             f"{default['long_beside_one_liners']['long_over_alone']:.2f}x",
             default["long_beside_one_liners"]["long_over_alone"] <= 3),
            ("one client on every row, another's message: TTFT <= 1.5x an idle engine's",
             f"{default['newcomer_beside_streams']['over_idle']:.2f}x",
             default["newcomer_beside_streams"]["over_idle"] <= 1.5)]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default="before,128/512",
                        help="comma-separated: before, CHUNK/ALONE (packed, measured), alone-fixed:CHUNK/ALONE (measured "
                        "beside decode rows only), or fixed:CHUNK/ALONE")
    parser.add_argument("--model", default="bench-full", help="a row of chat/models.py (bench-full, real-qwen3-0.6b)")
    parser.add_argument("--stream-prompt", type=int, default=3000, help="tokens of the message sent mid-stream")
    parser.add_argument("--long-prompt", type=int, default=4000, help="tokens of the long message")
    parser.add_argument("--reply-tokens", type=int, default=160, help="the streaming user's reply")
    parser.add_argument("--delay", type=float, default=0.05, help="seconds between the long and short message")
    parser.add_argument("--alone-step-s", type=float, default=DEFAULT_ALONE_STEP_S,
                        help="with CHUNK/ALONE: the seconds a step may take while none decodes")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each scenario (medians reported)")
    parser.add_argument("--weights", default="full", choices=WEIGHT_FORMATS, help="how the weights are held "
                        "(chat/model_step/weights.py), the same for every config")
    parser.add_argument("--json", dest="json_path", default=None)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    worker = ModelWorker()
    tokenizer = build_bench_tokenizer()
    model = worker.run(build_model, args.model, len(tokenizer), tokenizer.eos_token_id)
    worker.run(apply_weight_format, model, args.weights)  # in place: every engine below holds it so
    model.generation_config.eos_token_id = None  # every reply runs to its length
    words = Words(seed=3)
    stream_text, long_text = message_of(tokenizer, words, args.stream_prompt), message_of(tokenizer, words,
                                                                                         args.long_prompt)
    configs = args.configs.split(",")
    engine = engine_for(configs[-1], model, tokenizer, worker, args.alone_step_s)
    list(engine.conversation(SYSTEM_PROMPT).send("Warm up.", max_new_tokens=4))  # untimed: lazy set-up
    runs = []
    for config in configs:
        engine = engine_for(config, model, tokenizer, worker, args.alone_step_s)
        run = {"config": config,
               "stream": medians([stream_scenario(engine, stream_text, args.reply_tokens)
                                  for _ in range(args.repeats)]),
               "short_after_long": medians([short_after_long_scenario(engine, long_text, args.delay)
                                            for _ in range(args.repeats)]),
               "long_beside_one_liners": medians([long_beside_one_liners_scenario(engine, long_text)
                                                  for _ in range(args.repeats)]),
               "newcomer_beside_streams": medians([newcomer_beside_streams_scenario(
                   engine, engine.scheduler.max_batch_size, args.reply_tokens) for _ in range(args.repeats)])}
        print(run)
        runs.append(run)
    result = {"runs": runs, "default": configs[-1], "machine": f"{platform.machine()}, {torch.get_num_threads()} "
              "threads", "torch": torch.__version__, "args": vars(args)}
    return publish(result, started, targets=targets, markdown=markdown, plot=lambda *_: None,
                   json_path=args.json_path, plot_path=None)


if __name__ == "__main__":
    main()
