"""Many users at once against a running app: N `gradio_client` clients × M turns each.

Each client is its own page (its own Gradio session) and asks its own questions, with numbers no
other client uses; after every reply it checks that the conversation it got back holds exactly
the messages it sent (a reply mixed between users counts, and must be 0). Printed: reply time
p50 / p95 (from the call to the last update), errors, mixed replies, and the app's resident
memory before, at its peak and after the clients have gone (its `/status`), with `--rounds` to
see whether memory comes back between rounds.

`python -m benchmarks.load --help`. Either `--url` of a running app, or `--start` (the demo model
in a subprocess, as the tests start it). Not in CI.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, Iterator

from gradio_client import Client

from ui.outputs import Settings


def status(url: str) -> dict:
    with urllib.request.urlopen(url + "status", timeout=30) as response:
        return json.loads(response.read())


def user_texts(chat: list[dict]) -> list[str]:
    return ["".join(part["text"] for part in message["content"] if part.get("type") == "text")
            for message in chat if message["role"] == "user"]


def one_user(url: str, user: int, turns: int, max_new_tokens: int, results: dict) -> None:
    """One page: its own questions, each reply checked to be in its own conversation."""
    values = Settings(system_prompt="You are terse.", max_new_tokens=max_new_tokens, temperature=0.0).values()
    sent: list[str] = []
    try:
        client = Client(url, verbose=False)
    except Exception as error:  # noqa: BLE001  (a refused client is an error to count)
        results["errors"].append(f"user {user}: {error}")
        return
    for turn in range(turns):
        question = f"What is {100 + user} + {turn}?"
        started = time.perf_counter()
        try:
            final = client.predict(question, *values, api_name="/send")
        except Exception as error:  # noqa: BLE001
            results["errors"].append(f"user {user} turn {turn}: {str(error)[:200]}")
            continue
        results["reply_s"].append(time.perf_counter() - started)
        sent.append(question)
        if user_texts(final[0]) != sent:
            results["mixed"] += 1
    client.close()  # its page goes: the server frees its conversation (unload)


def run_round(url: str, clients: int, turns: int, max_new_tokens: int) -> dict:
    results: dict[str, Any] = {"reply_s": [], "errors": [], "mixed": 0}
    peak = {"rss_bytes": status(url)["memory"]["rss_bytes"]}
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.25):
            peak["rss_bytes"] = max(peak["rss_bytes"] or 0, status(url)["memory"]["rss_bytes"] or 0)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    started = time.perf_counter()
    threads = [threading.Thread(target=one_user, args=(url, user, turns, max_new_tokens, results))
               for user in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    done.set()
    sampler.join()
    times = sorted(results["reply_s"])
    return {"clients": clients, "turns": turns, "wall_s": wall, "replies": len(times),
            "p50_s": statistics.median(times) if times else None,
            "p95_s": times[max(0, int(round(0.95 * len(times))) - 1)] if times else None,
            "errors": results["errors"], "mixed": results["mixed"], "peak_rss_bytes": peak["rss_bytes"]}


@contextlib.contextmanager
def started_app(extra: list[str]) -> Iterator[str]:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from app_server import AppServer

    with tempfile.TemporaryDirectory() as scratch:
        server = AppServer(*extra, log_path=Path(scratch) / "app.log")
        try:
            yield server.url
        finally:
            server.close()


def settle(url: str, timeout_s: float) -> dict:
    """The status once the clients' conversations are gone (their pages unload), or at the timeout."""
    deadline = time.monotonic() + timeout_s
    while (now := status(url))["conversations"] and time.monotonic() < deadline:
        time.sleep(1.0)
    return now


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", help="a running app, e.g. http://127.0.0.1:7860/")
    parser.add_argument("--start", action="store_true", help="start the demo app for the run")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--settle-s", type=float, default=60.0, help="how long to wait for pages to unload")
    parser.add_argument("--app-args", default="--max-per-client 0", help="with --start: the app's flags")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if not args.url and not args.start:
        parser.error("give --url of a running app, or --start")
    with (started_app(args.app_args.split()) if args.start else contextlib.nullcontext(args.url)) as url:
        result: dict[str, Any] = {"config": vars(args), "before": status(url)["memory"], "rounds": []}
        for index in range(args.rounds):
            row = run_round(url, args.clients, args.turns, args.max_new_tokens)
            after = settle(url, args.settle_s)
            row["after"], row["conversations_after"] = after["memory"], after["conversations"]
            result["rounds"].append(row)
            print(f"round {index + 1}: {row['replies']} replies, p50 {row['p50_s']:.2f} s, p95 {row['p95_s']:.2f} s, "
                  f"{len(row['errors'])} errors, {row['mixed']} mixed, RSS peak "
                  f"{(row['peak_rss_bytes'] or 0) / 2**20:.0f} MiB, after "
                  f"{(row['after']['rss_bytes'] or 0) / 2**20:.0f} MiB ({row['conversations_after']} conversations "
                  f"left)", flush=True)
    print(f"RSS before: {(result['before']['rss_bytes'] or 0) / 2**20:.0f} MiB")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
