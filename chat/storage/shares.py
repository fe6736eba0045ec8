"""Shared snapshots: a read-only copy of the path a person had on screen, found by an unguessable id.

A snapshot is saved-format data (chat/dialogue/saved.py) of that one path, nothing else of its owner: a
link reaches it and only it. Whoever made it revokes it with the key given back at its making
(the browser keeps it); a signed-in owner also through their account. A revoked link is gone from
the store (it answers 404), not hidden. Shares made without signing in are bounded per client a
day, in count and in bytes, and last `Quotas.anonymous_share_days` (then they are gone, as if
revoked); the bound on all of them together is a backstop no one client reaches.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from chat.storage.store import SHARES, AccountLock, Quotas, StoreError

ANONYMOUS = "anonymous"  # the row anonymous shares lock while they are counted (no account is named so)
DAY_S = 86_400


def _hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def is_share_id(value: Any) -> bool:
    return isinstance(value, str) and 20 <= len(value) <= 64 and all(c.isalnum() or c in "-_" for c in value)


class Shares:
    def __init__(self, engine: Engine, quotas: Quotas = Quotas()) -> None:
        self.engine, self.quotas = engine, quotas

    def create(self, *, owner: str | None, client: str, title: str, snapshot: dict[str, Any]) -> tuple[str, str]:
        """Keep `snapshot`; returns (its id: 144 random bits, the key that revokes it)."""
        text = json.dumps(snapshot, ensure_ascii=False, separators=(",", ":"))
        share_id, key = secrets.token_urlsafe(18), secrets.token_urlsafe(24)
        with AccountLock(self.engine, owner or ANONYMOUS) as (connection, _):
            made = sa.select(sa.func.count()).select_from(SHARES)
            if owner is not None:
                count = connection.execute(made.where(SHARES.c.owner == owner)).scalar_one()
                if count >= self.quotas.max_shares:
                    raise StoreError(f"Your account keeps at most {self.quotas.max_shares} shared links: revoke "
                                     "some to make another.")
            else:
                self._anonymous_room(connection, client, len(text.encode()))
            connection.execute(SHARES.insert().values(id=share_id, owner=owner, key_hash=_hash(key), client=client,
                                                      title=title, snapshot=text, nbytes=len(text.encode()),
                                                      created=time.time()))
        return share_id, key

    def _anonymous_room(self, connection: sa.Connection, client: str, nbytes: int) -> None:
        """Raise unless `client` may share `nbytes` more without signing in (expired links gone first)."""
        quotas, now = self.quotas, time.time()
        connection.execute(SHARES.delete().where(self._expired(now)))
        summed = sa.select(sa.func.count(), sa.func.coalesce(sa.func.sum(SHARES.c.nbytes), 0)).select_from(SHARES)
        count, today = connection.execute(summed.where(SHARES.c.owner.is_(None), SHARES.c.client == client,
                                                       SHARES.c.created > now - DAY_S)).one()
        if count >= quotas.max_shares:
            raise StoreError(f"At most {quotas.max_shares} links a day can be shared from one address without "
                             "signing in.")
        if today + nbytes > quotas.max_client_share_bytes:
            raise StoreError(f"At most {quotas.max_client_share_bytes // 2**20} MB a day can be shared from one "
                             "address without signing in.")
        held = connection.execute(summed.where(SHARES.c.owner.is_(None))).one()[1]
        if held + nbytes > quotas.max_anonymous_share_bytes:
            raise StoreError("This server holds no more links shared without signing in; sign in to share.")

    def _expired(self, now: float) -> Any:
        return sa.and_(SHARES.c.owner.is_(None), SHARES.c.created < now - self.quotas.anonymous_share_days * DAY_S)

    def get(self, share_id: str) -> dict[str, Any] | None:
        """{"title", "snapshot", "created"}, or None (never made, revoked, or expired)."""
        if not is_share_id(share_id):
            return None
        with self.engine.connect() as connection:
            row = connection.execute(sa.select(SHARES.c.title, SHARES.c.snapshot, SHARES.c.created)
                                     .where(SHARES.c.id == share_id, sa.not_(self._expired(time.time())))).first()
        return None if row is None else {"title": row.title, "snapshot": json.loads(row.snapshot),
                                          "created": row.created}

    def listed(self, owner: str) -> list[dict[str, Any]]:
        with self.engine.connect() as connection:
            rows = connection.execute(sa.select(SHARES.c.id, SHARES.c.title, SHARES.c.created)
                                      .where(SHARES.c.owner == owner).order_by(SHARES.c.created.desc())).all()
        return [{"id": row.id, "title": row.title, "created": row.created} for row in rows]

    def revoke(self, share_id: str, *, owner: str | None = None, key: str | None = None) -> bool:
        """Delete the link if `owner` made it (signed in) or `key` is its key. Whether one went."""
        allowed = ([SHARES.c.owner == owner] if owner is not None else []) \
            + ([SHARES.c.key_hash == _hash(key)] if isinstance(key, str) else [])
        if not is_share_id(share_id) or not allowed:
            return False
        with self.engine.begin() as connection:
            return connection.execute(SHARES.delete().where(SHARES.c.id == share_id, sa.or_(*allowed))).rowcount == 1
