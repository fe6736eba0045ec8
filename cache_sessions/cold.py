"""The cold tier: an idle session's states go to disk instead of being dropped (issue #23).

When the budget is reached, the owner (cache_sessions/owner.py) writes the least recently used
idle session here and frees its memory; that session's next operation reads it back, bit for
bit, so its next turn prefills only the new tokens instead of the whole history. The folder is
bounded: a file that would take it over `max_bytes` pushes out the oldest ones first (those
sessions rebuild at their next turn, as after an eviction). A file is deleted when it is read
back and when its session closes.

Each store writes in a folder of its own inside `--cache-dir` (`process-<pid>-…`, mode 0700),
locked (flock) while the store lives: a second process on the same `--cache-dir`, or a restart
while the old process still runs, neither deletes nor reads the other's files. At start, folders
whose lock nobody holds (a process that died) are removed; at close, the store's own.

A file is a header, one safetensors blob of the session's tensors, the rest of the session (the
cache's layer objects, the rollback kinds, checkpoints, segments, the ledger) pickled with each
tensor replaced by its index, and a keyed BLAKE2b digest of all of it under a key that lives only
in this store's memory. Nothing is parsed before the digest matches, so a flipped bit, a file of
another process or a replaced file is refused (the session rebuilds from its text) and never
unpickled; and the unpickler accepts only the classes a session is made of (`_ALLOWED`).
"""

from __future__ import annotations

import fcntl
import hashlib
import hmac
import io
import os
import pickle
import shutil
import struct
import tempfile
import threading
import time
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


_ALLOWED = {
    "cache_sessions.checkpoints": {"Checkpoint", "CheckpointStore"},
    "cache_sessions.growing": {"GrowingLayer"},
    "cache_sessions.kv_cache": {"KVCacheKind"},
    "cache_sessions.quantized": {"QuantizedLayer"},
    "cache_sessions.rollback": {"FullAttention", "QuantizedAttention", "RecurrentState", "SlidingWindow",
                                "WindowState"},
    "cache_sessions.segments": {"Segment", "SegmentStore"},
    "cache_sessions.session": {"CacheSession"},
    "torch": {"device", "float32", "float16", "bfloat16", "float64"},
    "transformers.cache_utils": {"DynamicCache", "DynamicLayer", "DynamicSlidingWindowLayer", "LinearAttentionLayer"},
}
_MAGIC = b"rewind-chat cold 2\0"
_HEADER = struct.Struct("<QQ")  # the tensors' bytes, the pickle's bytes
_DIGEST_BYTES = 64


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, tensors: dict[str, torch.Tensor]):
        super().__init__(file)
        self._tensors = tensors

    def find_class(self, module: str, name: str) -> Any:
        if name not in _ALLOWED.get(module, ()):
            raise pickle.UnpicklingError(f"{module}.{name} is not part of a cache session")
        return super().find_class(module, name)

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
        if self.folder.exists() and not self.folder.is_dir():
            raise ValueError(f"--cache-dir {self.folder} is not a folder")
        self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        _remove_stale(self.folder)
        self.own = Path(tempfile.mkdtemp(prefix=f"process-{os.getpid()}-", dir=self.folder))  # mode 0700
        self._held = open(self.own / "lock", "w")  # noqa: SIM115 (held open: the lock lasts as long as the store)
        fcntl.flock(self._held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self._key = os.urandom(32)  # only this store can write a file it will accept
        # session -> (its file, bytes), oldest first; keyed by the object itself, never by a reusable id
        self._files: OrderedDict[CacheStates, tuple[Path, int]] = OrderedDict()
        self._lock = threading.Lock()  # the loop changes the files; `stats` is read from any thread
        self.spilled = self.resumed = self.dropped = 0

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
        freed, no other file dropped): its file alone would not fit the folder's bound, or writing
        it failed in any way (a full disk, no memory to serialize): the budget evicts instead."""
        path: Path | None = None
        try:
            parts = self._serialized(session)
            size = sum(len(part) for part in parts)
            if size > self.max_bytes:
                return False
            handle, name = tempfile.mkstemp(prefix="session-", suffix=".cold", dir=self.own)
            path = Path(name)
            with open(handle, "wb") as file:
                for part in parts:  # written one by one: no joined copy
                    file.write(part)
        except Exception:  # noqa: BLE001 (whatever failed, the session stays as it was in memory)
            if path is not None:
                path.unlink(missing_ok=True)
            return False
        with self._lock:  # older files make room only once this one is safely written
            while self._files and self._bytes() + size > self.max_bytes:
                self._drop_oldest()
            self._files[session] = (path, size)
            self.spilled += 1
        session.release()  # marks its states lost: what it says if its file is pushed out
        return True

    def _serialized(self, session: CacheStates) -> tuple[bytes, ...]:
        buffer = io.BytesIO()
        pickler = _Pickler(buffer)
        pickler.dump(session)
        # each tensor copied on its own: views of one storage (crops) cannot share a safetensors entry
        tensors = {str(i): t.detach().to("cpu").contiguous().clone() for i, t in enumerate(pickler.tensors)}
        data = save_tensors(tensors)
        del tensors
        structure = buffer.getvalue()
        header = _MAGIC + _HEADER.pack(len(data), len(structure))
        digest = hashlib.blake2b(key=self._key, digest_size=_DIGEST_BYTES)
        for part in (header, data, structure):
            digest.update(part)
        return header, data, structure, digest.digest()

    def resume(self, session: CacheStates) -> bool:
        """Put `session`'s states back from its file (deleted afterwards). False: none here, or it
        could not be read (the session then rebuilds at its next turn, as after an eviction)."""
        with self._lock:
            entry = self._files.pop(session, None)
        if entry is None:
            return False
        path, _ = entry
        try:
            restored = self._read(path)
        except Exception:  # noqa: BLE001 (a damaged, foreign or vanished file: the states are lost, not the turn)
            return False
        finally:
            path.unlink(missing_ok=True)
        session.take_state_of(restored)
        with self._lock:
            self.resumed += 1
        return True

    def _read(self, path: Path) -> CacheStates:
        """The session a file holds, once its digest proves this store wrote it as it is."""
        blob = memoryview(path.read_bytes())
        body, digest = blob[:-_DIGEST_BYTES], blob[-_DIGEST_BYTES:]
        if not hmac.compare_digest(hashlib.blake2b(body, key=self._key, digest_size=_DIGEST_BYTES).digest(), digest):
            raise ValueError(f"{path.name}: not a file this store wrote, or changed since")
        start = len(_MAGIC) + _HEADER.size
        tensor_bytes, structure_bytes = _HEADER.unpack(body[len(_MAGIC) : start])
        tensors = load_tensors(bytes(body[start : start + tensor_bytes]))
        structure = body[start + tensor_bytes : start + tensor_bytes + structure_bytes]
        return _Unpickler(io.BytesIO(structure), tensors).load()

    def discard(self, session: CacheStates) -> None:
        """Its session closed: its file goes."""
        with self._lock:
            entry = self._files.pop(session, None)
        if entry is not None:
            entry[0].unlink(missing_ok=True)

    def close(self) -> None:
        """Its files and folder go (at the engine's end, or at exit)."""
        with self._lock:
            self._files.clear()
        shutil.rmtree(self.own, ignore_errors=True)
        self._held.close()

    def _drop_oldest(self) -> None:
        _, (path, _) = self._files.popitem(last=False)
        path.unlink(missing_ok=True)
        self.dropped += 1


def _remove_stale(folder: Path) -> None:
    """Folders of stores whose process is gone (nobody holds their lock), and the loose files an
    earlier version left at the top; anything else in `folder` stays."""
    for path in folder.glob("session-*.cold"):
        path.unlink(missing_ok=True)
    for own in folder.glob("process-*"):
        if not (own / "lock").exists() and time.time() - own.stat().st_mtime < 60:
            continue  # being made this moment: its lock comes next
        try:
            with open(own / "lock", "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # a live store's
        except OSError:
            pass  # no lock file: a folder half made or half removed
        shutil.rmtree(own, ignore_errors=True)
