"""What an operator reads, over plain HTTP beside the UI: `GET /healthz`, `GET /status` (JSON)
and `GET /metrics` (Prometheus text format). Aggregate numbers only: never a session key."""

from __future__ import annotations

from typing import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from chat import TurnStats
from ui.directory import ChatDirectory


def server_status(directory: ChatDirectory) -> dict:
    stats, batch = directory.manager.stats(), directory.engine.batch_stats()
    return {"conversations": stats.sessions, "generating": stats.in_use,
            "batch": {"decoding": batch.decoding, "prefilling": batch.prefilling, "waiting": batch.waiting,
                      "max_batch_size": batch.max_batch_size, "largest_batch": batch.largest_batch,
                      "decode_steps": batch.steps, "batch_bytes": batch.batch_bytes,
                      "join_wait_mean_s": round(batch.join_wait_mean_s, 4),
                      "join_wait_max_s": round(batch.join_wait_max_s, 4)},
            "cache_bytes": stats.cache_bytes, "cache_budget_bytes": stats.budget_bytes,
            "shared_prefix_bytes": stats.shared_prefix_bytes, "evictions": stats.evictions,
            "expired": stats.expired, "closed_for_room": stats.closed_for_room,
            "branch_segments_freed": stats.segments_freed}


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
        batch = status["batch"]
        for name, value, text in (
            ("rewind_conversations", status["conversations"], "Conversations held"),
            ("rewind_generating", status["generating"], "Replies being generated"),
            ("rewind_cache_bytes", status["cache_bytes"], "Bytes of every cache, checkpoint and shared prefix"),
            ("rewind_cache_budget_bytes", status["cache_budget_bytes"] or 0, "The cache byte budget (0: none)"),
            ("rewind_batch_size", batch["decoding"], "Rows in the running decode batch"),
            ("rewind_batch_waiting", batch["waiting"], "Replies waiting for a free row"),
            ("rewind_batch_bytes", batch["batch_bytes"], "Bytes of the batched copy of decoding caches"),
        ):
            yield GaugeMetricFamily(name, text, value=value)
        for name, value, text in (("rewind_evictions", status["evictions"], "Idle caches released for the budget"),
                                  ("rewind_expired", status["expired"], "Conversations freed after idling"),
                                  ("rewind_branch_segments_freed", status["branch_segments_freed"],
                                   "Kept states of branches not shown, freed for the budget")):
            yield CounterMetricFamily(name, text, value=value)


def routes(directory: ChatDirectory, metrics: Metrics) -> list[Route]:
    """Plain HTTP routes; given to the app before Gradio's own, so they are found first."""

    async def healthz(request: Request) -> Response:
        return JSONResponse({"ok": True})

    async def status(request: Request) -> Response:
        return JSONResponse(server_status(directory))

    async def prometheus(request: Request) -> Response:
        return PlainTextResponse(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return [Route("/healthz", healthz), Route("/status", status), Route("/metrics", prometheus)]
