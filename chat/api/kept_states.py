"""The API's conversations, found by their tokens.

A client of the OpenAI API sends the whole conversation every turn and no id: its next turn, a
Regenerate (the messages minus the last reply) and an edit (a changed message) all arrive as a
prompt. Each client's kept cache sessions are looked up by the token ids they held when their
last reply ended; the one sharing the longest prefix with the prompt serves it:

- **continues**: the prompt extends everything the session held (a next turn);
- **rolls back**: the prompt parts from it inside its last reply (a Regenerate, a next turn of a
  model whose template drops the reply's reasoning): nothing the client can come back to is
  lost, so the session is rolled back in place;
- **copies**: the prompt parts from it earlier (an edit of an earlier message, another
  conversation with the same system prompt and first words): a new session starts from a copy of
  the shared prefix, and the old one stays for the conversation it belongs to;
- **new**: less than `MIN_COPY` tokens shared (prefilling so few costs less than waiting for the
  loop to copy them); a new session (which starts from the shared system-prompt prefix, if
  the engine keeps it).

Sessions are kept per client (an API key's holder or an address): one client's prompts never run
on another's states, so none can time another's. A session in use by one request is not offered
to another. Over `max_states` (all clients) or `max_per_client`, the least recently used idle
session is closed; below that, the engine's memory budget and cold tier govern them as they do
the page's.

The lookup is a scan of the client's sessions, each compared as a whole array: a few
milliseconds at a thousand sessions of thousands of tokens (`benchmarks/api.py --lookup` times
it), well below one decode step, and it needs nothing updated while tokens stream.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field
from typing import Callable, Hashable, Literal, Sequence

import numpy as np

from cache_sessions.owner import CacheOwner
from cache_sessions.session import CacheSession

How = Literal["continues", "rolls back", "copies", "new"]
DEFAULT_MAX_STATES = 256
MIN_COPY = 16  # shared tokens worth a copy
DEFAULT_STATES_PER_CLIENT = 64


@dataclass(eq=False)
class Kept:
    """A kept session and what the index knows of it: the ids it held when its last reply ended
    (the prompt and the reply's fed tokens), where that reply began, and when it was last used."""

    session: CacheSession
    client: Hashable
    ids: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    reply_start: int = 0
    used: int = 0
    busy: bool = False


@dataclass(frozen=True)
class Claim:
    """A request's session, held until `KeptStates.give_back`: how it was found, and how many of
    the prompt's tokens the chosen state shared before any rollback."""

    kept: Kept
    how: How
    shared: int
    earlier_reply: tuple[int, ...] = ()  # a Regenerate's earlier reply: the best guesses there are

    @property
    def session(self) -> CacheSession:
        return self.kept.session


def shared_length(held: np.ndarray, prompt: np.ndarray) -> int:
    """How many leading tokens the two share."""
    limit = min(len(held), len(prompt))
    differ = np.flatnonzero(held[:limit] != prompt[:limit])
    return int(differ[0]) if differ.size else limit


class KeptStates:
    def __init__(self, caches: CacheOwner, run_on_loop: Callable[..., object], *,
                 max_states: int = DEFAULT_MAX_STATES, max_per_client: int = DEFAULT_STATES_PER_CLIENT):
        """`caches`: the engine's cache owner; `run_on_loop(function, *args)`: runs a change to the
        caches on the engine's loop and returns its result (`DecodeScheduler.call`)."""
        if max_states < 1 or max_per_client < 1:
            raise ValueError("max_states and max_per_client must be at least 1")
        self.caches, self.run_on_loop = caches, run_on_loop
        self.max_states, self.max_per_client = max_states, max_per_client
        self._lock = threading.Lock()
        self._kept: dict[Hashable, list[Kept]] = {}
        self._clock = itertools.count(1)
        self.found = {"continues": 0, "rolls back": 0, "copies": 0, "new": 0}
        self.copies_refused = 0

    def claim(self, client: Hashable, prompt_ids: Sequence[int]) -> Claim:
        """The session to serve `prompt_ids` on, held for this request (see the module's rules)."""
        prompt = np.asarray(prompt_ids, dtype=np.int64)
        with self._lock:
            best, shared = self._best(client, prompt)
            if best is not None and shared > 0 and (shared >= best.reply_start or shared == len(best.ids)):
                how: How = "continues" if shared == len(best.ids) else "rolls back"
                earlier = tuple(int(token) for token in best.ids[best.reply_start:]) \
                    if how == "rolls back" and shared == len(prompt) == best.reply_start else ()
                best.busy, best.used = True, next(self._clock)
                self.found[how] += 1
                return Claim(best, how, shared, earlier)
            source = best if best is not None and shared >= MIN_COPY else None
            if source is not None:
                source.busy = True  # not rolled back by another request while it is copied
            kept = self._add(client)
        if source is None:
            with self._lock:
                self.found["new"] += 1
            return Claim(kept, "new", 0)
        try:
            copied = bool(self.run_on_loop(self.caches.start_from, kept.session, source.session, shared))
        finally:
            with self._lock:
                source.busy = False
        with self._lock:
            self.found["copies" if copied else "new"] += 1
            self.copies_refused += not copied
        return Claim(kept, "copies", shared) if copied else Claim(kept, "new", 0)

    def nearest(self, client: Hashable, prompt_ids: Sequence[int]) -> list[int]:
        """The ids held by the idle session sharing the most with `prompt_ids` (none: [])."""
        with self._lock:
            best, _ = self._best(client, np.asarray(prompt_ids, dtype=np.int64))
            return best.ids[: len(best.session.token_ids)].tolist() if best is not None else []

    def give_back(self, claim: Claim, sequence: Sequence[int], reply_start: int) -> None:
        """The request ended: `sequence` is its prompt and the tokens chosen, of which the
        session holds what it holds (all but the last, or nothing after a failure)."""
        kept = claim.kept
        held = min(len(kept.session.token_ids), len(sequence))
        with self._lock:
            kept.ids = np.asarray(sequence[:held], dtype=np.int64)
            kept.reply_start = min(reply_start, held)
            kept.busy, kept.used = False, next(self._clock)
            self._close_over_limits(kept.client)

    def stats(self) -> dict[str, object]:
        """Aggregates for `/status`: sessions kept, in use, how requests found theirs."""
        with self._lock:
            every = [kept for entries in self._kept.values() for kept in entries]
            return {"kept": len(every), "in_use": sum(kept.busy for kept in every), "clients": len(self._kept),
                    "found": dict(self.found), "copies_refused": self.copies_refused}

    # ---- under the lock --------------------------------------------------------------------------
    def _best(self, client: Hashable, prompt: np.ndarray) -> tuple[Kept | None, int]:
        """The idle session sharing most with `prompt` (the most recently used among equals)."""
        best, best_shared = None, -1
        for kept in self._kept.get(client, ()):
            if kept.busy:
                continue
            # what the session still holds: the budget may have released it since
            held = kept.ids[: len(kept.session.token_ids)]
            shared = shared_length(held, prompt)
            if shared > best_shared or (shared == best_shared and best is not None and kept.used > best.used):
                best, best_shared = kept, shared
        return best, max(best_shared, 0)

    def _add(self, client: Hashable) -> Kept:
        kept = Kept(self.caches.new_session(), client, busy=True, used=next(self._clock))
        self._kept.setdefault(client, []).append(kept)
        self._close_over_limits(client)
        return kept

    def _close_over_limits(self, client: Hashable) -> None:
        """Close least recently used idle sessions: the client's own over its limit, then anyone's
        over the total."""
        own = self._kept.get(client, [])
        while len(own) > self.max_per_client and self._close_oldest(own):
            pass
        while sum(len(entries) for entries in self._kept.values()) > self.max_states:
            every = [kept for entries in self._kept.values() for kept in entries]
            if not self._close_oldest(every):
                break

    def _close_oldest(self, candidates: list[Kept]) -> bool:
        idle = [kept for kept in candidates if not kept.busy]
        if not idle:
            return False
        oldest = min(idle, key=lambda kept: kept.used)
        entries = self._kept[oldest.client]
        entries.remove(oldest)
        if not entries:
            del self._kept[oldest.client]
        self.caches.close(oldest.session)
        return True
