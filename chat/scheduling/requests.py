"""One reply being made, as the scheduler serves it (chat/scheduling/scheduler.py): the request a turn
submits and the cache work it asks for. Plain records, read by the scheduler, its request table
(chat/scheduling/request_table.py) and the token choosing (chat/scheduling/guessing.py), so none of them imports another
for it."""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import Hashable, Iterator, Sequence

from cache_sessions.branches import BranchKeep
from cache_sessions.checkpoints import Checkpoint
from cache_sessions.prefixes import PrefixStore
from cache_sessions.session import CacheSession, PrefillResult
from chat.scheduling.drafting import Drafter
from chat.dialogue.options import GenerationOptions
from chat.scheduling.sampling import TokenChooser

_END = object()


@dataclass(frozen=True)
class CacheWork:
    """What a reply asks of the cache beside its prompt: the shared system-prompt prefix, the
    branch it replaces (kept to switch back to), and the messages the cache holds after it."""

    prefix_store: PrefixStore | None = None
    shared_prefix_length: int = 0
    keep: BranchKeep | None = None
    labels: tuple[Hashable, ...] = ()
    references: tuple[tuple[int, ...], ...] = ()  # earlier versions of the reply (their tokens): guesses


class GenerationRequest:
    """One reply being made: submitted by a turn, served by the scheduler. Iterate `tokens()`,
    then call `finish()`, which stops it first if it still runs."""

    def __init__(self, session: CacheSession, prompt_ids: Sequence[int], options: GenerationOptions,
                 stop: threading.Event, work: CacheWork, client: Hashable | None = None, ahead: bool = False):
        """`client`: who asked (the app's key for an address or a person; None: unknown), so one
        client's requests share one client's part of the prompt budget (chat/scheduling/prompt_fairness.py).
        `ahead`: a prompt prepared ahead (the message being typed), prefilled at idle priority and
        never decoded (see `DecodeScheduler.prepare`)."""
        self.session, self.options, self.stop, self.work, self.ahead = session, options, stop, work, ahead
        self.flow: Hashable = client if client is not None else self  # unknown: a flow of its own
        self.prompt_ids = list(prompt_ids)
        self.sequence = list(prompt_ids)  # prompt, then each token as it is chosen
        self.prefill: PrefillResult | None = None  # set once it was admitted and rolled back
        self.chooser: TokenChooser | None = None
        self.drafter: Drafter | None = None  # its guesses, where its rows are drafted (chat/scheduling/drafting.py)
        self.guess_point: Checkpoint | None = None  # where this step with guesses began (recurrent states)
        self.error: BaseException | None = None
        self.submitted_at = time.perf_counter()
        self.started_at: float | None = None  # its rollback and prefill began (it waited until then)
        self.joined_at: float | None = None  # its first decode step
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.token_count = 0
        self.cache_tokens = self.cache_bytes = 0  # the session when it ended (read on the loop)
        self._tokens: queue.SimpleQueue = queue.SimpleQueue()
        self._done = threading.Event()

    @property
    def started(self) -> bool:
        """Whether it was admitted (its cache rolled back); one stopped while waiting was not."""
        return self.prefill is not None

    @property
    def unfed(self) -> list[int]:
        """What its next decode step feeds before any guess: the last chosen token, after what a
        step with guesses took and its recurrent states gave back (chat/scheduling/guessing.py); in its
        first, the prompt's last token after what is left of the prompt (chat/scheduling/step_planner.py)."""
        return self.sequence[len(self.session.token_ids):]

    def tokens(self) -> Iterator[int]:
        while (item := self._tokens.get()) is not _END:
            yield item

    def finish(self) -> list[int]:
        """Stop it if it still runs, wait until it left the batch, and return the sequence."""
        if not self._done.is_set():
            self.stop.set()
            self._done.wait()
        if self.error is not None:
            raise self.error
        return self.sequence

    # ---- called by the scheduler, on the compute thread --------------------------------------
    def _emit(self, token_id: int) -> None:
        now = time.perf_counter()
        self.first_token_at = self.first_token_at or now
        self.last_token_at = now
        self.token_count += 1
        self.sequence.append(token_id)
        self._tokens.put(token_id)

    def _end(self, error: BaseException | None = None) -> None:
        self.error = self.error or error
        self._tokens.put(_END)
        self._done.set()
