"""A count of things under way, kept from any thread: plans being made, streams into a page."""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator


class InFlight:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count = 0

    @property
    def count(self) -> int:
        return self._count

    @contextmanager
    def held(self) -> Iterator[None]:
        """Counted while the block runs, however it ends."""
        with self._lock:
            self._count += 1
        try:
            yield
        finally:
            with self._lock:
                self._count -= 1
