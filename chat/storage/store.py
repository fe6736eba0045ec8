"""The server's store of signed-in people's conversations, and of shared snapshots.

One database through SQLAlchemy Core: SQLite by default (a file; on a Hugging Face Space its
persistent disk, `/data`), or any SQLAlchemy URL (PostgreSQL when several replicas serve one
address). It holds the same records the browser keeps (ui/browser_copy.py), per account, and
merges them the same way: a write of a newer revision replaces the stored one; a write of an
older or equal revision whose conversation differs is kept beside it under a new id (two devices
wrote the same conversation: both are kept, nothing is lost); a tombstone removes the text and
keeps the id and revision, so other devices learn of the delete.

Every write is one transaction that first locks its account's row: writes of one account run one
after another (on every database), quotas are checked on counts kept in that row, and a write cut
off half-way (a killed process) leaves the previous state. Who an account is comes from the caller
(the OAuth session): nothing here takes an owner from a client.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from chat.errors import ChatError

METADATA = sa.MetaData()
ACCOUNTS = sa.Table(
    "accounts", METADATA,
    sa.Column("owner", sa.String(200), primary_key=True),
    sa.Column("chats", sa.Integer, nullable=False, default=0),  # live records
    sa.Column("nbytes", sa.BigInteger, nullable=False, default=0),  # their data's JSON bytes
)
RECORDS = sa.Table(
    "records", METADATA,
    sa.Column("owner", sa.String(200), primary_key=True),
    sa.Column("id", sa.String(40), primary_key=True),
    sa.Column("rev", sa.BigInteger, nullable=False),
    sa.Column("title", sa.Text, nullable=False, default=""),
    sa.Column("renamed", sa.Boolean, nullable=False, default=False),
    sa.Column("data", sa.Text, nullable=True),  # None: a tombstone (the text is gone)
    sa.Column("nbytes", sa.BigInteger, nullable=False, default=0),
    sa.Column("updated", sa.Float, nullable=False),
)
SHARES = sa.Table(
    "shares", METADATA,
    sa.Column("id", sa.String(64), primary_key=True),
    sa.Column("owner", sa.String(200), nullable=True, index=True),  # None: shared without signing in
    sa.Column("key_hash", sa.String(64), nullable=False),  # sha-256 of the key that revokes it
    sa.Column("client", sa.String(200), nullable=False, index=True),  # who made it (an address or an account)
    sa.Column("title", sa.Text, nullable=False),
    sa.Column("snapshot", sa.Text, nullable=False),
    sa.Column("nbytes", sa.BigInteger, nullable=False),
    sa.Column("created", sa.Float, nullable=False),
)
PREFERENCES = sa.Table(
    "preferences", METADATA,  # a signed-in person's settings (the panel's), as the app last checked them
    sa.Column("owner", sa.String(200), primary_key=True),
    sa.Column("settings", sa.Text, nullable=False),
    sa.Column("updated", sa.Float, nullable=False),
)
SIGNED_OUT = sa.Table(
    "signed_out", METADATA,  # sign-ins ended: their session cookies, replayed, sign no one in
    sa.Column("fingerprint", sa.String(64), primary_key=True),
    sa.Column("until", sa.Float, nullable=False),  # when the sign-in would have expired anyway
)


class StoreError(ChatError):
    """A write the store refused (a quota); nothing was changed."""


def default_url(environ: dict[str, str] | None = None) -> str:
    """SQLite on a Space's persistent disk when it has one, else in the user's data folder."""
    environ = os.environ if environ is None else environ
    if os.path.isdir("/data") and os.access("/data", os.W_OK):
        folder = Path("/data")
    else:
        folder = Path(environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share") / "rewind-chat"
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(folder, 0o700)  # the app's own folder: no other local user lists it
    return f"sqlite:///{folder / 'rewind-chat.sqlite3'}"


def keep_private(url: str) -> None:
    """An SQLite file store readable by its owner alone from its first write: a folder it makes
    0700, the database made 0600 before SQLite opens it (SQLite gives its `-wal` and `-shm`
    files the database's mode), and files found wider narrowed to 0600. (A PostgreSQL server
    keeps its own files: docs/deploy.md.)"""
    path = sa.engine.make_url(url).database if url.startswith("sqlite") else None
    if not path or path == ":memory:" or path.startswith("file:"):
        return
    database = Path(path)
    if not database.parent.exists():
        database.parent.mkdir(mode=0o700, parents=True)
    os.close(os.open(database, os.O_CREAT | os.O_WRONLY, 0o600))
    for file in (database, database.with_name(database.name + "-wal"), database.with_name(database.name + "-shm")):
        if file.exists() and file.stat().st_mode & 0o077:
            os.chmod(file, 0o600)


def open_database(url: str) -> Engine:
    """An engine on `url`, its tables made if missing. SQLite: WAL (readers never wait for a
    writer), every transaction `BEGIN IMMEDIATE` (a writer takes the lock first, so two never
    deadlock upgrading a read), a 30 s wait for the lock, synced on commit."""
    if url.startswith("sqlite"):
        keep_private(url)
        engine = sa.create_engine(url, connect_args={"timeout": 30, "check_same_thread": False})

        @sa.event.listens_for(engine, "connect")
        def _connected(dbapi_connection: Any, _record: Any) -> None:
            dbapi_connection.isolation_level = None  # transactions begin below, not in the driver
            for pragma in ("journal_mode=WAL", "synchronous=FULL", "busy_timeout=30000"):
                dbapi_connection.execute(f"PRAGMA {pragma}")

        @sa.event.listens_for(engine, "begin")
        def _begin(connection: Connection) -> None:
            connection.exec_driver_sql("BEGIN IMMEDIATE")
    else:
        engine = sa.create_engine(url, pool_pre_ping=True)
    METADATA.create_all(engine)
    return engine


@dataclass(frozen=True)
class Quotas:
    """What one account may keep; what shares may take."""

    max_chats: int = 500
    max_bytes: int = 256 * 2**20
    max_shares: int = 200  # per account, and per anonymous client a day
    max_client_share_bytes: int = 16 * 2**20  # what one anonymous client may share a day
    max_anonymous_share_bytes: int = 256 * 2**20  # all shares made without signing in: a backstop
    anonymous_share_days: float = 30.0  # how long a link shared without signing in lasts


@dataclass(frozen=True)
class Written:
    """What a write did: `id` is where the record now is (another id: kept as a copy beside a
    version another device wrote); `changed` is False when nothing needed writing."""

    id: str
    changed: bool


class Records:
    """Each account's records, merged as the browser merges them."""

    def __init__(self, engine: Engine, quotas: Quotas = Quotas()) -> None:
        self.engine, self.quotas = engine, quotas

    def put(self, owner: str, record: dict[str, Any]) -> Written:
        """Write a live record {"id", "rev", "title", "renamed", "data"} (`data` already checked)."""
        data = json.dumps(record["data"], ensure_ascii=False, separators=(",", ":"))
        with self._account(owner) as (connection, account):
            stored = self._row(connection, owner, record["id"])
            if stored is None or stored.rev < record["rev"]:
                self._write(connection, owner, record, data, stored)
                return self._checked(connection, owner, account, Written(record["id"], True))
            if stored.data is None or stored.data == data:  # deleted since, or the same
                return Written(record["id"], False)
            copy = {**record, "id": secrets.token_urlsafe(12), "rev": 1}
            self._write(connection, owner, copy, data, None)
            return self._checked(connection, owner, account, Written(copy["id"], True))

    def rename(self, owner: str, chat_id: str, rev: int, title: str) -> bool:
        with self._account(owner) as (connection, _):
            stored = self._row(connection, owner, chat_id)
            if stored is None or stored.data is None:
                return False
            connection.execute(RECORDS.update().where(*self._key(owner, chat_id)).values(
                title=title, renamed=True, rev=max(stored.rev, rev), updated=time.time()))
            return True

    def delete(self, owner: str, chat_id: str, rev: int) -> None:
        """A tombstone: the text goes; the id and a revision past what the person saw stay."""
        with self._account(owner) as (connection, account):
            stored = self._row(connection, owner, chat_id)
            if stored is not None and stored.data is None and stored.rev >= rev:
                return
            rev = rev if stored is None or stored.rev < rev else stored.rev + 1
            self._write(connection, owner, {"id": chat_id, "rev": rev, "title": "", "renamed": False}, None, stored)

    def listed(self, owner: str) -> list[dict[str, Any]]:
        """Every record of `owner` without its data (tombstones as {"id", "rev", "deleted"}), newest first."""
        with self.engine.connect() as connection:
            rows = connection.execute(sa.select(RECORDS.c.id, RECORDS.c.rev, RECORDS.c.title, RECORDS.c.renamed,
                                                RECORDS.c.updated, RECORDS.c.data.is_(None).label("deleted"))
                                      .where(RECORDS.c.owner == owner).order_by(RECORDS.c.updated.desc())).all()
        return [{"id": row.id, "rev": row.rev, "deleted": True} if row.deleted else
                {"id": row.id, "rev": row.rev, "title": row.title, "renamed": row.renamed, "updated": row.updated}
                for row in rows]

    def get(self, owner: str, chat_id: str) -> dict[str, Any] | None:
        with self.engine.connect() as connection:
            row = self._row(connection, owner, chat_id)
        return None if row is None or row.data is None else self._record(row)

    def all(self, owner: str) -> Iterator[dict[str, Any]]:
        """Every live record of `owner` with its data, newest first ("Export all")."""
        with self.engine.connect() as connection:
            for row in connection.execute(sa.select(RECORDS).where(RECORDS.c.owner == owner, RECORDS.c.data.is_not(None))
                                          .order_by(RECORDS.c.updated.desc())):
                yield self._record(row)

    def usage(self, owner: str) -> tuple[int, int]:
        """(live records, their bytes)."""
        with self.engine.connect() as connection:
            row = connection.execute(sa.select(ACCOUNTS).where(ACCOUNTS.c.owner == owner)).first()
        return (row.chats, row.nbytes) if row else (0, 0)

    @staticmethod
    def _record(row: Any) -> dict[str, Any]:
        return {"id": row.id, "rev": row.rev, "title": row.title, "renamed": row.renamed,
                "data": json.loads(row.data), "updated": row.updated}

    def _account(self, owner: str) -> "AccountLock":
        return AccountLock(self.engine, owner)

    @staticmethod
    def _key(owner: str, chat_id: str) -> tuple[Any, Any]:
        return RECORDS.c.owner == owner, RECORDS.c.id == chat_id

    def _row(self, connection: Connection, owner: str, chat_id: str) -> Any:
        return connection.execute(sa.select(RECORDS).where(*self._key(owner, chat_id))).first()

    def _write(self, connection: Connection, owner: str, record: dict[str, Any], data: str | None,
               stored: Any) -> None:
        """Insert or replace one record, and count what it adds to its account."""
        nbytes = 0 if data is None else len(data.encode())
        values = dict(rev=record["rev"], title=record["title"], renamed=record["renamed"], data=data, nbytes=nbytes,
                      updated=time.time())
        if stored is None:
            connection.execute(RECORDS.insert().values(owner=owner, id=record["id"], **values))
        else:
            connection.execute(RECORDS.update().where(*self._key(owner, record["id"])).values(**values))
        was_live = stored is not None and stored.data is not None
        connection.execute(ACCOUNTS.update().where(ACCOUNTS.c.owner == owner).values(
            chats=ACCOUNTS.c.chats + int(data is not None) - int(was_live),
            nbytes=ACCOUNTS.c.nbytes + nbytes - (stored.nbytes if was_live else 0)))

    def _checked(self, connection: Connection, owner: str, account: Any, written: Written) -> Written:
        """Refuse (the transaction rolls back) a write that took the account past a quota it was within."""
        chats, nbytes = connection.execute(sa.select(ACCOUNTS.c.chats, ACCOUNTS.c.nbytes)
                                           .where(ACCOUNTS.c.owner == owner)).one()
        if chats > max(self.quotas.max_chats, account.chats):
            raise StoreError(f"Your account keeps at most {self.quotas.max_chats} conversations: delete some "
                             "(or export them) to keep a new one on the server.")
        if nbytes > max(self.quotas.max_bytes, account.nbytes):
            raise StoreError(f"Your account keeps at most {self.quotas.max_bytes // 2**20} MB of conversations: "
                             "delete some (or export them) to keep this one on the server.")
        return written


class AccountLock:
    """A transaction holding `owner`'s row (made if missing): one account's writes in turn."""

    def __init__(self, engine: Engine, owner: str) -> None:
        self.engine, self.owner = engine, owner

    def __enter__(self) -> tuple[Connection, Any]:
        self._transaction = self.engine.begin()
        connection = self._transaction.__enter__()
        account = connection.execute(sa.select(ACCOUNTS).where(ACCOUNTS.c.owner == self.owner)
                                     .with_for_update()).first()
        if account is None:
            try:
                with connection.begin_nested():
                    connection.execute(ACCOUNTS.insert().values(owner=self.owner, chats=0, nbytes=0))
            except sa.exc.IntegrityError:  # another replica made it meanwhile
                pass
            account = connection.execute(sa.select(ACCOUNTS).where(ACCOUNTS.c.owner == self.owner)
                                         .with_for_update()).one()
        return connection, account

    def __exit__(self, *exc: Any) -> bool | None:
        return self._transaction.__exit__(*exc)


class Preferences:
    """Each account's settings: one small JSON object, the last one written wins."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def get(self, owner: str) -> dict[str, Any] | None:
        with self.engine.connect() as connection:
            text = connection.execute(sa.select(PREFERENCES.c.settings).where(PREFERENCES.c.owner == owner)).scalar()
        return None if text is None else json.loads(text)

    def update(self, owner: str, changes: dict[str, Any], check: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
        """Merge `changes` into what `owner` keeps, as one transaction (two settings changed at
        once, on two devices or in two requests, both stay). `check` gets the merged settings
        and returns what to keep, or raises (nothing is written)."""
        with AccountLock(self.engine, owner) as (connection, _):
            text = connection.execute(sa.select(PREFERENCES.c.settings).where(PREFERENCES.c.owner == owner)).scalar()
            merged = check({**(json.loads(text) if text is not None else {}), **changes})
            values = dict(settings=json.dumps(merged, ensure_ascii=False), updated=time.time())
            if text is None:
                connection.execute(PREFERENCES.insert().values(owner=owner, **values))
            else:
                connection.execute(PREFERENCES.update().where(PREFERENCES.c.owner == owner).values(**values))


class SignOuts:
    """Sign-ins that ended. A session cookie is signed, not stored: a copy of one taken before its
    person signed out would still verify. Its sign-in's fingerprint is kept here until it would
    have expired, and a session that carries it is treated as signed out (ui/accounts.py)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def end(self, fingerprint: str, until: float) -> None:
        with self.engine.begin() as connection:
            connection.execute(SIGNED_OUT.delete().where(SIGNED_OUT.c.until < time.time()))
            if connection.execute(sa.select(SIGNED_OUT.c.fingerprint)
                                  .where(SIGNED_OUT.c.fingerprint == fingerprint)).first() is None:
                connection.execute(SIGNED_OUT.insert().values(fingerprint=fingerprint, until=until))

    def ended(self, fingerprint: str) -> bool:
        with self.engine.connect() as connection:
            return connection.execute(sa.select(SIGNED_OUT.c.fingerprint)
                                      .where(SIGNED_OUT.c.fingerprint == fingerprint)).first() is not None
