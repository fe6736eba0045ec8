"""What parallel page loads carrying large records cost the server, in one run.

Starts the app (the demo model) in its own process, then sends `--loads` page loads at once, each
a forged browser record of `--mb` MB (Gradio's queue, as a page does), from `--clients` addresses
in turn (the app trusts X-Forwarded-For from 127.0.0.1 here), and
meanwhile one small page load from another address, as another user opening the page. Samples
the server's resident memory every 20 ms: idle, the peak, and once every load was answered or
refused (`after`). Reports how many loads were refused early (429 or 503; -1: the server answered
and closed before the client had sent the whole body), how long the other user's load took, and
the statuses.

`python -m benchmarks.parallel_loads --help`; results go to benchmarks/results/parallel-loads.*.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
CLOSED = -1  # the status of a load the server refused before reading its body (the client saw the connection close)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start(port: int, log: Path, *extra: str) -> subprocess.Popen:
    env = dict(os.environ, GRADIO_ANALYTICS_ENABLED="False", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    process = subprocess.Popen([sys.executable, str(ROOT / "app.py"), "--port", str(port), "--trusted-proxies", "127.0.0.1",
                                *extra], cwd=ROOT, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2).read()
            return process
        except OSError:
            if process.poll() is not None:
                raise RuntimeError(f"the app exited ({process.returncode}); see {log}") from None
            time.sleep(0.3)
    raise TimeoutError("the app did not start")


def load_fn(url: str) -> int:
    config = json.loads(urllib.request.urlopen(url + "config", timeout=30).read())
    return next(i for i, d in enumerate(config["dependencies"]) if "onLoad" in (d.get("js") or ""))


def page_load(url: str, fn_index: int, filler_bytes: int, address: str, session: str) -> tuple[int, float]:
    """One page load through the queue, its record `filler_bytes` long: (status of the join,
    seconds until its result came, or until the refusal)."""
    probe = {"current": "bigentry01", "rev": 1,
             "record": {"id": "bigentry01", "rev": 1, "title": "big", "data": {"filler": "x" * filler_bytes}}}
    body = json.dumps({"data": [probe, None], "fn_index": fn_index, "session_hash": session, "event_data": None,
                       "trigger_id": None}).encode()
    started = time.monotonic()
    request = urllib.request.Request(url + "gradio_api/queue/join", data=body, method="POST",
                                     headers={"Content-Type": "application/json", "X-Forwarded-For": address})
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            status = response.status
    except urllib.error.HTTPError as error:
        return error.code, time.monotonic() - started
    except OSError:  # refused before its body was read: the server answered and closed meanwhile
        return CLOSED, time.monotonic() - started
    with urllib.request.urlopen(f"{url}gradio_api/queue/data?session_hash={session}", timeout=600) as stream:
        for line in stream:
            if b"process_completed" in line or b"unexpected_error" in line:
                break
    return status, time.monotonic() - started


def run(loads: int, mb: float, clients: int, extra: list[str]) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}/"
    process = start(port, Path(f"/tmp/parallel-loads-{port}.log"), *extra)
    server = psutil.Process(process.pid)
    try:
        fn_index = load_fn(url)
        page_load(url, fn_index, 1000, "192.0.2.9", "warm")  # the first load's one-off costs
        idle = server.memory_info().rss
        samples, stop = [idle], threading.Event()

        def sample() -> None:
            while not stop.is_set():
                samples.append(server.memory_info().rss)
                time.sleep(0.02)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        results: list[tuple[int, float]] = []
        threads = [threading.Thread(target=lambda i=i: results.append(
            page_load(url, fn_index, int(mb * 2**20), f"192.0.2.{1 + i % clients}", f"big{i}"))) for i in range(loads)]
        for thread in threads:
            thread.start()
        time.sleep(0.5)  # the loads are on their way: now another user opens the page
        other = page_load(url, fn_index, 1000, "198.51.100.7", "other")
        for thread in threads:
            thread.join()
        time.sleep(1.0)
        after = server.memory_info().rss
        stop.set()
        sampler.join()
    finally:
        process.terminate()
        process.wait(30)
    statuses = sorted(status for status, _ in results)
    return {"loads": loads, "mb": mb, "clients": clients, "args": extra, "idle_mb": idle / 2**20, "peak_mb": max(samples) / 2**20,
            "after_mb": after / 2**20, "peak_over_idle_mb": (max(samples) - idle) / 2**20,
            "after_over_idle_mb": (after - idle) / 2**20, "statuses": statuses,
            "refused": sum(status in (429, 503, CLOSED) for status in statuses),
            "slowest_load_s": max(seconds for _, seconds in results), "other_user_load_s": other[1],
            "other_user_status": other[0]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--loads", type=int, default=16)
    parser.add_argument("--mb", type=float, default=25.0)
    parser.add_argument("--clients", type=int, default=1, help="addresses the loads come from, in turn")
    parser.add_argument("--json", default=None, help="write the result here")
    parser.add_argument("--app-args", default="", help="the app's own arguments, as one string")
    args = parser.parse_args(argv)
    result = run(args.loads, args.mb, args.clients, shlex.split(args.app_args))
    result |= {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
               "load_before": os.getloadavg()[0]}
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
