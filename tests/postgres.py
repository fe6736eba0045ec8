"""A real PostgreSQL server for the store's tests, made in a temporary folder and stopped after.

Debian's `postgresql` package (`.ci/run` installs it) gives `initdb` and `pg_ctl`; the server
listens on a Unix socket in the folder only (no TCP port to clash with). PostgreSQL refuses to run
as root, so under root it runs as the package's `postgres` user. `start` says why it could not,
for the tests to skip with that reason.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path


def _binaries() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    return Path(found[-1]).parent if found else None


class PostgresServer:
    def __init__(self) -> None:
        self.folder: Path | None = None
        self.url = ""

    def start(self) -> str | None:
        """Start it; None, or why it could not start."""
        binaries = _binaries()
        if binaries is None:
            return "PostgreSQL is not installed (apt-get install postgresql)"
        try:
            import psycopg  # noqa: F401
        except ImportError:
            return "the psycopg driver is not installed (pip install psycopg[binary])"
        self.folder = Path(tempfile.mkdtemp(prefix="rewind-pg-"))
        run_as: list[str] = []
        if os.geteuid() == 0:
            try:
                user = pwd.getpwnam("postgres")
            except KeyError:
                return "running as root and there is no postgres user to run PostgreSQL as"
            os.chown(self.folder, user.pw_uid, user.pw_gid)
            run_as = ["runuser", "-u", "postgres", "--"]
        data, socket_dir = self.folder / "data", self.folder
        try:
            subprocess.run([*run_as, str(binaries / "initdb"), "-D", str(data), "-U", "rewind", "-A", "trust",
                            "--no-sync", "-E", "UTF8", "--locale", "C"], check=True, capture_output=True, timeout=120)
            subprocess.run([*run_as, str(binaries / "pg_ctl"), "-D", str(data), "-w", "-t", "60", "-l",
                            str(self.folder / "log"), "-o", f"-k {socket_dir} -c listen_addresses='' -p 5433 "
                            "-c fsync=off", "start"], check=True, capture_output=True, timeout=120)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as error:
            detail = getattr(error, "stderr", b"") or b""
            return f"PostgreSQL did not start: {error} {detail.decode(errors='replace')[-300:]}"
        self._run_as, self._binaries = run_as, binaries
        self.url = f"postgresql+psycopg://rewind@/postgres?host={socket_dir}&port=5433"
        return None

    def fresh_database(self, name: str) -> str:
        """The URL of a new empty database `name` on this server."""
        import sqlalchemy as sa

        engine = sa.create_engine(self.url, isolation_level="AUTOCOMMIT")
        with engine.connect() as connection:
            connection.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}"')
            connection.exec_driver_sql(f'CREATE DATABASE "{name}"')
        engine.dispose()
        return self.url.replace("/postgres?", f"/{name}?")

    def stop(self) -> None:
        if self.folder is None:
            return
        if self.url:
            subprocess.run([*self._run_as, str(self._binaries / "pg_ctl"), "-D", str(self.folder / "data"), "-m",
                            "immediate", "stop"], capture_output=True, timeout=60)
        shutil.rmtree(self.folder, ignore_errors=True)
