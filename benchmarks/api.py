"""The OpenAI API of this engine (`python -m chat.api`) beside llama.cpp's server, on the same
model and weights, driven by the same `openai` client with the same conversations. Not run in CI.

Each client turn sends the whole conversation (as every OpenAI client does), streamed, greedy:
`--conversations` conversations of `--turns` turns each, all running at once (each its turns in
order), then one conversation alone, then a Regenerate of each of a few conversations (their
messages minus the last reply). Per server:

  computed / new   prompt tokens computed (prompt - cached, as its usage says) over the tokens new
                   that turn (its prompt less the last turn's prompt and reply), turns 2+
  first token      time to the first streamed token, median over turns 2+, at N and at 1
  regenerate       a Regenerate's first token over one decode step (the median gap between
                   tokens of the conversation alone)

llama.cpp runs with its defaults for slots (`-np` auto), its unified KV cache and its prompt cache
in RAM (`--cache-ram`), `--jinja` (the GGUF's own chat template). The model is `--model`'s shape
(chat/models.py) with seeded random weights and the benchmark tokenizer, converted with llama.cpp's
own `convert_hf_to_gguf.py`; both sides run fp32 weights and KV.

    python -m benchmarks.api --llama-cpp SRC --llama-server SRC/build/bin/llama-server --workdir /tmp/api-bench

`--lookup` times only the kept-state lookup (chat/api/kept_states.py) at many states, no servers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.models import VOCAB, Words, build_bench_tokenizer
from benchmarks.peers import CONVERT, free_port, server
from benchmarks.report import cpu_flags
from chat.models import build_model

SYSTEM_PROMPT = "You are a helpful assistant. Answer briefly and stay on topic."
MODEL_IDS: dict[str, str] = {}  # each server's model, as its /v1/models lists it


def prepare(workdir: Path, llama_cpp: Path, model: str) -> tuple[Path, Path]:
    """The model as a Hugging Face folder and as an f32 GGUF (made once, kept in `workdir`)."""
    folder, gguf = workdir / f"hf-{model}", workdir / f"{model}-f32.gguf"
    if not (folder / "config.json").exists():
        tokenizer = build_bench_tokenizer()
        build_model(model, VOCAB, tokenizer.convert_tokens_to_ids("<|im_end|>")).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    if not gguf.exists():
        done = subprocess.run([sys.executable, "-c", CONVERT, str(llama_cpp), str(folder), "--outtype", "f32",
                               "--outfile", str(gguf)], capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"convert_hf_to_gguf.py failed:\n{done.stderr[-3000:]}")
    return folder, gguf


def stream_turn(client: Any, messages: list[dict], max_tokens: int) -> dict:
    """One streamed, greedy turn: its reply, first-token time, gaps between tokens and usage."""
    model = MODEL_IDS.setdefault(str(client.base_url), client.models.list().data[0].id)
    started = time.perf_counter()
    arrivals, text, usage = [], [], None
    stream = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=max_tokens,
                                            stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices and (chunk.choices[0].delta.content or getattr(chunk.choices[0].delta,
                                                                         "reasoning_content", None)):
            arrivals.append(time.perf_counter())
            text.append(chunk.choices[0].delta.content or "")
    details = getattr(usage, "prompt_tokens_details", None) if usage else None
    return {"reply": "".join(text), "ttft_s": arrivals[0] - started if arrivals else None,
            "gaps_s": [b - a for a, b in zip(arrivals, arrivals[1:])],
            "prompt_tokens": usage.prompt_tokens if usage else None,
            "completion_tokens": usage.completion_tokens if usage else None,
            "cached_tokens": getattr(details, "cached_tokens", None) if details else None}


def conversation(client: Any, seed: int, turns: int, words_a_message: int, max_tokens: int) -> tuple[list, list]:
    """A conversation's turns in order: (each turn's row, its messages at the end)."""
    words, messages, rows = Words(seed=seed), [{"role": "system", "content": SYSTEM_PROMPT}], []
    for _ in range(turns):
        messages.append({"role": "user", "content": words.sentence(words_a_message)})
        row = stream_turn(client, messages, max_tokens)
        rows.append(row)
        messages.append({"role": "assistant", "content": row["reply"]})
    return rows, messages


def summary(conversations: list[list[dict]]) -> dict:
    """Computed over new prompt tokens, turns 2+; median first token, turns 2+."""
    computed = new = 0
    ttfts = []
    for rows in conversations:
        for before, row in zip(rows, rows[1:]):
            if row["cached_tokens"] is None or before["prompt_tokens"] is None:
                continue
            computed += row["prompt_tokens"] - row["cached_tokens"]
            new += row["prompt_tokens"] - before["prompt_tokens"] - before["completion_tokens"]
            ttfts.append(row["ttft_s"])
    return {"computed_over_new": round(computed / new, 3) if new else None,
            "ttft_median_s": round(statistics.median(ttfts), 4) if ttfts else None}


def run_server(name: str, base_url: str, args: argparse.Namespace) -> dict:
    import openai

    client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=1800)
    results: list = [None] * args.conversations
    started = time.perf_counter()

    def one(index: int) -> None:
        results[index] = conversation(client, 100 + index, args.turns, args.message_words, args.max_tokens)

    threads = [threading.Thread(target=one, args=(index,)) for index in range(args.conversations)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    many_s = time.perf_counter() - started
    alone, alone_messages = conversation(client, 7, args.turns, args.message_words, args.max_tokens)
    step_s = statistics.median(gap for row in alone for gap in row["gaps_s"])
    regenerates = []
    for rows, messages in [(alone, alone_messages)] + results[: args.regenerates]:
        regenerates.append(stream_turn(client, messages[:-1], args.max_tokens))
    row = {"server": name, "at_n": summary([rows for rows, _ in results]), "alone": summary([alone]),
           "wall_at_n_s": round(many_s, 1), "decode_step_s": round(step_s, 4),
           "regenerate_ttft_s": [round(r["ttft_s"], 4) for r in regenerates],
           "regenerate_cached": [(r["cached_tokens"], r["prompt_tokens"]) for r in regenerates]}
    row["regenerate_over_step"] = round(statistics.median(row["regenerate_ttft_s"]) / step_s, 2)
    print(json.dumps(row), flush=True)
    return row


def lookup(states_count: int, tokens: int) -> None:
    """The kept-state lookup alone: `states_count` states of `tokens` tokens, one client."""
    from chat.api.kept_states import shared_length

    rng = np.random.default_rng(0)
    system = rng.integers(0, VOCAB, 40)
    held = [np.concatenate([system, rng.integers(0, VOCAB, tokens - 40)]) for _ in range(states_count)]
    prompt = np.concatenate([held[-1][: tokens - 10], rng.integers(0, VOCAB, 60)])
    started, repeats = time.perf_counter(), 20
    for _ in range(repeats):
        best = max(range(states_count), key=lambda index: shared_length(held[index], prompt))
    took = (time.perf_counter() - started) / repeats
    print(json.dumps({"states": states_count, "tokens_each": tokens, "lookup_ms": round(took * 1000, 2),
                      "found": best}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-cpp", type=Path, help="llama.cpp's source folder (for convert_hf_to_gguf.py)")
    parser.add_argument("--llama-server", type=Path, help="a llama-server binary built from it")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/api-bench"))
    parser.add_argument("--model", default="bench-full", help="a shape of chat/models.py")
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--message-words", type=int, default=40)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--regenerates", type=int, default=4)
    parser.add_argument("--servers", nargs="+", default=["engine", "llama.cpp"])
    parser.add_argument("--engine-args", default="--draft off", help="more flags for python -m chat.api")
    parser.add_argument("--llama-args", default="", help="more flags for llama-server (e.g. -np 32)")
    parser.add_argument("--lookup", action="store_true", help="time the kept-state lookup only")
    args = parser.parse_args()
    if args.lookup:
        for count, tokens in ((32, 1000), (256, 2000), (1000, 4000)):
            lookup(count, tokens)
        return
    if "llama.cpp" in args.servers and not (args.llama_cpp and args.llama_server):
        parser.error("llama.cpp needs --llama-cpp and --llama-server")
    args.workdir.mkdir(parents=True, exist_ok=True)
    folder, gguf = prepare(args.workdir, args.llama_cpp, args.model)
    threads = str(os.cpu_count() or 1)
    print(json.dumps({"cpu_flags": cpu_flags(), "load": os.getloadavg(), "model": args.model,
                      "conversations": args.conversations, "turns": args.turns}), flush=True)
    for name in args.servers:
        port, log = free_port(), args.workdir / f"{name}.log"
        if name == "engine":
            command = [sys.executable, "-m", "chat.api", "--model", str(folder), "--port", str(port), "--weights",
                       "full", "--max-batch", "8", *args.engine_args.split()]
            ready = "/v1/models"
        else:
            command = [str(args.llama_server), "-m", str(gguf), "--port", str(port), "-t", threads, "-tb", threads,
                       "-c", str(args.conversations * 2048), "-ctk", "f32", "-ctv", "f32", "--jinja",
                       *args.llama_args.split()]
            ready = "/health"
        with server(command, port, log, ready) as url:
            run_server(name, url, args)


if __name__ == "__main__":
    main()
