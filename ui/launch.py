"""Launching the page: Gradio's queue and its tuned and limited parts, this app's middleware and
routes, served until a stop (app.py builds what is served)."""

from __future__ import annotations

import signal
import socket
from typing import Any

import gradio as gr
from starlette.middleware import Middleware

from chat.dialogue import saved
from ui import gradio_limits, gradio_tuning
from ui.browser_copy import SCRIPT as BROWSER_COPY_SCRIPT
from ui.config import AppConfig
from ui.page_assets import CSS, PAGE_SCRIPT, SETTINGS_SCRIPT
from ui.security import SecurityHeaders
from ui.sharing import SCRIPT as SHARES_SCRIPT
from ui.waiting import WaitingBodies, WaitingBook

PAGE_HEAD = BROWSER_COPY_SCRIPT + SETTINGS_SCRIPT + SHARES_SCRIPT


def port_is_free(host: str, port: int) -> bool:
    """Whether the server can listen there. SO_REUSEADDR as uvicorn's own socket: a port whose last
    connections are in TIME-WAIT (a restart) is free, one another process listens on is not."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def serve(demo: gr.Blocks, config: AppConfig, extra_routes: list[Any], middleware: list[Middleware]) -> int:
    """Launch the page with this app's routes and middleware, and serve until stopped."""
    demo.queue(default_concurrency_limit=config.streams, max_size=256)
    largest, waiting = waiting_book(config)
    gradio_tuning.poll_queue_every(demo)  # two costs of Gradio's that slow decoding down (see there)
    gradio_tuning.pass_skipped_outputs_through()
    gradio_tuning.patient_start_check()  # a busy host answered Gradio's own start check late
    gradio_limits.keep_no_event_values()  # what Gradio would keep that a visitor controls (see there)
    gradio_limits.remove_files_of_failed_uploads()
    # show_error: a refused API input says why (Gradio's own checks of a component's value included)
    # Gradio keeps a closed page's state (a copy of the page's components, about 200 KB here) for an
    # hour, up to `state_session_capacity` pages, least recently used first out (10,000 by default:
    # 2 GB); a page whose state went gets its conversation back from the browser's copy.
    # A stop (SIGTERM: a Space or container stopping) ends like Ctrl-C: Gradio closes and the exit
    # handlers run, so the cold tier's files (token ids of conversations) and the exports go too.
    # Set before the launch: the page is served a moment before `launch` returns, and a stop in
    # that moment killed the process outright (exit -15).
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        demo.launch(server_name=config.host, server_port=config.port, enable_monitoring=config.monitoring,
                    show_error=True, footer_links=["api"], run_history=False, quiet=True, prevent_thread_lock=True,
                    state_session_capacity=config.page_states,
                    css=CSS, js=PAGE_SCRIPT, head=PAGE_HEAD, max_file_size=saved.MAX_JSON_BYTES,
                    app_kwargs={"middleware": [Middleware(SecurityHeaders,
                                                          trust_proxy_headers=bool(config.proxies)),
                                               Middleware(WaitingBodies, book=waiting, largest_bytes=largest),
                                               *middleware],
                                "routes": extra_routes,
                                "max_body_size": int(config.max_request_mb * 2**20)})  # larger: 413, unread
        waiting.alive = lambda event_id: event_id in demo._queue.event_ids_to_events  # queued, not yet ended
        print(f"rewind-chat: open {demo.local_url} (health: {demo.local_url}healthz, metrics: {demo.local_url}metrics)",
              flush=True)
    except KeyboardInterrupt:  # stopped while starting, until `block_thread` takes over the Ctrl-C
        demo.close()
        return 0
    demo.block_thread()
    return 0


def waiting_book(config: AppConfig) -> tuple[int, WaitingBook]:
    """The largest body allowed, and what clients may have waiting (ui/waiting.py): one client two
    of the largest, everyone `--max-waiting-mb`, one client `--max-waiting-events` queued events."""
    largest = int(config.max_request_mb * 2**20)
    return largest, WaitingBook(per_client_bytes=2 * largest, total_bytes=int(config.max_waiting_mb * 2**20),
                                per_client_events=config.max_waiting_events)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt
