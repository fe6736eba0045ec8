"""What cache rollback buys: a long conversation answered three ways, turn by turn, in one run.

  session  this project's `Conversation.send` (roll back to the common prefix, prefill the rest)
  naive    what a typical chat Space does: re-render the whole history, `generate` from scratch
  floor    the physical limit: one forward over only the tokens the session had to prefill, on
           top of an already-correct cache

The three run interleaved, in a rotating order, so machine noise hits all of them. Then:
regenerate, undo + send, edit of an earlier turn (against naive), and decode speed of the
session against bare `generate` on the same cache. `python -m benchmarks.multiturn --help`.
"""

from __future__ import annotations

import argparse
import copy
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
from transformers import DynamicCache

from benchmarks.models import (
    SHAPE,
    Words,
    build_bench_model,
    build_bench_tokenizer,
    parameter_count,
    script_think_block,
)
from benchmarks.report import TokenClock, bare_generate_rate, decode_rate, peak_rss_bytes, publish, target_table
from cache_sessions import common_prefix_length
from chat import ChatEngine
from chat.loading import load_model_and_tokenizer
from chat.scheduling.worker import ModelWorker
from chat.model_step.feeding import feed

SYSTEM_PROMPT = "You are a helpful assistant. Answer briefly and stay on topic."


@dataclass
class Timing:
    ttft_s: float
    prefilled_tokens: int
    decode_tokens_per_s: float = 0.0
    generated_tokens: int = 0
    cache_bytes: int = 0


def cache_bytes(cache: DynamicCache) -> int:
    total = 0
    for layer in cache.layers:
        for name in ("keys", "values"):
            tensor = getattr(layer, name, None)
            if isinstance(tensor, torch.Tensor):
                total += tensor.numel() * tensor.element_size()
        for field in ("conv_states", "recurrent_states"):
            for tensor in getattr(layer, field, {}).values():
                if isinstance(tensor, torch.Tensor):
                    total += tensor.numel() * tensor.element_size()
    return total


class Bench:
    def __init__(self, engine: ChatEngine, max_new_tokens: int):
        self.engine = engine
        self.model = engine.model
        self.tokenizer = engine.tokenizer
        self.max_new_tokens = max_new_tokens

    # ---- the three ways -------------------------------------------------------------------------
    def naive(self, messages: list[dict], max_new_tokens: int | None = None) -> tuple[Timing, list[int]]:
        # Every way runs on the engine's compute thread, so they all use the same torch thread pool.
        return self.engine.worker.run(self._naive, messages, max_new_tokens)

    def floor(self, session_before: Any, prompt_ids: list[int]) -> Timing:
        return self.engine.worker.run(self._floor, session_before, prompt_ids)

    @torch.no_grad()
    def _naive(self, messages: list[dict], max_new_tokens: int | None = None) -> tuple[Timing, list[int]]:
        """Re-render everything and `generate` with a fresh cache, as a typical chat Space does."""
        started = time.perf_counter()
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = self.tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        clock, cache = TokenClock(), DynamicCache(config=self.model.config)
        output = self.model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                                     max_new_tokens=max_new_tokens or self.max_new_tokens, do_sample=False,
                                     streamer=clock)
        reply = [t for t in output[0, ids.shape[1]:].tolist() if t not in self.engine.eos_token_ids]
        timing = Timing(clock.times[0] - started, ids.shape[1], decode_rate(clock.times), len(clock.times),
                        cache_bytes(cache))
        return timing, reply

    @torch.no_grad()
    def _floor(self, session_before: Any, prompt_ids: list[int]) -> Timing:
        """One forward over only what is new to the model: prompt[reused:], where `reused` is the
        longest prefix the cache held before the turn (never the whole prompt), on a cache that
        already holds prompt[:reused]. Nothing re-tokenized, re-rendered or rolled back is timed."""
        reused = min(common_prefix_length(session_before.token_ids, prompt_ids), len(prompt_ids) - 1)
        session = copy.deepcopy(session_before, memo={id(self.model): self.model})
        position = session.rollback_to(reused).position
        feed(self.model, session, prompt_ids[position:reused])  # untimed: reach the session's starting point
        new = torch.tensor([prompt_ids[reused:]])
        started = time.perf_counter()
        logits = self.model(input_ids=new, past_key_values=session.cache, use_cache=True, logits_to_keep=1).logits
        int(logits[0, -1].argmax())
        return Timing(time.perf_counter() - started, len(prompt_ids) - reused)

    def session(self, stream: Any, conv: Any) -> tuple[Timing, list[int]]:
        for _ in stream:
            pass
        stats = conv.stats
        return Timing(stats.ttft_s, stats.prefilled_tokens, stats.decode_tokens_per_s, stats.generated_tokens,
                      stats.cache_bytes), conv.reply_ids

    # ---- the conversation --------------------------------------------------------------------------
    def turns(self, conv: Any, questions: list[str]) -> list[dict]:
        rows = []
        for turn, question in enumerate(questions, start=1):
            history = conv.messages + [{"role": "user", "content": question}]
            before = self.engine.worker.run(copy.deepcopy, conv.session, {id(self.model): self.model})
            results: dict[str, Any] = {}
            order = ["session", "naive", "floor"]
            order = order[turn % 3:] + order[: turn % 3]
            if order.index("floor") < order.index("session"):  # floor needs the session's numbers
                order.remove("floor")
                order.append("floor")
            for way in order:
                if way == "session":
                    results["session"] = self.session(conv.send(question, max_new_tokens=self.max_new_tokens,
                                                                do_sample=False), conv)
                elif way == "naive":
                    results["naive"] = self.naive(history)
                else:
                    prompt = self.engine.template.render(conv.messages[:-1]).ids
                    assert len(prompt) == conv.stats.prompt_tokens
                    results["floor"] = (self.floor(before, prompt), None)
            session, session_reply = results["session"]
            naive, naive_reply = results["naive"]
            rows.append({
                "turn": turn,
                "history_tokens": conv.stats.prompt_tokens,
                "session": asdict(session),
                "naive": asdict(naive),
                "floor": asdict(results["floor"][0]),
                "same_reply": session_reply == naive_reply,
                # reply tokens the cache held but the re-rendered prompt spells differently (decode
                # then encode gives other ids): random weights emit non-canonical token sequences
                "retokenized_tokens": len(before.token_ids) - common_prefix_length(
                    before.token_ids, self.engine.template.render(conv.messages[:-1]).ids),
                "peak_rss_bytes": peak_rss_bytes(),
            })
            print(f"turn {turn:2d}: history {conv.stats.prompt_tokens:5d} tokens · ttft session "
                  f"{session.ttft_s * 1000:6.1f} ms, naive {naive.ttft_s * 1000:7.1f} ms, floor "
                  f"{results['floor'][0].ttft_s * 1000:6.1f} ms", file=sys.stderr)
        return rows

    def operations(self, conv: Any, words: Words, message_words: int) -> dict:
        results: dict[str, Any] = {}
        # regenerate: the same prompt again, and a decode step to compare with
        naive, _ = self.naive(conv.messages[:-1])
        session, _ = self.session(conv.regenerate(max_new_tokens=self.max_new_tokens, do_sample=False), conv)
        step = 1 / session.decode_tokens_per_s if session.decode_tokens_per_s else float("nan")
        results["regenerate"] = {"session_ttft_s": session.ttft_s, "naive_ttft_s": naive.ttft_s,
                                 "session_prefilled_tokens": session.prefilled_tokens,
                                 "naive_prefilled_tokens": naive.prefilled_tokens, "decode_step_s": step}
        # undo + send
        conv.undo()
        question = words.sentence(message_words)
        naive, _ = self.naive(conv.messages + [{"role": "user", "content": question}])
        session, _ = self.session(conv.send(question, max_new_tokens=self.max_new_tokens, do_sample=False), conv)
        results["undo_send"] = {"session_ttft_s": session.ttft_s, "naive_ttft_s": naive.ttft_s,
                                "session_prefilled_tokens": session.prefilled_tokens,
                                "naive_prefilled_tokens": naive.prefilled_tokens}
        # edit a user message in the middle of the conversation
        users = [i for i, m in enumerate(conv.messages) if m["role"] == "user"]
        index = users[len(users) // 2]
        question = words.sentence(message_words)
        naive, _ = self.naive(conv.messages[:index] + [{"role": "user", "content": question}])
        session, _ = self.session(conv.edit(index, question, max_new_tokens=self.max_new_tokens, do_sample=False),
                                  conv)
        results["edit"] = {"message_index": index, "session_ttft_s": session.ttft_s, "naive_ttft_s": naive.ttft_s,
                           "session_prefilled_tokens": session.prefilled_tokens,
                           "naive_prefilled_tokens": naive.prefilled_tokens}
        return results

    def decode(self, conv: Any, new_tokens: int, repeats: int) -> dict:
        """Tokens/s of the session against bare `generate` on the same cache and prompt."""
        session_rates, bare_rates = [], []
        prompt = self.engine.template.render(conv.messages[:-1]).ids
        for _ in range(repeats):
            bare_rates.append(self.engine.worker.run(bare_generate_rate, self.model, conv.session, prompt, new_tokens))
            timing, _ = self.session(conv.regenerate(max_new_tokens=new_tokens, do_sample=False), conv)
            session_rates.append(timing.decode_tokens_per_s)
        return {"new_tokens": new_tokens, "session_tokens_per_s": statistics.median(session_rates),
                "bare_tokens_per_s": statistics.median(bare_rates), "session_runs": session_rates,
                "bare_runs": bare_rates}


def arithmetic_questions(turns: int, seed: int = 3) -> list[str]:
    """A sum, then follow-ups on its result ("and plus 7?", "double it", ...), as a user of the
    demo would ask them."""
    import random

    from demo_model.corpus import first_problem, follow_up, question_text

    rng = random.Random(seed)
    first = first_problem(rng, evaluation=True)
    questions, value = [question_text(rng, first)], first.result
    while len(questions) < turns:
        turn = follow_up(rng, first, value)
        if turn.value is not None and turn.value > 5000:
            continue  # keep the numbers to what the demo learned
        questions.append(turn.user)
        value = turn.value if turn.value is not None else value
    return questions


def markdown(result: dict) -> str:
    lines = ["| turn | history tokens | TTFT session | TTFT naive | TTFT floor | prefilled session | "
             "prefilled floor | prefilled naive | decode tok/s session | decode tok/s naive | same reply |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|"]
    for row in result["turns"]:
        s, n, f = row["session"], row["naive"], row["floor"]
        lines.append(f"| {row['turn']} | {row['history_tokens']} | {s['ttft_s'] * 1000:.1f} ms | "
                     f"{n['ttft_s'] * 1000:.1f} ms | {f['ttft_s'] * 1000:.1f} ms | {s['prefilled_tokens']} | "
                     f"{f['prefilled_tokens']} | {n['prefilled_tokens']} | {s['decode_tokens_per_s']:.1f} | "
                     f"{n['decode_tokens_per_s']:.1f} | {'yes' if row['same_reply'] else 'NO'} |")
    lines += ["", "| operation | TTFT session | TTFT naive | prefilled session | prefilled naive |",
              "|---|---:|---:|---:|---:|"]
    for name in ("regenerate", "undo_send", "edit"):
        op = result[name]
        lines.append(f"| {name.replace('_', ' + ')} | {op['session_ttft_s'] * 1000:.1f} ms | "
                     f"{op['naive_ttft_s'] * 1000:.1f} ms | {op['session_prefilled_tokens']} | "
                     f"{op['naive_prefilled_tokens']} |")
    return "\n".join(lines + [""] + target_table(result["targets"]))


def targets(result: dict) -> list[tuple[str, str, bool]]:
    last = result["turns"][-1]
    s, n, f = last["session"]["ttft_s"], last["naive"]["ttft_s"], last["floor"]["ttft_s"]
    wasted = [r["turn"] for r in result["turns"] if r["session"]["prefilled_tokens"] != r["floor"]["prefilled_tokens"]]
    regen = result["regenerate"]
    decode = result["decode"]
    return [
        ("last turn: session TTFT <= 1/10 of naive", f"{s / n:.3f} of naive", s <= n / 10),
        ("last turn: session TTFT within 1.5x of floor", f"{s / f:.2f}x floor", s <= 1.5 * f),
        ("session prefilled tokens = floor's, every turn", "all equal" if not wasted else f"differ at {wasted}",
         not wasted),
        ("regenerate: session TTFT <= 2 decode steps", f"{regen['session_ttft_s'] / regen['decode_step_s']:.2f} steps",
         regen["session_ttft_s"] <= 2 * regen["decode_step_s"]),
        ("decode: session >= 0.95x bare generate",
         f"{decode['session_tokens_per_s'] / decode['bare_tokens_per_s']:.3f}x",
         decode["session_tokens_per_s"] >= 0.95 * decode["bare_tokens_per_s"]),
    ]


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    turns = [row["turn"] for row in result["turns"]]
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    for way, style in (("naive", "o-"), ("session", "s-"), ("floor", "^--")):
        top.plot(turns, [row[way]["ttft_s"] * 1000 for row in result["turns"]], style, label=way)
        bottom.plot(turns, [row[way]["prefilled_tokens"] for row in result["turns"]], style, label=way)
    config = result["config"]
    top.set_title(f"{config['arch']} model, {config['parameters'] / 1e6:.1f} M parameters, "
                  f"{config['dtype']} on {config['device']}{' (thinking replies)' if config['thinking'] else ''}")
    top.set_ylabel("time to first token (ms)")
    bottom.set_ylabel("prefilled tokens")
    bottom.set_xlabel("turn")
    bottom.xaxis.set_major_locator(MaxNLocator(integer=True))
    for axis in (top, bottom):
        axis.grid(alpha=0.3)
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--backend" in argv:  # `--backend openai --base-url URL --model NAME`: against a server
        at = argv.index("--backend")
        if argv[at + 1:at + 2] != ["openai"]:
            raise SystemExit("--backend: only openai (the embedded engine is the default)")
        from benchmarks.served import main as served

        return served(argv[:at] + argv[at + 2:])
    parser = argparse.ArgumentParser(description=__doc__ + "\nWith --backend openai --base-url URL --model NAME: "
                                     "the same against a server (benchmarks/served.py).",
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", choices=("full", "sliding", "hybrid"), default="full")
    parser.add_argument("--model", default=None, help="a hub id or local folder instead of the built-in model")
    parser.add_argument("--thinking", action="store_true", help="replies open with a <think> block")
    parser.add_argument("--arithmetic", action="store_true",
                        help="questions from the demo's corpus (a sum, then follow-ups): with --model demo, "
                             "replies that really think")
    parser.add_argument("--turns", type=int, default=18)
    parser.add_argument("--message-words", type=int, default=70, help="about 100-150 tokens a message")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--decode-tokens", type=int, default=256)
    parser.add_argument("--quick", action="store_true", help="a short run (under 2 minutes)")
    parser.add_argument("--json", dest="json_path", default=None)
    parser.add_argument("--plot", dest="plot_path", default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.turns, args.message_words, args.max_new_tokens, args.decode_tokens = 6, 40, 24, 64
    worker = ModelWorker()  # all torch work on one thread (see chat/scheduling/worker.py)
    if args.model:
        model, tokenizer = worker.run(load_model_and_tokenizer, args.model)
        arch = args.model
    else:
        tokenizer = build_bench_tokenizer()
        model = worker.run(build_bench_model, args.arch, len(tokenizer), tokenizer.eos_token_id)
        arch = args.arch
    if args.thinking:
        script_think_block(model, tokenizer)
    engine = ChatEngine(model, tokenizer, shared_prefixes=0, worker=worker)
    bench = Bench(engine, args.max_new_tokens)
    words = Words(seed=1)
    questions = arithmetic_questions(args.turns) if args.arithmetic else \
        [words.sentence(args.message_words) for _ in range(args.turns)]
    conv = engine.conversation(SYSTEM_PROMPT)
    bench.naive([{"role": "user", "content": "warm up"}], max_new_tokens=4)  # untimed: lazy initialisation

    started = time.perf_counter()
    result: dict[str, Any] = {
        "config": {
            "arch": arch, "parameters": parameter_count(model), "shape": SHAPE if not args.model else None,
            "vocab_size": len(tokenizer), "dtype": str(model.dtype).replace("torch.", ""), "device": str(model.device),
            "turns": args.turns, "message_words": args.message_words, "max_new_tokens": args.max_new_tokens,
            "thinking": args.thinking, "arithmetic": args.arithmetic, "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "machine": f"{platform.processor() or platform.machine()}, {platform.system()}",
            "command": "python -m benchmarks.multiturn " + " ".join(argv if argv is not None else sys.argv[1:]),
        },
        "turns": bench.turns(conv, questions),
    }
    result.update(bench.operations(conv, words, args.message_words))
    result["decode"] = bench.decode(conv, args.decode_tokens, repeats=3)
    return publish(result, started, targets=targets, markdown=markdown, plot=plot, json_path=args.json_path,
                   plot_path=args.plot_path)


if __name__ == "__main__":
    main()
