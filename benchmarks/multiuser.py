"""What batching across conversations buys: N conversations replying at once, in one run.

Every conversation first gets about `--history` tokens of history (untimed). Then, for each
conversation, its reply alone (the reference: wall time, time to first token, decode speed and
the greedy tokens), and for N = 1, 2, 4, 8 the same messages sent at once from N threads, as N
browsers would; and staggered arrivals, a new conversation every `--stagger` decode steps.
Each reply is compared token for token with the same conversation's reply alone, and one
conversation's decode speed alone with bare `generate` on the same cache.
`python -m benchmarks.multiuser --help`.
"""

from __future__ import annotations

import argparse
import copy
import platform
import statistics
import sys
import threading
import time
from typing import Any

import torch

from benchmarks.models import SHAPE, Words, build_bench_model, build_bench_tokenizer, parameter_count
from benchmarks.report import TokenClock, decode_rate, publish, target_table
from chat import ChatEngine, Conversation
from chat.scheduling.worker import ModelWorker
from chat.model_step.feeding import rewind_and_prefill

SYSTEM_PROMPT = "You are a helpful assistant. Answer briefly and stay on topic."


class Bench:
    def __init__(self, engine: ChatEngine, max_new_tokens: int):
        self.engine, self.max_new_tokens = engine, max_new_tokens

    def history(self, conv: Conversation, words: Words, tokens: int) -> None:
        """Untimed: turns of long messages and short replies until about `tokens` are held."""
        while (conv.stats.prompt_tokens if conv.stats else 0) < tokens - 150:
            list(conv.send(words.sentence(120), max_new_tokens=8, do_sample=False))

    def reply(self, conv: Conversation, message: str, started: float) -> dict:
        """Send and drain; times from `started` (when the group was released)."""
        first = None
        for _ in conv.send(message, max_new_tokens=self.max_new_tokens, do_sample=False):
            first = first or time.perf_counter()
        done = time.perf_counter()
        stats = conv.stats
        return {"ttft_s": (first or done) - started, "end_s": done - started, "generated": stats.generated_tokens,
                "prefilled_tokens": stats.prefilled_tokens, "prompt_tokens": stats.prompt_tokens,
                "decode_tokens_per_s": stats.decode_tokens_per_s, "reply": list(conv.reply_ids),
                "cache_bytes": stats.cache_bytes}

    def alone(self, conv: Conversation, message: str) -> dict:
        result = self.reply(conv, message, time.perf_counter())
        conv.undo()  # the same message is sent again in every scenario
        return result

    def together(self, convs: list[Conversation], messages: list[str], arrive_at_steps: list[int]) -> dict:
        """Each conversation sends once the scheduler has run `arrive_at_steps[i]` decode steps
        since the start (all zeros: at the same moment)."""
        results: list[dict | None] = [None] * len(convs)
        steps_at_start = self.engine.batch_stats().steps
        started = time.perf_counter()

        def run(index: int) -> None:
            arrived = time.perf_counter()
            result = self.reply(convs[index], messages[index], arrived)
            result["arrived_s"] = arrived - started
            results[index] = result

        threads = []
        for index, steps in enumerate(arrive_at_steps):
            while self.engine.batch_stats().steps - steps_at_start < steps:
                time.sleep(0.0005)
            threads.append(threading.Thread(target=run, args=(index,)))
            threads[-1].start()
        for thread in threads:
            thread.join()
        wall = time.perf_counter() - started
        for conv in convs:
            conv.undo()
        return {"wall_s": wall, "replies": results,
                "decode_steps": self.engine.batch_stats().steps - steps_at_start}

    @torch.no_grad()
    def _bare_decode(self, conv: Conversation, message: str) -> float:
        """Plain `generate` on a copy of the conversation's cache, prepared as a turn would."""
        model = self.engine.model
        session = copy.deepcopy(conv.session, memo={id(model): model})
        prompt = self.engine.template.render(conv.messages + [{"role": "user", "content": message}]).ids
        rewind_and_prefill(model, session, prompt)
        clock, ids = TokenClock(), torch.tensor([prompt])
        model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=session.cache,
                       max_new_tokens=self.max_new_tokens, do_sample=False, streamer=clock)
        return decode_rate(clock.times)

    def bare_decode(self, conv: Conversation, message: str) -> float:
        return self.engine.worker.run(self._bare_decode, conv, message)


def summarize(name: str, run: dict, alone: list[dict], alone_wall_s: float, alone_step_s: float) -> dict:
    """One scenario against the replies alone. A reply's TTFT beyond its TTFT alone (which is its
    own prefill plus one step) is counted in this scenario's decode steps (the running batch's,
    wall time over steps), and in steps of one conversation alone (shorter: a stricter count)."""
    replies = run["replies"]
    same = [r["reply"] == a["reply"] for r, a in zip(replies, alone)]
    generated = sum(r["generated"] for r in replies)
    batch_step_s = run["wall_s"] / max(run["decode_steps"], 1)
    excess = [r["ttft_s"] - a["ttft_s"] for r, a in zip(replies, alone)]
    return {
        "scenario": name, "conversations": len(replies), "wall_s": run["wall_s"],
        "wall_vs_alone": run["wall_s"] / alone_wall_s, "tokens_per_s": generated / run["wall_s"],
        "ttft_s": [r["ttft_s"] for r in replies], "ttft_alone_s": [a["ttft_s"] for a in alone],
        "batch_step_s": batch_step_s, "ttft_excess_steps": [e / batch_step_s for e in excess],
        "ttft_excess_alone_steps": [e / alone_step_s for e in excess],
        "same_as_alone": all(same), "same_per_conversation": same,
        "own_cache_bytes": sum(r["cache_bytes"] for r in replies), "decode_steps": run["decode_steps"],
    }


def markdown(result: dict) -> str:
    lines = ["| scenario | N | wall | vs one alone | tokens/s | decode step | TTFT (max) | TTFT beyond alone, max "
             "(batch steps / steps alone) | same replies | own caches |",
             "|---|---:|---:|---:|---:|---:|---:|---:|:---:|---:|"]
    for row in result["scenarios"]:
        lines.append(f"| {row['scenario']} | {row['conversations']} | {row['wall_s']:.2f} s | "
                     f"{row['wall_vs_alone']:.2f}x | {row['tokens_per_s']:.0f} | {row['batch_step_s'] * 1000:.1f} ms | "
                     f"{max(row['ttft_s']) * 1000:.0f} ms | {max(row['ttft_excess_steps']):.1f} / "
                     f"{max(row['ttft_excess_alone_steps']):.1f} | {'yes' if row['same_as_alone'] else '**no**'} | "
                     f"{row['own_cache_bytes'] / 2**20:.1f} MiB |")
    return "\n".join(lines + [""] + target_table(result["targets"]))


def targets(result: dict) -> list[tuple[str, str, bool]]:
    by_name = {row["scenario"]: row for row in result["scenarios"]}
    checks: list[tuple[str, str, bool]] = []
    for count, limit in ((4, 2.3), (8, 3.2)):
        row = by_name.get(f"{count} at once")
        if row:
            checks.append((f"{count} at once: wall <= {limit}x one alone", f"{row['wall_vs_alone']:.2f}x",
                           row["wall_vs_alone"] <= limit))
    staggered = by_name.get("staggered")
    if staggered:
        late = staggered["ttft_excess_steps"][1:]  # everyone who arrived while others decoded
        checks.append(("staggered: TTFT <= own prefill + 6 decode steps", f"max {max(late):.1f} batch steps "
                       f"({max(staggered['ttft_excess_alone_steps'][1:]):.1f} steps alone)", max(late) <= 6))
    checks.append(("greedy replies identical to alone, every scenario",
                   "all identical" if all(r["same_as_alone"] for r in result["scenarios"]) else "differ",
                   all(r["same_as_alone"] for r in result["scenarios"])))
    decode = result["decode"]
    ratio = decode["alone_tokens_per_s"] / decode["bare_tokens_per_s"]
    checks.append(("one alone decodes >= 0.95x bare generate", f"{ratio:.3f}x", ratio >= 0.95))
    return checks


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [row for row in result["scenarios"] if row["scenario"].endswith("at once")]
    counts = [row["conversations"] for row in rows]
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(counts, [row["wall_vs_alone"] for row in rows], "o-", label="batched (measured)")
    left.plot(counts, counts, "--", color="grey", label="one after another")
    left.set_xlabel("conversations replying at once")
    left.set_ylabel("wall time / one alone")
    left.legend()
    right.plot(counts, [row["tokens_per_s"] for row in rows], "s-")
    right.set_xlabel("conversations replying at once")
    right.set_ylabel("tokens/s, all together")
    config = result["config"]
    figure.suptitle(f"{config['arch']} model, {config['parameters'] / 1e6:.1f} M parameters, "
                    f"~{config['history_tokens']} tokens of history, {config['max_new_tokens']} tokens a reply, "
                    f"{config['device']}")
    for axis in (left, right):
        axis.grid(alpha=0.3)
        axis.set_xticks(counts)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", choices=("full", "sliding", "hybrid"), default="full")
    parser.add_argument("--history", type=int, default=1000, help="tokens of history per conversation")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--counts", default="1,2,4,8", help="conversations at once, comma-separated")
    parser.add_argument("--stagger", type=int, default=10, help="decode steps between staggered arrivals")
    parser.add_argument("--prefill-chunk", type=int, default=None)
    parser.add_argument("--weights", default="full", help="the engine's weights: full, packed, auto (chat/model_step/weights.py)")
    parser.add_argument("--json", dest="json_path", default=None)
    parser.add_argument("--plot", dest="plot_path", default=None)
    args = parser.parse_args(argv)
    counts = [int(count) for count in args.counts.split(",")]
    worker = ModelWorker()  # all torch work on one thread (see chat/scheduling/worker.py)
    tokenizer = build_bench_tokenizer()
    model = worker.run(build_bench_model, args.arch, len(tokenizer), tokenizer.eos_token_id)
    model.generation_config.eos_token_id = None  # every reply is max_new_tokens long: equal work
    settings: dict[str, Any] = dict(prefill_chunk=args.prefill_chunk) if args.prefill_chunk else {}
    engine = ChatEngine(model, tokenizer, shared_prefixes=0, worker=worker, max_batch_size=max(counts),
                        weights=args.weights, **settings)
    bench = Bench(engine, args.max_new_tokens)
    words = Words(seed=2)
    convs = [engine.conversation(SYSTEM_PROMPT) for _ in range(max(counts))]
    for conv in convs:
        bench.history(conv, words, args.history)
    messages = [words.sentence(20) for _ in convs]
    for conv, message in zip(convs, messages):  # untimed: lazy initialisation, and the history's
        bench.alone(conv, message)  # last reply re-rendered once (its ids can differ from the sampled ones)

    started = time.perf_counter()
    alone = [bench.alone(conv, message) for conv, message in zip(convs, messages)]
    alone_wall = statistics.mean(a["end_s"] for a in alone)
    step_s = 1 / statistics.median(a["decode_tokens_per_s"] for a in alone)  # one decode step alone
    scenarios = []
    for count in counts:
        run = bench.together(convs[:count], messages[:count], [0] * count)
        scenarios.append(summarize(f"{count} at once", run, alone[:count], alone_wall, step_s))
        print(f"{count} at once: {run['wall_s']:.2f} s ({run['wall_s'] / alone_wall:.2f}x alone)", file=sys.stderr)
    arrivals = [index * args.stagger for index in range(max(counts))]
    run = bench.together(convs, messages, arrivals)
    scenarios.append(summarize("staggered", run, alone, alone_wall, step_s))
    bare = statistics.median(bench.bare_decode(convs[0], messages[0]) for _ in range(3))
    again = [bench.alone(convs[0], messages[0])["decode_tokens_per_s"] for _ in range(3)]
    result: dict[str, Any] = {
        "config": {
            "arch": args.arch, "parameters": parameter_count(model), "shape": SHAPE, "vocab_size": len(tokenizer),
            "dtype": str(model.dtype).replace("torch.", ""), "device": str(model.device),
            "history_tokens": args.history, "prompt_tokens": [a["prompt_tokens"] for a in alone],
            "max_new_tokens": args.max_new_tokens, "counts": counts, "stagger_steps": args.stagger,
            "max_batch_size": engine.config.max_batch_size, "prefill_chunk": engine.config.prefill_chunk,
            "packed": engine.scheduler.runner.packs,
            "torch": torch.__version__, "threads": torch.get_num_threads(),
            "machine": f"{platform.processor() or platform.machine()}, {platform.system()}",
            "command": "python -m benchmarks.multiuser " + " ".join(argv if argv is not None else sys.argv[1:]),
        },
        "alone": [{k: v for k, v in a.items() if k != "reply"} for a in alone],
        "alone_wall_s": alone_wall, "alone_step_s": step_s,
        "scenarios": [{k: v for k, v in row.items()} for row in scenarios],
        "decode": {"alone_tokens_per_s": statistics.median(again), "bare_tokens_per_s": bare},
    }
    result["largest_batch"] = engine.batch_stats().largest_batch
    return publish(result, started, targets=targets, markdown=markdown, plot=plot, json_path=args.json_path,
                   plot_path=args.plot_path)


if __name__ == "__main__":
    main()
