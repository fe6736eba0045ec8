"""What an operator reads, over plain HTTP beside the UI: `GET /healthz`, `GET /status` (JSON)
and `GET /metrics` (Prometheus text format). Aggregate numbers only: never a session key."""

from __future__ import annotations

import resource
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from chat import TurnStats, __version__
from chat.api import ApiRuns
from ui.directory import ChatDirectory


def _git_commit() -> str | None:
    """The commit this checkout is at, if it is a git checkout (a Space's repository is)."""
    try:
        found = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).resolve().parent,
                               capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return found.stdout.strip() or None if found.returncode == 0 else None


STARTED = time.time()
_COMMIT = _git_commit()
VERSION = f"{__version__}+{_COMMIT}" if _COMMIT else __version__


def memory() -> dict[str, int | None]:
    """This process's resident memory now and at its peak (Linux's /proc; None elsewhere)."""
    try:
        with open("/proc/self/statm") as statm:
            resident = int(statm.read().split()[1]) * resource.getpagesize()
    except (OSError, ValueError, IndexError):
        resident = None
    return {"rss_bytes": resident, "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def server_status(directory: ChatDirectory, api: ApiRuns | None = None) -> dict:
    """Which app and model, since when; the conversations held, and what the engine says of itself
    (its batch and caches, or its model server). `busy`: conversations with an operation running.
    `openai_api`: the API's requests in flight and kept states, where it is served."""
    stats = directory.manager.stats()
    served = {"openai_api": api.stats()} if api is not None else {}
    return {"version": VERSION, "started_at": datetime.fromtimestamp(STARTED, timezone.utc).isoformat(),
            "uptime_s": round(time.time() - STARTED), "conversations": stats.sessions, "busy": stats.busy,
            "generating": stats.busy, "expired": stats.expired, "closed_for_room": stats.closed_for_room,
            "memory": memory(), **directory.engine.status(), **served}


class Metrics:
    """Counters and histograms the handlers feed after each reply, and gauges read at scrape time."""

    def __init__(self, directory: ChatDirectory):
        self.directory = directory
        self.registry = CollectorRegistry()
        self.replies = Counter("rewind_replies", "Replies streamed, by operation and outcome",
                               ["operation", "outcome"], registry=self.registry)
        self.tokens = Counter("rewind_prompt_tokens", "Prompt tokens, reused from the cache or prefilled",
                              ["kind"], registry=self.registry)
        self.generated = Counter("rewind_generated_tokens", "Tokens generated", registry=self.registry)
        self.ttft = Histogram("rewind_time_to_first_token_seconds", "From the request to its first token",
                              buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30), registry=self.registry)
        self.decode = Histogram("rewind_decode_tokens_per_second", "Decode speed of each reply",
                                buckets=(1, 5, 10, 20, 40, 80, 160, 320, 640), registry=self.registry)
        self.registry.register(_Gauges(directory))

    def reply_done(self, operation: str, stats: TurnStats | None, failed: bool) -> None:
        if failed or stats is None:
            self.replies.labels(operation, "error").inc()
            return
        self.replies.labels(operation, "stopped" if stats.stopped else "done").inc()
        self.tokens.labels("reused").inc(stats.reused_tokens)
        self.tokens.labels("prefilled").inc(stats.prefilled_tokens)
        self.generated.inc(stats.generated_tokens)
        self.ttft.observe(stats.ttft_s)
        if stats.decode_tokens_per_s > 0:
            self.decode.observe(stats.decode_tokens_per_s)


class _Gauges:
    """Read from the session manager and the scheduler when scraped."""

    def __init__(self, directory: ChatDirectory):
        self.directory = directory

    def collect(self) -> Iterator:
        status = server_status(self.directory)
        batch = status.get("batch", {})  # a model server's engine has no batch or caches here
        cold = status.get("cold_tier", {})  # only with --cache-dir
        compiled = status.get("compiled_step", {})
        for name, value, text in (
            ("rewind_conversations", status["conversations"], "Conversations held"),
            ("rewind_generating", status["generating"], "Replies being generated"),
            ("rewind_planning", status["planning"], "Operations being planned"),
            ("rewind_cache_bytes", status.get("cache_bytes", 0), "Bytes of every cache, checkpoint and shared prefix"),
            ("rewind_cache_budget_bytes", status.get("cache_budget_bytes") or 0, "The cache byte budget (0: none)"),
            ("rewind_batch_size", batch.get("decoding", 0), "Rows in the running decode batch"),
            ("rewind_batch_waiting", batch.get("waiting", 0), "Replies waiting for a free row"),
            ("rewind_cold_bytes", cold.get("bytes", 0), "Bytes of idle caches kept on disk (--cache-dir)"),
            ("rewind_compiled_step_ready", int(bool(compiled.get("ready"))),
             "Whether decode steps run compiled (chat/model_step/compiled.py)"),
            ("rewind_compiled_step_graphs", compiled.get("graphs", 0), "Graphs compiled for the decode step"),
            ("rewind_compiled_step_compile_seconds", compiled.get("compile_s") or 0, "Seconds its compile took"),
        ):
            yield GaugeMetricFamily(name, text, value=value)
        for name, value, text in (
            ("rewind_evictions", status.get("evictions", 0), "Idle caches released for the budget"),
            ("rewind_expired", status["expired"], "Conversations freed after idling"),
            ("rewind_branch_segments_freed", status.get("branch_segments_freed", 0),
             "Kept states of branches not shown, freed for the budget"),
            ("rewind_cold_spills", cold.get("spilled", 0), "Idle caches written to disk for the budget"),
            ("rewind_cold_resumes", cold.get("resumed", 0), "Caches read back from disk for their next operation"),
        ):
            yield CounterMetricFamily(name, text, value=value)


def routes(directory: ChatDirectory, metrics: Metrics, api: ApiRuns | None = None) -> list[Route]:
    """Plain HTTP routes; given to the app before Gradio's own, so they are found first."""

    async def healthz(request: Request) -> Response:
        return JSONResponse({"ok": True})

    async def status(request: Request) -> Response:
        return JSONResponse(server_status(directory, api))

    async def prometheus(request: Request) -> Response:
        return PlainTextResponse(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return [Route("/healthz", healthz), Route("/status", status), Route("/metrics", prometheus)]
