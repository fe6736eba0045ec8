"""Guessed tokens beside llama.cpp's own n-gram drafting, on the same model and conversations.
Not run in CI: it needs a llama-server built from llama.cpp's source.

The model and its GGUF f32 are benchmarks/peers.py's (Qwen3-0.6B's shape, random weights, made
once in `--workdir`). Both are driven through this project's `Conversation` (llama.cpp through
`ServedEngine`, prompts as token ids), greedy, at most `--tokens` reply tokens:

  retry    a reply to a message (untimed), then Retry (regenerate): timed
  fresh    a reply to another message: timed

A reply may end early at the end token (random weights, the same model on both sides: the same
greedy reply); the rate counts the tokens it made. Peers, in rotating order, `--repeats` times (medians of reply tokens a second from the first
token to the last, as the client sees them):

  engine-off / engine-auto            this engine, `--draft off` / `auto`, its weights as
                                      `--weights` (full: fp32) and its decode steps compiled or
                                      not as `--compile` (default off: eager)
  llama.cpp-none / llama.cpp-ngram    llama-server on the GGUF of that precision (f32, or Q8_0
                                      for `--weights int8`), `--spec-type none` / the n-gram type
                                      `--spec-type` names (`--ngram`, default ngram-simple)

    python -m benchmarks.drafting_peers --workdir /tmp/peers --llama-cpp SRC --llama-server SRC/build/bin/llama-server
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from pathlib import Path
from typing import Any, Iterator

import torch

from benchmarks.models import Words
from benchmarks.peers import free_port, prepare, server
from benchmarks.report import cpu_flags, publish, target_table
from chat import ChatEngine
from chat.backends.served import ServedEngine

PEERS = ("engine-off", "engine-auto", "llama.cpp-none", "llama.cpp-ngram")
SCENARIOS = ("retry", "fresh")
TARGET = 1.3  # the issue's: this engine's guessing at least 1.3x llama.cpp's n-gram drafting's tokens/s
SYSTEM_PROMPT = "You are a helpful assistant."


@contextlib.contextmanager
def open_peer(name: str, args: argparse.Namespace, folder: Path, engines: dict[str, ChatEngine]) -> Iterator[Any]:
    if name.startswith("engine"):
        draft = name.split("-")[1]
        if draft not in engines:
            engines[draft] = ChatEngine.load(str(folder), max_batch_size=1, compile=args.compile, draft=draft,
                                             weights=args.weights)
        yield engines[draft]
        return
    port, threads = free_port(), str(torch.get_num_threads())
    spec = "none" if name.endswith("none") else args.ngram
    gguf = "model-q8_0.gguf" if args.weights == "int8" else "model-f32.gguf"
    command = [str(args.llama_server), "-m", str(args.workdir / gguf), "--port", str(port), "-t", threads,
               "-tb", threads, "-np", "1", "-c", "8192", "-ctk", "f32", "-ctv", "f32", "--spec-type", spec]
    with server(command, port, args.workdir / f"drafting-{name}.log", "/health") as url:
        yield ServedEngine(url, "model", tokenizer=str(folder), prompt_format="token-ids", timeout_s=600)


def timed(stream: Any) -> tuple[float, int]:
    first, count = None, 0
    for _ in stream:
        first = first or time.perf_counter()
        count += 1
    return time.perf_counter() - (first or time.perf_counter()), count


def scenarios(peer: Any, args: argparse.Namespace, seed: int) -> dict[str, float]:
    """Reply tokens a second of each scenario (from the reply's first token to its last)."""
    words, options = Words(seed=seed), dict(max_new_tokens=args.tokens, do_sample=False)
    rates = {}
    conv = peer.conversation(SYSTEM_PROMPT)
    for _ in timed(conv.send(words.sentence(args.message_words), **options)):
        pass
    seconds, _ = timed(conv.regenerate(**options))
    rates["retry"] = (conv.stats.generated_tokens - 1) / seconds
    seconds, _ = timed(conv.send(words.sentence(args.message_words), **options))
    rates["fresh"] = (conv.stats.generated_tokens - 1) / seconds
    conv.close()
    return rates


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, required=True, help="benchmarks/peers.py's (the model files)")
    parser.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp's source folder")
    parser.add_argument("--llama-server", type=Path, required=True)
    parser.add_argument("--ngram", default="ngram-simple", help="llama-server's --spec-type for its n-gram peer")
    parser.add_argument("--weights", default="full", choices=("full", "packed", "int8"),
                        help="this engine's (llama.cpp then runs the Q8_0 GGUF for int8, else f32)")
    parser.add_argument("--compile", default="off", choices=("auto", "on", "off"), help="this engine's")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--message-words", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    args.workdir.mkdir(parents=True, exist_ok=True)
    folder = prepare(args.workdir, args.llama_cpp)
    runs: dict[str, list[dict[str, float]]] = {peer: [] for peer in PEERS}
    engines: dict[str, ChatEngine] = {}
    for repeat in range(args.repeats):
        order = PEERS[repeat % len(PEERS):] + PEERS[:repeat % len(PEERS)]
        for name in order:
            with open_peer(name, args, folder, engines) as peer:
                runs[name].append(scenarios(peer, args, seed=repeat))
    medians = {name: {scenario: statistics.median(run[scenario] for run in rows) for scenario in SCENARIOS}
               for name, rows in runs.items()}
    result = {"args": {key: str(value) for key, value in vars(args).items()}, "cpu": cpu_flags(),
              "runs": runs, "median_tokens_per_s": medians}
    return publish(result, started, targets=targets, markdown=markdown, plot=lambda *_: None,
                   json_path=args.json_path, plot_path=None)


def targets(result: dict) -> list[tuple[str, str, bool]]:
    medians = result["median_tokens_per_s"]
    rows = []
    for scenario in SCENARIOS:
        ratio = medians["engine-auto"][scenario] / medians["llama.cpp-ngram"][scenario]
        rows.append((f"{scenario}: engine (auto) >= {TARGET}x llama.cpp's n-gram drafting", f"{ratio:.2f}x",
                     ratio >= TARGET))
    return rows


def markdown(result: dict) -> str:
    lines = ["| peer | " + " | ".join(f"{s} tokens/s" for s in SCENARIOS) + " |",
             "|---|" + "---:|" * len(SCENARIOS)]
    for name, row in result["median_tokens_per_s"].items():
        lines.append(f"| {name} | " + " | ".join(f"{row[s]:.1f}" for s in SCENARIOS) + " |")
    return "\n".join(lines + [""] + target_table(result["targets"]))


if __name__ == "__main__":
    main()
