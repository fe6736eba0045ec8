"""Files the app runs when it loads them back (cache_sessions/sealed.py):
only from a folder no other user can write, only with a seal made under this folder's key for
this very name, and inductor's kernels in the app's own folder, chosen before torch loads."""

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from chat.model_step.compiled import trusted_inductor_cache
from cache_sessions.sealed import BrokenSeal, Sealer, UntrustedFolder, private_folder

ROOT = Path(__file__).resolve().parent.parent


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_sealed_file_reads_back_only_under_its_own_name_and_key(tmp_path):
    sealer = Sealer(tmp_path / "store")
    assert mode(tmp_path / "store") == 0o700 and mode(tmp_path / "store" / "seal.key") == 0o600
    sealer.write("one.graph", b"payload one")
    sealer.write("two.graph", b"payload two")
    assert mode(tmp_path / "store" / "one.graph") == 0o600
    assert sealer.read("one.graph") == b"payload one" and sealer.read("missing.graph") is None
    assert Sealer(tmp_path / "store").read("two.graph") == b"payload two"  # the key is kept: a restart reads it
    # a file copied over another's name (as the cold tier's swapped files were): refused
    (tmp_path / "store" / "one.graph").write_bytes((tmp_path / "store" / "two.graph").read_bytes())
    with pytest.raises(BrokenSeal):
        sealer.read("one.graph")
    # sealed by the same code under another folder's key: refused
    Sealer(tmp_path / "elsewhere").write("two.graph", b"payload two")
    (tmp_path / "store" / "two.graph").write_bytes((tmp_path / "elsewhere" / "two.graph").read_bytes())
    with pytest.raises(BrokenSeal):
        sealer.read("two.graph")
    # one bit changed: refused
    sealer.write("one.graph", b"payload one")
    data = bytearray((tmp_path / "store" / "one.graph").read_bytes())
    data[-1] ^= 1
    (tmp_path / "store" / "one.graph").write_bytes(bytes(data))
    with pytest.raises(BrokenSeal):
        sealer.read("one.graph")
    # a link in a file's place is not followed
    (tmp_path / "store" / "linked.graph").symlink_to(tmp_path / "elsewhere" / "two.graph")
    with pytest.raises(BrokenSeal):
        sealer.read("linked.graph")
    with pytest.raises(ValueError):
        sealer.write("../outside", b"x")


def test_a_folder_another_user_can_write_or_owns_is_not_trusted(tmp_path):
    writable = tmp_path / "writable"
    writable.mkdir()
    writable.chmod(0o777)
    with pytest.raises(UntrustedFolder, match="can be written by other users"):
        private_folder(writable)
    with pytest.raises(UntrustedFolder, match="can be written by other users"):  # its parent could swap it
        private_folder(writable / "inner")
    sticky = tmp_path / "sticky"  # as /tmp: others may write it, but not rename what is this user's
    sticky.mkdir()
    sticky.chmod(0o1777)
    assert mode(private_folder(sticky / "inner")) == 0o700
    narrowed = tmp_path / "readable"
    narrowed.mkdir()
    narrowed.chmod(0o755)
    assert mode(private_folder(narrowed)) == 0o700  # this user's, writable by no one else: narrowed
    (tmp_path / "store").mkdir(mode=0o700)
    (tmp_path / "store" / "seal.key").write_bytes(os.urandom(32))
    (tmp_path / "store" / "seal.key").chmod(0o644)
    with pytest.raises(UntrustedFolder, match="not this user's alone"):
        Sealer(tmp_path / "store")
    if os.getuid() == 0:  # CI and the dev machines run as root: a folder another user owns
        theirs = tmp_path / "theirs"
        theirs.mkdir(mode=0o700)
        os.chown(theirs, 65534, 65534)
        with pytest.raises(UntrustedFolder, match="belongs to another user"):
            private_folder(theirs)


def test_an_untrusted_inductor_cache_is_replaced_by_a_private_one(tmp_path, monkeypatch):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(shared))
    assert "can be written by other users" in trusted_inductor_cache()
    moved = Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
    assert moved != shared and mode(moved) == 0o700
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "own"))
    assert trusted_inductor_cache() is None and mode(tmp_path / "own") == 0o700


INDUCTOR_FOLDER = """
import {module}
from torch._inductor.runtime.cache_dir_utils import cache_dir
print(cache_dir())
"""


@pytest.mark.parametrize("module", ["app", "chat"])
def test_inductors_cache_is_in_the_apps_folder_not_in_tmp(module, tmp_path):
    """Torch fixed it at /tmp/torchinductor_<user> before the app chose."""
    environ = {key: value for key, value in os.environ.items() if key != "TORCHINDUCTOR_CACHE_DIR"}
    run = lambda **env: subprocess.run(  # noqa: E731
        [sys.executable, "-c", INDUCTOR_FOLDER.format(module=module)], cwd=ROOT, env=environ | env,
        capture_output=True, text=True, check=True, timeout=300).stdout.strip().splitlines()[-1]
    assert run(XDG_CACHE_HOME=str(tmp_path)) == str(tmp_path / "rewind-chat" / "inductor")
    assert run(XDG_CACHE_HOME=str(tmp_path), TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "chosen")) == \
        str(tmp_path / "chosen")  # an operator's choice wins
