"""The cold tier: an idle session's states go to disk instead of being dropped (issue #23).

When the budget is reached, the owner (cache_sessions/owner.py) writes the least recently used
idle session here and frees its memory; that session's next operation reads it back, bit for
bit, so its next turn prefills only the new tokens instead of the whole history. The folder is
bounded: a file that would take it over `max_bytes` pushes out the oldest ones first (those
sessions rebuild at their next turn, as after an eviction). A file is deleted when it is read
back and when its session closes; the folder is emptied when the store opens and closes.

A file is one safetensors file of the session's tensors, followed by the rest of the session
(the cache's layer objects, the rollback kinds, checkpoints, segments, the ledger) pickled with
each tensor replaced by its index. Pickles are read only from this store's own folder (mode 0700,
files it wrote), never from anything a client sent.
"""

from __future__ import annotations

import io
import itertools
import os
import pickle
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from cache_sessions.states import CacheStates


@dataclass(frozen=True)
class ColdStats:
    sessions: int  # sessions whose states are on disk now
    bytes: int  # their files together
    max_bytes: int
    spilled: int  # sessions written out for the budget, in all
    resumed: int  # read back for their next operation
    dropped: int  # files pushed out by the folder's bound (those sessions rebuild)


class _Pickler(pickle.Pickler):
    """Tensors are left out of the pickle and kept in order, each object once."""

    def __init__(self, file: io.BytesIO):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors: list[torch.Tensor] = []
        self._index: dict[int, int] = {}

    def persistent_id(self, obj: Any) -> Any:
        if not isinstance(obj, torch.Tensor):
            return None
        if id(obj) not in self._index:
            self._index[id(obj)] = len(self.tensors)
            self.tensors.append(obj)
        index = self._index[id(obj)]
        return ("tensor", index, str(obj.device))


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, tensors: dict[str, torch.Tensor]):
        super().__init__(file)
        self._tensors = tensors

    def persistent_load(self, pid: Any) -> torch.Tensor:
        kind, index, device = pid
        if kind != "tensor":
            raise pickle.UnpicklingError(f"unknown reference {kind!r}")
        return self._tensors[str(index)].to(device)


class ColdStore:
    def __init__(self, folder: str | Path, max_bytes: int):
        if max_bytes < 0:
            raise ValueError("max_bytes must be >= 0")
        self.folder, self.max_bytes = Path(folder), max_bytes
        self._clear()
        self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        # session -> (its file, bytes), oldest first; keyed by the object itself, never by a reusable id
        self._files: OrderedDict[CacheStates, tuple[Path, int]] = OrderedDict()
        self._lock = threading.Lock()  # the loop changes the files; `stats` is read from any thread
        self.spilled = self.resumed = self.dropped = 0
        self._names = itertools.count()

    def holds(self, session: CacheStates) -> bool:
        return session in self._files

    def stats(self) -> ColdStats:
        with self._lock:
            return ColdStats(sessions=len(self._files), bytes=self._bytes(), max_bytes=self.max_bytes,
                             spilled=self.spilled, resumed=self.resumed, dropped=self.dropped)

    def _bytes(self) -> int:
        return sum(n for _, n in self._files.values())

    def spill(self, session: CacheStates) -> bool:
        """Write `session`'s states here and free them in memory. False (nothing written, nothing
        freed): its file alone would not fit the folder's bound, or the disk refused it."""
        buffer = io.BytesIO()
        pickler = _Pickler(buffer)
        pickler.dump(session)
        # each tensor copied on its own: views of one storage (crops) cannot share a safetensors entry
        tensors = {str(i): t.detach().to("cpu").contiguous().clone() for i, t in enumerate(pickler.tensors)}
        data = save_tensors(tensors)
        del tensors
        parts = (struct.pack("<Q", len(data)), data, buffer.getvalue())  # written one by one: no joined copy
        size = sum(len(part) for part in parts)
        if size > self.max_bytes:
            return False
        with self._lock:
            while self._files and self._bytes() + size > self.max_bytes:
                self._drop_oldest()
        path = self.folder / f"session-{next(self._names)}.cold"
        try:
            with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as file:
                for part in parts:
                    file.write(part)
        except OSError:  # a full or failing disk: the budget evicts instead
            path.unlink(missing_ok=True)
            return False
        with self._lock:
            self._files[session] = (path, size)
            self.spilled += 1
        session.release()  # marks its states lost: what it says if its file is pushed out
        return True

    def resume(self, session: CacheStates) -> bool:
        """Put `session`'s states back from its file (deleted afterwards). False: none here, or it
        could not be read (the session then rebuilds at its next turn, as after an eviction)."""
        with self._lock:
            entry = self._files.pop(session, None)
        if entry is None:
            return False
        path, _ = entry
        try:
            blob = path.read_bytes()
            (length,) = struct.unpack("<Q", blob[:8])
            tensors = load_tensors(blob[8 : 8 + length])
            restored = _Unpickler(io.BytesIO(blob[8 + length :]), tensors).load()
        except Exception:  # noqa: BLE001 (a damaged or vanished file: the states are lost, not the turn)
            return False
        finally:
            path.unlink(missing_ok=True)
        session.take_state_of(restored)
        with self._lock:
            self.resumed += 1
        return True

    def discard(self, session: CacheStates) -> None:
        """Its session closed: its file goes."""
        with self._lock:
            entry = self._files.pop(session, None)
        if entry is not None:
            entry[0].unlink(missing_ok=True)

    def close(self) -> None:
        with self._lock:
            self._files.clear()
        self._clear()

    def _drop_oldest(self) -> None:
        _, (path, _) = self._files.popitem(last=False)
        path.unlink(missing_ok=True)
        self.dropped += 1

    def _clear(self) -> None:
        """Only this store's own files: a folder given by mistake keeps everything else."""
        if self.folder.is_dir():
            for path in self.folder.glob("session-*.cold"):
                path.unlink(missing_ok=True)
        elif self.folder.exists():
            raise ValueError(f"--cache-dir {self.folder} is not a folder")

