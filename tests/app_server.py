"""Start `app.py` in a subprocess on a free local port, for end-to-end tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class AppServer:
    def __init__(self, *args: str, log_path: Path, env: dict[str, str] | None = None, port: int | None = None):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}/"
        # each app its own store (shared links, accounts), beside its log
        store = f"sqlite:///{Path(log_path).resolve().parent / f'store-{self.port}.sqlite3'}"
        env = {**os.environ, "GRADIO_ANALYTICS_ENABLED": "False", "STORE_URL": store, "HF_HUB_OFFLINE": "1",
               "PYTHONUNBUFFERED": "1", "GRADIO_HEARTBEAT_INTERVAL": "1", **(env or {})}
        self.log = open(log_path, "w")
        self.process = subprocess.Popen([sys.executable, str(ROOT / "app.py"), "--port", str(self.port), *args],
                                        cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        self._wait_ready()

    def _wait_ready(self, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"app exited with {self.process.returncode}; see {self.log.name}")
            try:
                with urllib.request.urlopen(self.url, timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        raise TimeoutError("app did not start")

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.log.close()
