"""The terminal chat prepares the message being typed, as the page does.

`Conversation.prepare` prefills the conversation as it will be once the text is sent; a Send of
the same text then finds its prompt in the cache. The page asks at most every 150 ms with the text
as it stands (ui/page_assets.py); the terminal does the same through prompt_toolkit, whose line
editor says when the text changes. Its asks run on a thread of their own, so a keystroke never
waits for one (an ask renders and tokenizes the conversation: a few milliseconds at thousands of
tokens), and none runs once the line is sent. Commands (a line starting with "/") are not prepared.
Where stdin or stdout is not a terminal, or prompt_toolkit is missing, the chat reads lines with
`input()` and prepares nothing.
"""

from __future__ import annotations

import math
import sys
import threading
import time
from typing import Any, Callable

# How often the message being typed is asked for (the page's pace too, ui/page_assets.py): at typing
# speed (5 characters a second is a keystroke every 200 ms) each keystroke, so the Send that follows
# at the same pace finds the text it sends prefilled. A newer ask calls the older off.
PREPARE_EVERY_S = 0.15


class TypingAhead:
    """Calls `prepare(text)` at most every `every_s` seconds with the text as it then stands (so
    the last text typed is asked for once its turn comes, unless `close` comes first), on a
    thread of its own."""

    def __init__(self, prepare: Callable[[str], Any], every_s: float = PREPARE_EVERY_S):
        self._prepare, self.every_s = prepare, every_s
        self._text: str | None = None  # typed since the last ask
        self._changed = threading.Condition()
        self._closed = False
        self.asked = 0
        self._thread = threading.Thread(target=self._run, name="typing-ahead", daemon=True)
        self._thread.start()

    def typed(self, text: str) -> None:
        """The line now reads `text` (any thread)."""
        with self._changed:
            self._text = text
            self._changed.notify()

    def close(self) -> None:
        """No ask starts after this returns (one running ends first): the line is being sent, and
        the Send calls the last ask off itself."""
        with self._changed:
            self._closed = True
            self._changed.notify()
        self._thread.join()

    def _run(self) -> None:
        last = -math.inf
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._closed or self._text is not None)
                # the next ask waits for its turn, then takes the text as it stands then
                self._changed.wait_for(lambda: self._closed, timeout=max(0.0, last + self.every_s - time.monotonic()))
                if self._closed:
                    return
                text, self._text = self._text, None
            last = time.monotonic()
            if text is not None and text.strip() and not text.lstrip().startswith("/"):
                self._prepare(text)
                self.asked += 1


def line_reader(prompt: str, prepare: Callable[[str], Any], session: Any = None) -> Callable[[], str]:
    """A function that reads one line at `prompt`, preparing it while it is typed where the
    terminal allows (`session`: a prompt_toolkit `PromptSession` to read with, e.g. a test's
    on a pipe; None: one on the terminal if stdin and stdout are one and prompt_toolkit is
    installed, else plain `input()`). Raises EOFError and KeyboardInterrupt as `input()` does."""
    if session is None:
        try:
            from prompt_toolkit import PromptSession
        except ImportError:
            return lambda: input(prompt)
        if not (sys.stdin.isatty() and sys.stdout.isatty()):
            return lambda: input(prompt)
        session = PromptSession()

    def read() -> str:
        ahead = TypingAhead(prepare)
        changed = lambda buffer: ahead.typed(buffer.text)  # noqa: E731
        session.default_buffer.on_text_changed += changed
        try:
            return session.prompt(prompt)
        finally:
            session.default_buffer.on_text_changed -= changed
            ahead.close()

    return read
