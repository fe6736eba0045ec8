"""What the branch tree costs and saves, in one run on the benchmark model.

  switch     `switch_branch` back to the long first branch (about `--history` tokens) while its
             cache states are kept: no forward pass; then the next turn prefills only the new
             message. Against: the same switch with the states freed (what the budget does),
             whose next turn prefills the branch from the fork.
  memory     bytes held for kept branches in a conversation of about `--history` tokens with
             `--branches` branches at its first reply.
  reload     a conversation restored from `to_dict()` (a reload whose server cache was freed):
             restore + first reply, against the same reply with the cache held.

`python -m benchmarks.branches --help`; results go to benchmarks/results/branches.*.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from typing import Any

import torch

from benchmarks.models import Words, build_bench_model, build_bench_tokenizer, parameter_count
from benchmarks.report import publish, target_table
from chat import ChatEngine

SYSTEM_PROMPT = "You are a helpful assistant. Answer briefly and stay on topic."


def build_conversation(engine: ChatEngine, words: Words, history_tokens: int, branches: int,
                       message_words: int, max_new_tokens: int):
    """A conversation whose first reply has `branches` siblings, the shown one followed by turns
    up to `history_tokens`."""
    greedy = dict(max_new_tokens=max_new_tokens, do_sample=False)
    conv = engine.conversation(SYSTEM_PROMPT)
    list(conv.send(words.sentence(message_words), **greedy))
    while len(conv.session.token_ids) < history_tokens:
        list(conv.send(words.sentence(message_words), **greedy))
    for seed in range(branches - 1):  # new siblings of the first reply, each with its own later turn
        list(conv.regenerate(2, max_new_tokens=max_new_tokens, do_sample=True, seed=seed))
        list(conv.send(words.sentence(message_words), **greedy))
    return conv


def timed(action) -> tuple[float, Any]:
    started = time.perf_counter()
    value = action()
    return time.perf_counter() - started, value


def switch_rounds(engine: ChatEngine, conv: Any, words: Words, args: argparse.Namespace) -> tuple[Any, dict, int]:
    """Switching back to the long first branch, its states kept then freed, and the next turn."""
    greedy = dict(max_new_tokens=args.max_new_tokens, do_sample=False)
    kept_switch, kept_next, freed_switch, freed_next, segment_bytes = [], [], [], [], 0

    def next_turn() -> dict:
        list(conv.send(words.sentence(12), **greedy))
        stats = conv.stats
        conv.undo()
        return {"prefilled_tokens": stats.prefilled_tokens, "ttft_s": stats.ttft_s,
                "prompt_tokens": stats.prompt_tokens}

    def free_kept_branches() -> None:  # what the memory budget does under pressure, on the loop as it does
        while conv.session.drop_oldest_segment():
            pass

    for repeat in range(args.repeats):
        last = conv.branches(2)[1] - 1
        seconds, restored = timed(lambda: conv.switch_branch(2, 0))
        assert restored, "a kept branch came back without its states"
        kept_switch.append(seconds)
        kept_next.append(next_turn())
        conv.switch_branch(2, last)
        before = conv.session.nbytes()
        engine.scheduler.call(free_kept_branches)
        segment_bytes = segment_bytes or before - conv.session.nbytes()
        seconds, _ = timed(lambda: conv.switch_branch(2, 0))
        freed_switch.append(seconds)
        freed_next.append(next_turn())
        if repeat < args.repeats - 1:
            conv = build_conversation(engine, Words(seed=1), args.history, args.branches, args.message_words,
                                      args.max_new_tokens)
    switch = {"kept_switch_s": kept_switch, "kept_next_turn": kept_next, "freed_switch_s": freed_switch,
              "freed_next_turn": freed_next}
    return conv, switch, segment_bytes


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--history", type=int, default=3000, help="tokens of the longest branch")
    parser.add_argument("--branches", type=int, default=8)
    parser.add_argument("--message-words", type=int, default=60)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json")
    parser.add_argument("--plot")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    torch.manual_seed(0)
    tokenizer = build_bench_tokenizer()
    model = build_bench_model("full", len(tokenizer), tokenizer.convert_tokens_to_ids("<|im_end|>"))
    engine = ChatEngine(model, tokenizer, shared_prefixes=0)
    words = Words(seed=1)
    greedy = dict(max_new_tokens=args.max_new_tokens, do_sample=False)

    conv = build_conversation(engine, words, args.history, args.branches, args.message_words, args.max_new_tokens)
    held = conv.session.nbytes()
    segments = conv.session.segment_count()
    conv, switch, segment_bytes = switch_rounds(engine, conv, words, args)

    # reload: restore from saved data, then the first reply; against the same with the cache held
    data = json.loads(json.dumps(conv.to_dict()))
    message = words.sentence(12)
    reload_s, restored_conv = timed(lambda: engine.restore(data))
    reply_s, _ = timed(lambda: list(restored_conv.send(message, **greedy)))
    reloaded = {"restore_s": reload_s, "first_reply_s": reply_s, "ttft_s": restored_conv.stats.ttft_s,
                "prefilled_tokens": restored_conv.stats.prefilled_tokens, "rebuilt": restored_conv.stats.rebuilt}
    warm_s, _ = timed(lambda: list(conv.send(message, **greedy)))
    held_reply = {"first_reply_s": warm_s, "ttft_s": conv.stats.ttft_s, "prefilled_tokens": conv.stats.prefilled_tokens}

    result = {
        "config": {**vars(args), "model": f"bench-full ({parameter_count(model) / 1e6:.1f} M parameters)",
                   "torch": torch.__version__, "threads": torch.get_num_threads(), "machine": platform.machine()},
        "memory": {"branches": args.branches, "conversation_tokens": args.history, "session_bytes": held,
                   "kept_segments": segments, "kept_segment_bytes": segment_bytes},
        "switch": switch,
        "reload": {"restored": reloaded, "held": held_reply},
    }
    return publish(result, started, targets=targets, markdown=markdown, plot=lambda r, p: None,
                   json_path=args.json, plot_path=None)


def targets(result: dict) -> list[tuple[str, str, bool]]:
    switch = result["switch"]
    kept = statistics.median(t["prefilled_tokens"] for t in switch["kept_next_turn"])
    freed = statistics.median(t["prefilled_tokens"] for t in switch["freed_next_turn"])
    return [("a switch to a kept branch runs no forward pass", "returned True every time", True),
            ("the next turn after a kept switch prefills only the new message",
             f"{kept:.0f} tokens (freed: {freed:.0f})", kept < freed)]


def markdown(result: dict) -> str:
    switch, memory, reload = result["switch"], result["memory"], result["reload"]
    ms = lambda seconds: f"{statistics.median(seconds) * 1000:.1f} ms"  # noqa: E731
    med = lambda rows, key: statistics.median(r[key] for r in rows)  # noqa: E731
    lines = [
        f"# Branches ({result['config']['model']}, {result['config']['threads']} threads)", "",
        "| | switch | next turn prefilled | next turn first token |", "|---|---:|---:|---:|",
        f"| branch states kept | {ms(switch['kept_switch_s'])} | {med(switch['kept_next_turn'], 'prefilled_tokens'):.0f} "
        f"of {med(switch['kept_next_turn'], 'prompt_tokens'):.0f} | {med(switch['kept_next_turn'], 'ttft_s') * 1000:.0f} ms |",
        f"| states freed (re-prefill from the fork) | {ms(switch['freed_switch_s'])} | "
        f"{med(switch['freed_next_turn'], 'prefilled_tokens'):.0f} of {med(switch['freed_next_turn'], 'prompt_tokens'):.0f} "
        f"| {med(switch['freed_next_turn'], 'ttft_s') * 1000:.0f} ms |", "",
        f"Memory: a conversation of about {memory['conversation_tokens']} tokens with {memory['branches']} branches "
        f"holds {memory['session_bytes'] / 2**20:.1f} MiB, of which {memory['kept_segment_bytes'] / 2**20:.1f} MiB "
        f"are the {memory['kept_segments']} kept segments of the branches not shown.", "",
        f"Reload with the server's cache freed: restore {reload['restored']['restore_s'] * 1000:.1f} ms, first reply "
        f"{reload['restored']['first_reply_s']:.2f} s (first token {reload['restored']['ttft_s'] * 1000:.0f} ms, "
        f"{reload['restored']['prefilled_tokens']} tokens prefilled); with the cache held: "
        f"{reload['held']['first_reply_s']:.2f} s (first token {reload['held']['ttft_s'] * 1000:.0f} ms, "
        f"{reload['held']['prefilled_tokens']} prefilled).", "",
    ]
    return "\n".join(lines + target_table(result["targets"]))


if __name__ == "__main__":
    main(sys.argv[1:])
