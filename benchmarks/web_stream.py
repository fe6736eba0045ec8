"""Decode speed through the library and through the app, on the same model, in one run.

The library: `conv.send` on an engine in this process. The app: `app.py` in a subprocess on the
same weights, its `/send` endpoint streamed over HTTP (server-sent events, read as they arrive).
Each streamed update resends the chat, which costs CPU next to the decoding; updates are
coalesced to at most one per 40 ms
(`ui/replies.py`). Reported: decode tokens/s as the server measured it in both paths, and as
the web client saw it arrive (tokens over the time between the first and the last update); the
same through `gradio_client`; with `--browser`, also while a page in headless Chromium on the same machine renders the stream.
`python -m benchmarks.web_stream --help`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any, Iterator

from benchmarks.models import build_bench_model, build_bench_tokenizer
from chat import ChatEngine
from chat.scheduling.worker import ModelWorker
from ui.outputs import Settings

SYSTEM_PROMPT = "You are a helpful assistant."


def reply_settings(tokens: int) -> list:
    """The app's settings for a benchmark reply: greedy, `tokens` long (the library's too)."""
    return Settings(system_prompt=SYSTEM_PROMPT, max_new_tokens=tokens, temperature=0.0).values()


WARM_UP = Settings(max_new_tokens=8, temperature=0.0).values()


@contextlib.contextmanager
def running_app(folder: str, tokens: int, env: dict | None = None) -> Iterator[Any]:
    """`app.py` on the benchmark weights in a subprocess (tests/app_server.py), closed afterwards."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from app_server import AppServer

    with tempfile.TemporaryDirectory() as scratch:
        server = AppServer("--model", folder, "--max-new-tokens", str(tokens), log_path=Path(scratch) / "app.log",
                           env=env)
        try:
            yield server
        finally:
            server.close()


def server_rate(stats: str) -> float:
    """Decode tokens/s from the app's stats line (Markdown or the text a page shows)."""
    return float(re.search(r"(\d+) tokens/s", stats).group(1))


def library_rates(folder: str, tokens: int, repeats: int) -> list[float]:
    engine = ChatEngine.load(folder, device="cpu", dtype="float32")
    conv = engine.conversation(SYSTEM_PROMPT)
    list(conv.send("warm up", max_new_tokens=8, do_sample=False))
    rates = []
    for index in range(repeats):
        list(conv.send(f"Tell me a long story, part {index}.", max_new_tokens=tokens, do_sample=False))
        rates.append(conv.stats.decode_tokens_per_s)
    return rates


def web_rates(folder: str, tokens: int, repeats: int,
              env: dict | None = None) -> tuple[list[float], list[float], list[int]]:
    """Through the app's REST API (POST, then its server-sent events read as they arrive): the
    client blocks on the socket, so it takes no CPU from the server it measures."""
    def stream(url: str, message: str, values: list) -> tuple[list[float], str]:
        body = json.dumps({"data": [message, None, *values]}).encode()
        request = urllib.request.Request(f"{url}gradio_api/call/send", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            event_id = json.loads(response.read())["event_id"]
        arrivals, last, event = [], "", ""
        with urllib.request.urlopen(f"{url}gradio_api/call/send/{event_id}", timeout=600) as response:
            for raw in response:
                line = raw.decode()
                if line.startswith("event: "):
                    event = line[7:].strip()
                elif line.startswith("data: ") and event in ("generating", "complete"):
                    arrivals.append(time.perf_counter())
                    last = line[6:]
        return arrivals, last

    with running_app(folder, tokens, env) as server:
        stream(server.url, "warm up", WARM_UP)
        server_rates, client_rates, updates = [], [], []
        for index in range(repeats):
            arrivals, final = stream(server.url, f"Tell me a long story, part {index}.", reply_settings(tokens))
            stats = next(o for o in json.loads(final) if isinstance(o, str) and "tokens written" in o)
            generated = int(re.search(r"(\d+) tokens written", stats).group(1))
            server_rates.append(server_rate(stats))
            streaming = arrivals[1:]  # the first update shows the message, before any token
            if len(streaming) > 1 and streaming[-1] > streaming[0]:
                client_rates.append((generated - 1) / (streaming[-1] - streaming[0]))
            updates.append(len(arrivals))
    return server_rates, client_rates, updates


def gradio_client_rates(folder: str, tokens: int, repeats: int) -> list[float]:
    """Through `gradio_client` (its own queue protocol and threads, in this process): the decode
    speed the server measured."""
    from gradio_client import Client

    rates = []
    with running_app(folder, tokens) as server:
        client = Client(server.url, verbose=False)
        client.predict("warm up", *WARM_UP, api_name="/send")
        for index in range(repeats):
            job = client.submit(f"Tell me a long story, part {index}.", *reply_settings(tokens), api_name="/send")
            for _ in job:  # every update as it arrives, as a streaming client reads them
                pass
            rates.append(server_rate(next(o for o in job.result() if isinstance(o, str) and "tokens written" in o)))
    return rates


def browser_rates(folder: str, tokens: int, repeats: int, env: dict | None = None) -> list[float]:
    """Through a real page in headless Chromium (Debian's, driven by Playwright) on the same
    machine: the decode speed the server measured while the browser rendered the stream."""
    from playwright.sync_api import expect, sync_playwright

    rates = []
    with running_app(folder, tokens, env) as server, sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path="/usr/bin/chromium", args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--no-first-run"])
        try:
            page = browser.new_page(viewport={"width": 1200, "height": 1000})
            page.goto(server.url)
            page.wait_for_selector("#message textarea")
            page.get_by_text("Settings", exact=True).click()
            for selector, value in (("#temperature", "0"), ("#max-new-tokens", str(tokens))):
                page.locator(f"{selector} input[type='number']").fill(value)
                page.locator(f"{selector} input[type='number']").press("Enter")
            for index in range(repeats + 1):  # the first one warms up
                before = page.inner_text("#stats")
                page.fill("#message textarea", f"Tell me a long story, part {index}.")
                page.press("#message textarea", "Enter")
                stats = page.locator("#stats")
                expect(stats).not_to_have_text(before, timeout=600_000)
                expect(stats).to_have_text(re.compile(r"^\s*Prompt:"), timeout=600_000)
                if index:
                    rates.append(server_rate(stats.inner_text()))
        finally:
            browser.close()
    return rates


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", dest="json_path", default=None)
    parser.add_argument("--one-thread-too", action="store_true", help="also the app on one torch thread")
    parser.add_argument("--browser", action="store_true", help="also through a page in headless Chromium")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        tokenizer = build_bench_tokenizer()
        model = ModelWorker().run(build_bench_model, "full", len(tokenizer), tokenizer.eos_token_id)
        model.generation_config.eos_token_id = None  # every reply is --tokens long
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        library = library_rates(folder, args.tokens, args.repeats)
        server, client, updates = web_rates(folder, args.tokens, args.repeats)
        if args.one_thread_too:  # the app with one torch thread, leaving a core to the web server
            result_one = web_rates(folder, args.tokens, args.repeats, env={"OMP_NUM_THREADS": "1"})
        else:
            result_one = None
        through_client = gradio_client_rates(folder, args.tokens, args.repeats)
        browser = browser_rates(folder, args.tokens, args.repeats) if args.browser else None
        browser_one = browser_rates(folder, args.tokens, args.repeats, env={"OMP_NUM_THREADS": "1"}) \
            if args.browser and args.one_thread_too else None
    result = {"tokens": args.tokens, "repeats": args.repeats, "library_tokens_per_s": library,
              "web_server_tokens_per_s": server, "web_client_tokens_per_s": client, "web_updates": updates,
              "web_one_thread_server_tokens_per_s": result_one[0] if result_one else None,
              "gradio_client_server_tokens_per_s": through_client,
              "browser_server_tokens_per_s": browser,
              "browser_one_thread_server_tokens_per_s": browser_one,
              "command": "python -m benchmarks.web_stream " + " ".join(argv if argv is not None else sys.argv[1:])}
    ratio = statistics.median(server) / statistics.median(library)
    seen = statistics.median(client) / statistics.median(library) if client else float("nan")
    result["web_vs_library"] = ratio
    result["client_vs_library"] = seen
    result["gradio_client_vs_library"] = statistics.median(through_client) / statistics.median(library)
    if browser:
        result["browser_vs_library"] = statistics.median(browser) / statistics.median(library)
    print(f"decode tokens/s (median of {args.repeats}, {args.tokens} tokens): library "
          f"{statistics.median(library):.1f}; web, measured by the server {statistics.median(server):.1f} "
          f"({ratio:.2f}x); as the client saw it arrive {statistics.median(client):.1f} ({seen:.2f}x); "
          f"{statistics.median(updates):.0f} updates a reply")
    print(f"through gradio_client, measured by the server: {statistics.median(through_client):.1f} "
          f"({result['gradio_client_vs_library']:.2f}x)")
    if browser:
        print(f"through a page in Chromium, measured by the server: {statistics.median(browser):.1f} "
              f"({result['browser_vs_library']:.2f}x)" + (f"; the app on one torch thread: "
                                                            f"{statistics.median(browser_one):.1f}" if browser_one else ""))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
