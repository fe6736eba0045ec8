"""The server store (chat/storage/store.py, chat/storage/shares.py), on SQLite always and on a real PostgreSQL
server started for these tests (skipped, with the reason, where it cannot start)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import uuid

import pytest
import sqlalchemy as sa

from chat.storage.shares import Shares
from chat.storage.store import Quotas, Records, StoreError, open_database
from postgres import PostgresServer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NASTY = "'); DROP TABLE records; -- <script>alert(1)</script> <img src=x onerror=alert(2)> \" \\ %s %%"


@pytest.fixture(scope="module")
def postgres():
    server = PostgresServer()
    reason = server.start()
    yield server, reason
    server.stop()


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'store.sqlite3'}"
    server, reason = request.getfixturevalue("postgres")
    if reason:
        pytest.skip(reason)
    return server.fresh_database("t" + uuid.uuid4().hex[:12])


@pytest.fixture
def engine(database_url):
    engine = open_database(database_url)
    yield engine
    engine.dispose()


def conversation(*texts: str) -> dict:
    messages, parent = [], None
    for i, text in enumerate(texts):
        role = "user" if i % 2 == 0 else "assistant"
        message = {"parent": parent, "role": role, "content": text, "shown": None}
        if role == "assistant":
            message |= {"reasoning_content": "", "stopped": False, "edited": False}
        if messages:
            messages[-1]["shown"] = 0
        messages.append(message)
        parent = i
    return {"format": "rewind-chat.conversation", "version": 1, "messages": messages, "shown": 0 if texts else None,
            "path": list(range(len(texts))), "system_prompt": None}


def record(chat_id: str, rev: int, *texts: str, title: str = "A chat") -> dict:
    return {"id": chat_id, "rev": rev, "title": title, "renamed": False, "data": conversation(*texts)}


def test_newer_revisions_replace_and_a_conflicting_one_is_kept_beside(engine):
    records = Records(engine)
    assert records.put("hf:a", record("chat-0001", 1, "hi")) .changed
    assert records.put("hf:a", record("chat-0001", 2, "hi", "hello")).id == "chat-0001"
    assert records.get("hf:a", "chat-0001")["data"] == conversation("hi", "hello")
    # a second device wrote revision 2 too, with another reply: both are kept, nothing is lost
    other = records.put("hf:a", record("chat-0001", 2, "hi", "hey there"))
    assert other.changed and other.id != "chat-0001"
    assert records.get("hf:a", "chat-0001")["data"] == conversation("hi", "hello")
    assert records.get("hf:a", other.id)["data"] == conversation("hi", "hey there")
    # the same write again changes nothing
    assert not records.put("hf:a", record("chat-0001", 2, "hi", "hello")).changed
    assert records.usage("hf:a")[0] == 2


def test_a_delete_removes_the_text_and_stays_deleted_against_late_writes(engine):
    records = Records(engine)
    records.put("hf:a", record("chat-0001", 3, "secret words"))
    records.delete("hf:a", "chat-0001", 2)  # the person deleted what they saw, an older revision
    assert records.get("hf:a", "chat-0001") is None
    assert records.listed("hf:a") == [{"id": "chat-0001", "rev": 4, "deleted": True}]
    with engine.connect() as connection:
        assert "secret words" not in json.dumps([list(row) for row in connection.execute(sa.text("select * from records"))])
    assert not records.put("hf:a", record("chat-0001", 4, "secret words")).changed  # a late write
    assert records.usage("hf:a") == (0, 0)
    assert records.put("hf:a", record("chat-0001", 5, "written again")).changed  # newer: the person went on
    assert records.usage("hf:a")[0] == 1


def test_accounts_never_see_each_others_records(engine):
    records = Records(engine)
    records.put("hf:a", record("chat-0001", 1, "A's words"))
    assert records.get("hf:b", "chat-0001") is None
    records.put("hf:b", record("chat-0001", 9, "B's words"))  # the same id, another account
    records.rename("hf:b", "chat-0001", 10, "B's")
    records.delete("hf:b", "chat-0001", 11)
    assert records.get("hf:a", "chat-0001")["data"] == conversation("A's words")
    assert [entry["id"] for entry in records.listed("hf:a")] == ["chat-0001"]
    assert [r["data"] for r in records.all("hf:a")] == [conversation("A's words")]


def test_sql_and_html_stay_text(engine):
    records = Records(engine)
    records.put("hf:a", record("chat-0001", 1, NASTY, NASTY, title=NASTY))
    records.rename("hf:a", "chat-0001", 2, NASTY + " renamed")
    stored = records.get("hf:a", "chat-0001")
    assert stored["title"] == NASTY + " renamed" and stored["data"] == conversation(NASTY, NASTY)
    shares = Shares(engine)
    share_id, _ = shares.create(owner=None, client="addr:1", title=NASTY, snapshot=conversation(NASTY))
    assert shares.get(share_id) ["title"] == NASTY
    assert records.usage("hf:a")[0] == 1  # the tables are all there


def test_quotas_refuse_clearly_and_change_nothing(engine):
    records = Records(engine, Quotas(max_chats=2, max_bytes=10_000))
    records.put("hf:a", record("chat-0001", 1, "one"))
    records.put("hf:a", record("chat-0002", 1, "two"))
    with pytest.raises(StoreError, match="at most 2 conversations"):
        records.put("hf:a", record("chat-0003", 1, "three"))
    assert records.get("hf:a", "chat-0003") is None and records.usage("hf:a")[0] == 2
    with pytest.raises(StoreError, match="at most 2 conversations"):  # a conflict's copy counts too
        records.put("hf:a", record("chat-0001", 1, "one, another device"))
    with pytest.raises(StoreError, match="MB of conversations"):
        records.put("hf:a", record("chat-0002", 2, "two", "x" * 20_000))
    assert records.get("hf:a", "chat-0002")["data"] == conversation("two")
    assert records.put("hf:a", record("chat-0002", 2, "two", "short")).changed  # within: written
    records.delete("hf:a", "chat-0001", 2)
    assert records.put("hf:a", record("chat-0003", 1, "three")).changed  # a delete made room
    assert records.put("hf:b", record("chat-0001", 1, "another account has its own")).changed


def test_twenty_clients_writing_at_once_lose_nothing(engine):
    records, errors = Records(engine), []

    def client(number: int) -> None:
        try:
            for rev in range(1, 6):  # its own conversation, revision by revision
                records.put("hf:a", record(f"own-{number:04d}", rev, *[f"client {number} turn {i}" for i in range(rev)]))
            # and everyone writes revision 1 of one shared conversation, each with its own words
            records.put("hf:a", record("shared-0000", 1, f"client {number} in the shared one"))
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=client, args=(number,)) for number in range(20)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors
    kept = list(records.all("hf:a"))
    for number in range(20):
        assert records.get("hf:a", f"own-{number:04d}")["rev"] == 5
    shared_words = sorted(r["data"]["messages"][0]["content"] for r in kept if r["id"].startswith("shared")
                          or r["data"]["messages"][0]["content"].endswith("shared one"))
    assert shared_words == sorted(f"client {number} in the shared one" for number in range(20))
    assert records.usage("hf:a")[0] == len(kept) == 40


KILLED_WRITER = """
import os, signal, sys, time
import sqlalchemy as sa
sys.path.insert(0, {root!r})
from chat.storage.store import Records, open_database
engine = open_database({url!r})
@sa.event.listens_for(engine, "commit")
def hold(connection):  # the write is made, not committed: say so, and wait to be killed
    print("written", flush=True)
    time.sleep(600)
Records(engine).put("hf:a", {record!r})
"""


def test_a_write_killed_half_way_leaves_the_previous_state(engine, database_url):
    records = Records(engine)
    records.put("hf:a", record("chat-0001", 1, "before"))
    script = KILLED_WRITER.format(root=ROOT, url=database_url, record=record("chat-0001", 2, "before", "half-way"))
    writer = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "written"
    finally:
        os.kill(writer.pid, signal.SIGKILL)
        writer.wait(30)
    engine.dispose()  # a fresh connection, after the writer's lock went with it
    fresh = Records(open_database(database_url))
    assert fresh.get("hf:a", "chat-0001")["data"] == conversation("before")
    assert fresh.put("hf:a", record("chat-0001", 2, "before", "after")).changed  # not left locked
    fresh.engine.dispose()


def test_a_share_is_reached_by_its_id_only_and_revoked_by_its_maker(engine):
    shares = Shares(engine)
    share_id, key = shares.create(owner="hf:a", client="hf:a", title="Sums", snapshot=conversation("1 + 1?", "2"))
    assert len(share_id) >= 22 and shares.get(share_id)["snapshot"] == conversation("1 + 1?", "2")
    assert shares.listed("hf:a") == [{"id": share_id, "title": "Sums", "created": pytest.approx(
        shares.get(share_id)["created"])}]
    assert shares.listed("hf:b") == []
    assert not shares.revoke(share_id, owner="hf:b")
    assert not shares.revoke(share_id, key="not-the-key")
    assert not shares.revoke(share_id)
    assert shares.get(share_id) is not None
    assert shares.revoke(share_id, owner="hf:a")
    assert shares.get(share_id) is None and not shares.revoke(share_id, owner="hf:a")
    anonymous, key = shares.create(owner=None, client="addr:9", title="Hi", snapshot=conversation("hi"))
    assert shares.revoke(anonymous, key=key) and shares.get(anonymous) is None
    for probe in ("", "x", "../etc/passwd", "' OR 1=1 --", share_id.upper()):
        assert shares.get(probe) is None


def test_anonymous_shares_are_bounded(engine):
    shares = Shares(engine, Quotas(max_shares=2, max_anonymous_share_bytes=2_000))
    for _ in range(2):
        shares.create(owner=None, client="addr:1", title="t", snapshot=conversation("hi"))
    with pytest.raises(StoreError, match="a day"):
        shares.create(owner=None, client="addr:1", title="t", snapshot=conversation("hi"))
    with pytest.raises(StoreError, match="no more links"):
        shares.create(owner=None, client="addr:2", title="t", snapshot=conversation("x" * 3_000))
    shares.create(owner="hf:a", client="hf:a", title="t", snapshot=conversation("x" * 3_000))  # accounts: by count


def test_a_signed_in_load_gets_only_its_own_accounts_records_it_lacks(engine):
    from ui.accounts import AccountCopy

    copy = AccountCopy(Records(engine))
    copy.keep("hf:a", record("chat-0001", 2, "A's first"))
    copy.keep("hf:a", record("chat-0002", 1, "A's second"))
    copy.keep("hf:a", {"id": "chat-0002", "rev": 2, "deleted": True})
    copy.keep("hf:b", record("chat-0009", 1, "B's"))
    copy.keep("hf:a", {"id": "chat-0001", "rev": 3, "title": "Renamed", "renamed": True})
    copy.keep(None, record("chat-0003", 1, "signed out: kept nowhere here"))
    copy.keep("hf:a", {**record("chat-0004", 1, "a draft"), "draft": True})  # drafts stay in the browser
    # whatever ids the browser says it has, only the account's own come back
    missing = copy.missing_from("hf:a", {"chat-0009": 0, "chat-0003": 0})
    assert [(r["id"], r["rev"], r.get("deleted", False)) for r in missing] == [("chat-0001", 3, False),
                                                                               ("chat-0002", 2, True)]
    assert missing[0]["title"] == "Renamed" and missing[0]["data"] == conversation("A's first")
    assert copy.missing_from("hf:a", {"chat-0001": 3, "chat-0002": 2}) == []
    assert [r["id"] for r in copy.missing_from("hf:b", {})] == ["chat-0009"]


def test_settings_changed_at_once_on_two_devices_both_stay(engine):
    from chat.storage.store import Preferences

    preferences = Preferences(engine)
    names = [f"setting_{i}" for i in range(20)]
    threads = [threading.Thread(target=preferences.update, args=("hf:a", {name: i}, dict))
               for i, name in enumerate(names)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert preferences.get("hf:a") == {name: i for i, name in enumerate(names)}
    with pytest.raises(ValueError):  # a check that refuses writes nothing
        preferences.update("hf:a", {"setting_0": -1}, lambda merged: (_ for _ in ()).throw(ValueError("no")))
    assert preferences.get("hf:a")["setting_0"] == 0 and preferences.get("hf:b") is None


def test_an_sqlite_store_is_its_owners_alone_from_the_first_write(tmp_path):
    """The store holds signed-in people's chats and the hashes of revoke keys: its folder is 0700
    and its files (the database, its -wal and -shm) 0600, whatever the umask, from the first write."""
    import stat

    from chat.storage.store import default_url

    old = os.umask(0o022)
    try:
        url = default_url({"XDG_DATA_HOME": str(tmp_path / "data")})
        folder = tmp_path / "data" / "rewind-chat"
        records = Records(open_database(url))
        records.put("hf:alice", record("chat-0001", 1, "secret"))
        files = [folder / name for name in ("rewind-chat.sqlite3", "rewind-chat.sqlite3-wal", "rewind-chat.sqlite3-shm")]
        assert all(file.exists() for file in files)
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
        assert {stat.S_IMODE(file.stat().st_mode) for file in files} == {0o600}
        elsewhere = tmp_path / "made" / "here.sqlite3"  # a path given: its new folder too
        Records(open_database(f"sqlite:///{elsewhere}")).put("hf:bob", record("chat-0002", 1, "mine"))
        assert stat.S_IMODE(elsewhere.parent.stat().st_mode) == 0o700
        assert stat.S_IMODE(elsewhere.stat().st_mode) == 0o600
        os.chmod(elsewhere, 0o644)  # an older store, found readable: narrowed as it opens
        open_database(f"sqlite:///{elsewhere}").dispose()
        assert stat.S_IMODE(elsewhere.stat().st_mode) == 0o600
    finally:
        os.umask(old)


def test_one_anonymous_client_cannot_take_every_clients_share_budget(engine):
    """One address shared 135 snapshots of 1.9 MB in 37 s (under its count) until the server-wide
    budget said no to everyone: now each address has its bytes a day, well under that budget."""
    shares = Shares(engine, Quotas(max_client_share_bytes=10_000, max_anonymous_share_bytes=100_000))
    big = conversation("x" * 4_000)
    for _ in range(2):
        shares.create(owner=None, client="addr:greedy", title="t", snapshot=big)
    with pytest.raises(StoreError, match="a day can be shared from one address"):
        shares.create(owner=None, client="addr:greedy", title="t", snapshot=big)
    for client in ("addr:2", "addr:3"):  # the others still share
        shares.create(owner=None, client=client, title="t", snapshot=big)


def test_anonymous_links_expire_and_their_bytes_come_back(engine, monkeypatch):
    import time as clock

    import chat.storage.shares

    shares = Shares(engine, Quotas(anonymous_share_days=30, max_anonymous_share_bytes=20_000))
    kept, _ = shares.create(owner="hf:a", client="hf:a", title="mine", snapshot=conversation("signed in"))
    old, _ = shares.create(owner=None, client="addr:1", title="old", snapshot=conversation("x" * 9_000))
    assert shares.get(old) is not None
    later = clock.time() + 31 * 86_400
    monkeypatch.setattr(chat.storage.shares.time, "time", lambda: later)
    assert shares.get(old) is None and shares.get(kept) is not None  # an account's link lasts
    shares.create(owner=None, client="addr:2", title="new", snapshot=conversation("y" * 9_000))
    shares.create(owner=None, client="addr:3", title="new", snapshot=conversation("z" * 9_000))  # the old one's room
    with engine.connect() as connection:
        assert connection.execute(sa.select(sa.func.count()).select_from(chat.storage.shares.SHARES)
                                  .where(chat.storage.shares.SHARES.c.id == old)).scalar_one() == 0


def test_how_long_an_anonymous_link_lasts_is_a_setting():
    from ui.config import AppConfig

    assert AppConfig.from_args([], environ={}).anonymous_share_days == 30
    assert AppConfig.from_args(["--anonymous-share-days", "7"], environ={}).anonymous_share_days == 7
    assert AppConfig.from_args([], environ={"ANONYMOUS_SHARE_DAYS": "2.5"}).anonymous_share_days == 2.5
