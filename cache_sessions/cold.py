"""The cold tier: an idle session's states go to disk instead of being dropped.

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

Disk work runs beside the engine's loop, never in it (a 51 MiB spill stalled every
decoding user by 223 ms). A spill only moves the session's states out of it, to a pending write
(no copy), and a writer thread writes them one tensor at a time; the memory goes when the file
is written. A session needed again before that takes its states straight back; one needed
while its write is running waits beside the loop like a read (`ready`), then takes them from
memory, and the file just written is dropped. A read can be
started ahead (`ready`: the scheduler does so for a request whose session is on disk, and lets it
wait while the others decode); a `resume` with no read started reads on the spot.

A file is a header, a table of the tensors' dtypes and shapes, their raw bytes one after another,
the rest of the session (the cache's layer objects, the rollback kinds, checkpoints, segments,
the ledger) pickled with each tensor replaced by its index, and a keyed BLAKE2b digest of all of
it under a key that lives only in this store's memory. Tensors are read straight into their own
buffers and the pickle is parsed only once the digest matches, so a flipped bit, a file of
another process or a replaced file is refused (the session rebuilds from its text) and never
unpickled; and the unpickler accepts only the classes a session is made of (`_ALLOWED`). Peak
memory while writing or reading is the session's own size and one tensor.
"""

from __future__ import annotations

import copy
import fcntl
import hashlib
import hmac
import io
import json
import os
import pickle
import shutil
import struct
import tempfile
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable

import torch

from cache_sessions.states import CacheStates
from cache_sessions.tensors import filled_bytes


@dataclass(frozen=True)
class ColdStats:
    sessions: int  # sessions whose states are on disk now
    bytes: int  # their files together
    max_bytes: int
    spilled: int  # sessions written out for the budget, in all
    resumed: int  # read back for their next operation
    dropped: int  # files pushed out by the folder's bound (those sessions rebuild)
    writing_bytes: int = 0  # states handed to the writer, still in memory until written
    failed: int = 0  # writes that failed (those sessions rebuild, as after an eviction)


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
_MAGIC = b"rewind-chat cold 3\0"
_HEADER = struct.Struct("<QQQ")  # the table's bytes, the tensors' bytes, the pickle's bytes
_DIGEST_BYTES = 64
_DTYPES = {str(dtype): dtype for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8,
                                           torch.uint8, torch.int32, torch.int64, torch.bool)}


def _raw(tensor: torch.Tensor) -> memoryview:
    """A tensor's bytes, contiguous on the CPU (a copy only of this tensor, where it is a view)."""
    return memoryview(tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy())


def _read_exact(file: BinaryIO, count: int) -> bytes:
    data = file.read(count)
    if len(data) != count:
        raise ValueError("the file is shorter than its header says")
    return data


@dataclass(frozen=True)
class _File:
    """A session's file, as this store wrote it. `tag`: 16 random bytes of this write, the first
    thing its digest covers and never written to disk, so the file reads back only as this
    write: another session's file of this store, swapped into its place (session x came back with
    y's states and ledger), or an older file of the same session is refused."""

    path: Path
    nbytes: int
    tag: bytes


@dataclass(eq=False)
class _Write:
    """States handed to the writer: held here, in memory, until their file is written."""

    states: CacheStates
    nbytes: int
    future: Future | None = None
    wanted: bool = False  # its session asked for them back while they were being written: kept here


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, tensors: list[torch.Tensor]):
        super().__init__(file)
        self._tensors = tensors

    def find_class(self, module: str, name: str) -> Any:
        if name not in _ALLOWED.get(module, ()):
            raise pickle.UnpicklingError(f"{module}.{name} is not part of a cache session")
        return super().find_class(module, name)

    def persistent_load(self, pid: Any) -> torch.Tensor:
        kind, index, device = pid
        if kind != "tensor" or not isinstance(index, int) or not 0 <= index < len(self._tensors):
            raise pickle.UnpicklingError(f"unknown reference {kind!r}")
        return self._tensors[index].to(device)


class _StateFiles:
    """The files of one store: a session's states written as a header, a table of its tensors,
    their bytes and the pickled structure around them, then a keyed digest over all of it. The
    key lives only in this process, so a file is read back only if this store wrote it as it
    is (another process, or anyone who can write the folder, cannot make one it accepts)."""

    def __init__(self, folder: Path, max_bytes: int):
        self.folder, self.max_bytes = folder, max_bytes
        self.key = os.urandom(32)

    def write(self, states: CacheStates) -> tuple[Path, int, bytes]:
        """Write `states` to a new file of the folder; its path, size and the tag its
        digest is bound to (kept in memory with it: see `_File`)."""
        buffer = io.BytesIO()
        pickler = _Pickler(buffer)
        pickler.dump(states)
        structure, tensors = buffer.getvalue(), pickler.tensors
        table = json.dumps([[str(t.dtype), list(t.shape)] for t in tensors]).encode()
        tensor_bytes = filled_bytes(tensors)
        header = _MAGIC + _HEADER.pack(len(table), tensor_bytes, len(structure))
        size = len(header) + len(table) + tensor_bytes + len(structure) + _DIGEST_BYTES
        if size > self.max_bytes:
            raise ValueError("larger than the whole folder may hold")
        digest = hashlib.blake2b(key=self.key, digest_size=_DIGEST_BYTES)
        tag = os.urandom(16)
        digest.update(tag)
        handle, name = tempfile.mkstemp(prefix="session-", suffix=".cold", dir=self.folder)
        path = Path(name)
        try:
            with open(handle, "wb") as file:
                for part in (header, table, *(_raw(t) for t in tensors), structure):  # one tensor at a time
                    file.write(part)
                    digest.update(part)
                file.write(digest.digest())
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        return path, size, tag

    def read(self, path: Path, tag: bytes) -> CacheStates:
        """The session a file holds, each tensor read into its own buffer; parsed only once the
        digest proves these files' key wrote it as it is, for the write `tag` names."""
        digest = hashlib.blake2b(key=self.key, digest_size=_DIGEST_BYTES)
        digest.update(tag)
        with open(path, "rb") as file:
            fixed = _read_exact(file, len(_MAGIC) + _HEADER.size)
            if not fixed.startswith(_MAGIC):
                raise ValueError(f"{path.name}: not a file of this store's format")
            table_bytes, tensor_bytes, structure_bytes = _HEADER.unpack(fixed[len(_MAGIC):])
            if len(fixed) + table_bytes + tensor_bytes + structure_bytes + _DIGEST_BYTES != os.fstat(file.fileno()).st_size:
                raise ValueError(f"{path.name}: its size is not what its header says")
            table_raw = _read_exact(file, table_bytes)
            table = [(_DTYPES[dtype], [int(n) for n in shape]) for dtype, shape in json.loads(table_raw)]
            if sum(torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
                   for dtype, shape in table) != tensor_bytes:
                raise ValueError(f"{path.name}: its tensors do not add up to its header")
            for part in (fixed, table_raw):
                digest.update(part)
            tensors = []
            for dtype, shape in table:
                tensor = torch.empty(shape, dtype=dtype)
                raw = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
                if file.readinto(raw) != len(raw):
                    raise ValueError(f"{path.name}: cut short")
                digest.update(raw)
                tensors.append(tensor)
            structure = _read_exact(file, structure_bytes)
            digest.update(structure)
            if not hmac.compare_digest(digest.digest(), _read_exact(file, _DIGEST_BYTES)):
                raise ValueError(f"{path.name}: not a file this store wrote, or changed since")
        return _Unpickler(io.BytesIO(structure), tensors).load()


class _LockedFolder:
    """A store's own folder inside `--cache-dir` (mode 0700), locked (flock) while the store
    lives, so that no other process's store removes or reads it (`_remove_stale`)."""

    def __init__(self, parent: Path):
        self.path = Path(tempfile.mkdtemp(prefix=f"process-{os.getpid()}-", dir=parent))
        self._held = open(self.path / "lock", "w")  # noqa: SIM115 (held open: the lock lasts as long as the store)
        fcntl.flock(self._held, fcntl.LOCK_EX | fcntl.LOCK_NB)

    def let_go(self) -> None:
        """Close this process's handle only (a forked child's copy: the parent's lock stays held)."""
        self._held.close()

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        self._held.close()


class _Tables:
    """What a store holds and has done: changed by the loop and the disk threads under `lock`,
    read by `stats` from any thread. Keyed by the session object itself, never by a reusable id."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.files: OrderedDict[CacheStates, _File] = OrderedDict()  # oldest first
        self.writes: dict[CacheStates, _Write] = {}  # handed to the writer, not yet in a file
        self.reads: dict[CacheStates, Future] = {}  # files being read ahead
        self.spilled = self.resumed = self.dropped = self.failed = 0

    def stats(self, max_bytes: int) -> ColdStats:
        with self.lock:
            return ColdStats(sessions=len(self.files), bytes=self._bytes(), max_bytes=max_bytes,
                             spilled=self.spilled, resumed=self.resumed, dropped=self.dropped,
                             writing_bytes=sum(write.nbytes for write in self.writes.values()), failed=self.failed)

    def take(self, session: CacheStates, file_too: bool) -> tuple[_Write | None, Future | None, _File | None]:
        """Its pending write, its read ahead and its file, out of the tables (the file only if
        `file_too` or neither of the others was there)."""
        with self.lock:
            write, read = self.writes.pop(session, None), self.reads.pop(session, None)
            take_file = file_too or (write is None and read is None)
            return write, read, self.files.pop(session, None) if take_file else None

    def written(self, session: CacheStates, write: _Write, file: _File, max_bytes: int) -> bool:
        """The writer wrote `file`: kept (older files pushed out to keep the folder within
        `max_bytes` only now that it is safely written), or False where it is no longer wanted (taken back, wanted, discarded,
        closed) and the caller deletes it."""
        with self.lock:
            if self.writes.get(session) is not write or write.wanted:
                return False
            del self.writes[session]
            while self.files and self._bytes() + file.nbytes > max_bytes:
                _, oldest = self.files.popitem(last=False)
                oldest.path.unlink(missing_ok=True)
                self.dropped += 1
            self.files[session] = file
            self.spilled += 1
            return True

    def write_failed(self, session: CacheStates, write: _Write) -> None:
        with self.lock:
            if self.writes.get(session) is write and not write.wanted:  # wanted: still in memory
                del self.writes[session]
                self.failed += 1

    def _bytes(self) -> int:
        return sum(file.nbytes for file in self.files.values())


class ColdStore:
    """Idle sessions' states on disk, in a folder of this process's own: spilled by the loop,
    written and read by two disk threads, put back bit for bit (see the module's docstring)."""

    def __init__(self, folder: str | Path, max_bytes: int):
        if max_bytes < 0:
            raise ValueError("max_bytes must be >= 0")
        self.folder, self.max_bytes = Path(folder), max_bytes
        if self.folder.exists() and not self.folder.is_dir():
            raise ValueError(f"--cache-dir {self.folder} is not a folder")
        self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        _remove_stale(self.folder)
        self._begin()
        os.register_at_fork(after_in_child=self._forked)

    def _begin(self) -> None:
        """A store of its own: its folder (locked while it lives), key, tables and disk threads."""
        self._locked = _LockedFolder(self.folder)
        self.own = self._locked.path
        self._sealed = _StateFiles(self.own, self.max_bytes)  # only this store can write a file it will accept
        self._tables = _Tables()  # the loop and the disk threads change them; `stats` from any thread
        self._start_threads()

    def _forked(self) -> None:
        """In a forked worker (ZeroGPU): a store of its own, in a folder of its own beside the
        parent's. It inherited the parent's folder, file list and key: a spill there could push
        out the parent's oldest file and leave files the parent does not track, and its exit
        removed the parent's whole folder (the parent's sessions then rebuilt from scratch). The
        inherited lock is the parent's: closing the child's copy of it
        leaves the parent's lock held."""
        self._locked.let_go()
        self._begin()

    def _start_threads(self) -> None:
        """The disk threads (started on first use). Each is an executor's, not a daemon: at exit the
        interpreter waits for a write in hand instead of stopping a thread inside torch."""
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="cold-writer")
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="cold-reader")

    def stats(self) -> ColdStats:
        return self._tables.stats(self.max_bytes)

    def flush(self) -> None:
        """Wait until every write handed over so far has ended (tests, benchmarks)."""
        with self._tables.lock:
            futures = [write.future for write in self._tables.writes.values() if write.future is not None]
        wait_for(futures)

    # ---- the loop ------------------------------------------------------------------------------
    def spill(self, session: CacheStates) -> bool:
        """Hand `session`'s states to the writer and leave it released (its memory goes once they
        are written). False (nothing handed over): its states alone would not fit the folder's
        bound, and the budget evicts instead. A write that fails later loses them (the session
        rebuilds, as after an eviction) and drops no other file."""
        nbytes = session.nbytes()
        # what its file holds: each tensor object once (as the pickler writes it), without the room
        # a grown buffer keeps to grow, which `nbytes` counts
        if filled_bytes({id(tensor): tensor for tensor in session.tensors()}.values()) > self.max_bytes:
            return False
        write = _Write(copy.copy(session), nbytes)  # takes its objects: release() gives it new ones
        session.release()  # marks its states lost: what it says if its file is pushed out or fails
        with self._tables.lock:
            self._tables.writes[session] = write
            write.future = self._writer.submit(self._write, session, write)
        return True

    def ready(self, session: CacheStates, when_ready: Callable[[], None]) -> bool:
        """Whether `session`'s states can be put back without waiting on the disk. If not, its file
        starts being read beside the loop and `when_ready` is called once it has been."""
        tables = self._tables
        with tables.lock:
            if session in tables.reads:
                return tables.reads[session].done()
            write = tables.writes.get(session)
            if write is not None:
                assert write.future is not None
                if write.future.cancel() or write.future.done():
                    return True  # not begun (now never will be), or ended: its states are here
                # being written now: taking them back would wait for the disk on the loop (0.70 s
                # for every decoding user); the writer keeps them once it is done
                write.wanted = True
                future = write.future
            else:
                entry = tables.files.pop(session, None)
                if entry is None:
                    return True  # in memory
                future = self._reader.submit(self._read_and_remove, entry)
                tables.reads[session] = future
        future.add_done_callback(lambda _: when_ready())
        return False

    def resume(self, session: CacheStates) -> bool:
        """Put `session`'s states back: from its pending write, from its read ahead (waiting for it
        if it is still running), or from its file. False: none here, or its file could not be
        read (the session then rebuilds at its next turn, as after an eviction)."""
        write, read, entry = self._tables.take(session, file_too=False)
        try:
            if write is not None:
                assert write.future is not None
                if not write.future.cancel():
                    wait_for([write.future])  # it is being written: it discards its file when done
                restored = write.states
            elif read is not None:
                restored = read.result()
            elif entry is not None:
                restored = self._read_and_remove(entry)
            else:
                return False
        except Exception:  # noqa: BLE001 (a damaged, foreign or vanished file: the states are lost, not the turn)
            return False
        session.take_state_of(restored)
        with self._tables.lock:
            self._tables.resumed += 1
        return True

    def discard(self, session: CacheStates) -> None:
        """Its session closed: its file, pending write or read goes."""
        write, read, entry = self._tables.take(session, file_too=True)
        if write is not None and write.future is not None:
            write.future.cancel()
        if read is not None:
            read.cancel()
        if entry is not None:
            entry.path.unlink(missing_ok=True)

    def close(self) -> None:
        """Its files and folder go (at the engine's end, or at exit); writes not begun are dropped."""
        with self._tables.lock:
            self._tables.files.clear()
            self._tables.writes.clear()
            self._tables.reads.clear()
        self._writer.shutdown(wait=False, cancel_futures=True)
        self._reader.shutdown(wait=False, cancel_futures=True)
        self._locked.remove()

    # ---- the disk threads ----------------------------------------------------------------------
    def _write(self, session: CacheStates, write: _Write) -> None:
        path: Path | None = None
        try:
            path, size, tag = self._sealed.write(write.states)
        except Exception:  # noqa: BLE001 (a full disk, no memory: the states are lost, no other file is)
            if path is not None:
                path.unlink(missing_ok=True)
            self._tables.write_failed(session, write)
            return
        if not self._tables.written(session, write, _File(path, size, tag), self.max_bytes):
            path.unlink(missing_ok=True)

    def _read_and_remove(self, entry: _File) -> CacheStates:
        try:
            return self._sealed.read(entry.path, entry.tag)
        finally:
            entry.path.unlink(missing_ok=True)


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
