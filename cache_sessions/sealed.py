"""Files the app writes and later runs: kept in a folder only the app's user can reach, sealed
with a key only the app holds, and bound to what they were made for.

A saved compiled step is code: loading one unpickles it and runs its bytecode and inductor's
kernels. Its file name is a hash of public facts (versions, config, sources), so a name proves
nothing. Here a file is accepted only when:

- its folder is owned by this process's user and no one else can write it (a folder another user
  can write, or one another user owns, is refused whole: nothing is read from it or written to it);
- its seal verifies: an HMAC-SHA256, under a key kept in that folder with mode 0600, over the
  name the file was sealed for and its bytes. A file copied over another's name, written by hand
  or with another key is refused before a byte of it is unpickled.

The key is made once per folder (32 random bytes, created exclusively, 0600) and kept, since the
files must outlive the process. Whoever can read the key could also replace the files in the
same folder: both are guarded by the same owner check.
"""

from __future__ import annotations

import atexit
import hashlib
import hmac
import os
import stat
import tempfile
import threading
from pathlib import Path

_MAGIC = b"rewind-chat sealed 1\n"
_SEAL_BYTES = 32
_KEY_NAME = "seal.key"
_KEY_BYTES = 32


# Held while a sealed file is written; at exit, taken for good (a process that ends without its
# interpreter's teardown, chat/host.py's `end_process`, ends between two writes, never in one).
_WRITING = threading.Lock()
atexit.register(lambda: _WRITING.acquire(timeout=30))


class UntrustedFolder(RuntimeError):
    """A folder another user owns or can write: what is in it may not be run."""


class BrokenSeal(ValueError):
    """A file whose seal does not verify: written by someone else, for another name, or damaged."""


def private_folder(path: Path) -> Path:
    """`path` as a folder only this user can reach: made with mode 0700 (its parents as usual),
    or, if it exists, checked to be this user's and writable by no one else, then narrowed to
    0700. Its parent must not be writable by another user either, unless sticky (as /tmp is):
    whoever can write it could rename the folder away and put their own in its place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        pass
    info = path.lstat()
    if not stat.S_ISDIR(info.st_mode):
        raise UntrustedFolder(f"{path} is not a folder")
    if info.st_uid != os.getuid():
        raise UntrustedFolder(f"{path} belongs to another user (uid {info.st_uid})")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UntrustedFolder(f"{path} can be written by other users (mode {stat.S_IMODE(info.st_mode):o})")
    parent = path.parent.stat()
    if parent.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not parent.st_mode & stat.S_ISVTX:
        raise UntrustedFolder(f"{path.parent} can be written by other users: {path} could be replaced")
    if stat.S_IMODE(info.st_mode) != 0o700:
        os.chmod(path, 0o700)
    return path


class Sealer:
    """Seals and opens the files of one private folder with that folder's key."""

    def __init__(self, folder: Path):
        self.folder = private_folder(folder)
        self._key = self._folder_key()

    def _folder_key(self) -> bytes:
        path = self.folder / _KEY_NAME
        try:
            descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except FileExistsError:
            pass
        else:
            with os.fdopen(descriptor, "wb") as file:
                file.write(os.urandom(_KEY_BYTES))
        descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(descriptor, "rb") as file:
            info = os.fstat(file.fileno())
            if info.st_uid != os.getuid() or info.st_mode & 0o077:
                raise UntrustedFolder(f"{path} is not this user's alone (mode {stat.S_IMODE(info.st_mode):o})")
            key = file.read()
        if len(key) != _KEY_BYTES:
            raise UntrustedFolder(f"{path} is not a key ({len(key)} bytes)")
        return key

    def _seal(self, name: str, payload: bytes) -> bytes:
        mac = hmac.new(self._key, digestmod=hashlib.sha256)
        mac.update(name.encode() + b"\0")
        mac.update(payload)
        return mac.digest()

    def write(self, name: str, payload: bytes) -> Path:
        """`payload` sealed for `name`, written as `name` in the folder (whole or not at all, 0600)."""
        if "/" in name or name in ("", ".", "..", _KEY_NAME):
            raise ValueError(f"not a file name here: {name!r}")
        with _WRITING:
            descriptor, temporary = tempfile.mkstemp(dir=self.folder, prefix=".sealing-")  # mode 0600
            try:
                with os.fdopen(descriptor, "wb") as file:
                    file.write(_MAGIC + self._seal(name, payload) + payload)
                os.replace(temporary, self.folder / name)
            except BaseException:
                Path(temporary).unlink(missing_ok=True)
                raise
        return self.folder / name

    def read(self, name: str) -> bytes | None:
        """The payload sealed for `name`; None where there is no such file. Raises `BrokenSeal`
        for a file that is not this folder's seal of `name`."""
        try:
            descriptor = os.open(self.folder / name, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            return None
        except OSError as error:  # a link put in a file's place
            raise BrokenSeal(f"{name}: {error}") from None
        with os.fdopen(descriptor, "rb") as file:
            data = file.read()
        seal, payload = data[len(_MAGIC): len(_MAGIC) + _SEAL_BYTES], data[len(_MAGIC) + _SEAL_BYTES:]
        if not data.startswith(_MAGIC) or not hmac.compare_digest(seal, self._seal(name, payload)):
            raise BrokenSeal(f"{name} is not sealed by this app for this name")
        return payload
