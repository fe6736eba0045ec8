"""The browser's list of conversations through its handlers, without a server:
what the page is sent to keep, what comes back from it (untrusted), New chat, switching, a
reload, drafts of a streaming reply, export and import. How the browser merges records (two
tabs) is its script's, tested in a real browser (tests/test_browser.py)."""

import json
import tempfile
from pathlib import Path

import gradio as gr
import threading
import time

from chat.dialogue import saved
from ui import browser_copy
from ui.browser_copy import MAX_TITLE_CHARS, Book, checked_index, checked_probe, checked_record
from ui.chat_list import ChatList
from ui.directory import ChatDirectory
from ui.handlers import ChatHandlers
from ui.outputs import ChatOutputs, Settings
from ui.wiring import streamed

GREEDY = Settings(system_prompt="Be brief.", max_new_tokens=6, temperature=0.0).values()
CHAT = ChatOutputs.names().index("chat")
KEY = ChatOutputs.names().index("key")
OUTBOX, BOOK = len(ChatOutputs.names()), len(ChatOutputs.names()) + 1


class Browser:
    """What a page's storage holds, as the server told it (each record replaced by a newer one)."""

    def __init__(self):
        self.records: dict[str, dict] = {}
        self.current = None

    def apply(self, box):
        if isinstance(box, dict) and "records" in box:
            for record in box["records"]:
                stored = self.records.get(record["id"], {})
                if "reply" in record:  # the streaming reply so far, into its own draft
                    if stored.get("draft") and stored.get("rev") == record["rev"]:
                        self.reply_of(record["id"]).update(record["reply"])
                    continue
                self.records[record["id"]] = {**stored, **record}
            self.current = box["current"]

    def reply_of(self, chat_id):
        data = self.records[chat_id]["data"]
        return data["messages"][data["path"][-1]]

    def probe(self, **extra):
        record = self.records.get(self.current)
        return {"current": self.current, "rev": record["rev"] if record and not record.get("deleted") else None,
                **extra}


def make_list(make_engine):
    engine = make_engine("full")
    handlers = ChatHandlers(engine, ChatDirectory(engine))
    return handlers, ChatList(handlers)


def send(chat_list, browser, book, text, key, settings=GREEDY):
    """An event as the page runs it: ensure (and recover), the message, then sync."""
    key = event_key(chat_list, browser, book, key)
    keys = [out.key for out in chat_list.handlers.send(None, text, key, *settings) if isinstance(out.key, str)]
    key = keys[0] if keys else key
    outbox, *_ = chat_list.sync(key, book)
    browser.apply(outbox)
    return key


def event_key(chat_list, browser, book, key):
    book_out, need = chat_list.ensure(browser.probe(), key, book)
    assert book_out is book
    if need:
        record = browser.records[need["id"]]
        recovered, _ = chat_list.recover(None, record, key, book)
        return recovered if isinstance(recovered, str) else key
    return key


def test_what_a_browser_sends_back_is_checked_and_the_bad_parts_left_out():
    for garbage in (None, 3, "x", [], {"current": "../etc"}, {"rev": -1}, {"moved": [1]}, {"index": "no"}):
        probe = checked_probe(garbage)
        assert probe.current is None and probe.rev is None and probe.moved == {} and not probe.index
    deep: list = []
    for _ in range(500):
        deep = [deep]
    assert checked_probe({"current": "abcdefgh12", "record": {"id": "abcdefgh12", "data": {"x": deep}}}).current is None
    index = checked_index([["abcdefgh12", "t" * 500], ["abcdefgh12", "again"], ["short", "x"], "junk"])
    assert index == [("abcdefgh12", "t" * MAX_TITLE_CHARS)]  # duplicate and malformed ids out
    assert checked_record({"id": "abcdefgh12", "rev": 2, "data": {}, "deleted": True}) is None
    assert checked_record({"id": "abcdefgh12", "rev": True, "data": {}}) is None
    assert checked_record({"id": "abcdefgh12", "rev": 2, "title": 5, "data": {}})["title"] == ""


def test_only_what_changed_is_sent_and_new_chat_keeps_the_old_one_without_a_prefill(make_engine):
    handlers, chat_list = make_list(make_engine)
    browser, book = Browser(), Book()
    key = send(chat_list, browser, book, "First question?", None)
    first_id = browser.current
    assert [r["title"] for r in browser.records.values()] == ["First question?"]
    assert browser.records[first_id]["rev"] == 1
    assert chat_list.sync(key, book) == (gr.skip(),) * 4  # nothing changed since: nothing sent

    result = chat_list.new_chat(key, book)
    browser.apply(result[OUTBOX])
    assert browser.current is None and book.parked == {first_id: key} and len(browser.records) == 1
    other = send(chat_list, browser, book, "Second question?", None)
    assert [title for _, title in book.index] == ["Second question?", "First question?"]

    record = browser.records[first_id]
    result = chat_list.open(None, first_id, {"record": record}, other, book)
    browser.apply(result[OUTBOX])
    assert result[KEY] == key and browser.current == first_id  # the server still held it
    assert send(chat_list, browser, book, "And then?", key) == key
    stats = handlers.directory.find(key).conversation.stats
    assert stats.reused_tokens > 20 and not stats.rebuilt  # the history came from the kept cache
    assert browser.records[first_id]["rev"] == 2


def test_a_reload_rebuilds_the_conversation_from_the_browsers_record(make_engine):
    handlers, chat_list = make_list(make_engine)
    browser, book = Browser(), Book()
    key = send(chat_list, browser, book, "First question?", None)
    key = send(chat_list, browser, book, "Second?", key)
    conversation = handlers.directory.find(key).conversation
    list(conversation.edit(1, "First, edited?", max_new_tokens=4, do_sample=False))
    browser.apply(chat_list.sync(key, book)[0])
    browser.records = json.loads(json.dumps(browser.records))  # what the browser keeps
    handlers.directory.close(key)  # the server forgot it (restart, expiry)

    book = Book()  # a new page (a reload)
    loaded = chat_list.load(None, None, browser.probe(record=browser.records[browser.current],
                                          index=[[browser.current, "First question?"]]), book)
    users = [m["content"] for m in loaded[CHAT] if m["role"] == "user" and "branch-nav" not in m["content"]]
    assert users[0] == "First, edited?" and any("2 / 2" in m["content"] for m in loaded[CHAT])
    assert loaded[OUTBOX] == {"__type__": "update"}  # a load writes nothing
    new_key = event_key(chat_list, browser, book, None)
    restored = handlers.directory.find(new_key).conversation
    assert restored.to_dict() == conversation.to_dict() and restored.branches(1) == (1, 2)
    send(chat_list, browser, book, "Third?", new_key)
    assert restored.stats.rebuilt  # and the stats line says so


def test_a_record_another_tab_changed_replaces_the_servers_older_copy(make_engine):
    handlers, chat_list = make_list(make_engine)
    browser, book = Browser(), Book()
    key = send(chat_list, browser, book, "First question?", None)
    other_tab = handlers.engine.restore(browser.records[browser.current]["data"])
    list(other_tab.send("Asked in the other tab?", max_new_tokens=4, do_sample=False))
    browser.records[browser.current] = {**browser.records[browser.current], "rev": 2, "data": other_tab.to_dict()}
    new_key = event_key(chat_list, browser, book, key)
    assert new_key != key and key not in handlers.directory.manager  # the older copy is closed
    assert handlers.directory.find(new_key).conversation.to_dict() == other_tab.to_dict()
    assert book.revs[browser.current] == 2


def test_a_streaming_reply_is_copied_so_a_reload_keeps_the_message_and_the_text(make_engine):
    """The message is in the browser's copy before its reply streams (the whole record, once), and
    each update of the chat brings the draft's reply up to what is on screen (a draft
    written each second lost a reply shorter than that)."""
    handlers, chat_list = make_list(make_engine)
    browser, book = Browser(), Book()
    key = send(chat_list, browser, book, "First?", None)
    event_key(chat_list, browser, book, key)
    long = Settings(system_prompt="Be brief.", max_new_tokens=40, temperature=0.0).values()
    drafts, patches, on_screen = [], [], []
    for outputs in chat_list.copying_reply(streamed(handlers.send))(None, "Write a lot.", key, *long, key, book):
        if isinstance(outputs[-1], dict) and outputs[-1].get("records"):
            (drafts if "data" in outputs[-1]["records"][0] else patches).append(outputs[-1]["records"][0])
            browser.apply(outputs[-1])
            if patches and patches[-1] is outputs[-1]["records"][0]:  # the reply, as the chat shows it now
                last, kept = outputs[CHAT][-1], browser.reply_of(browser.current)
                on_screen.append((last["content"], kept["reasoning_content" if last.get("metadata") else "content"]))
    final = handlers.directory.find(key).conversation.to_dict()
    assert len(drafts) == 1 and drafts[0]["draft"] and drafts[0]["rev"] == 2 and drafts[0]["id"] == browser.current
    first = drafts[0]["data"]
    assert [first["messages"][i]["content"] for i in first["path"][:4]] == \
        [final["messages"][i]["content"] for i in final["path"][:4]]  # the message, before the reply streamed
    reply = final["messages"][final["path"][-1]]["content"]
    texts = [patch["reply"]["content"] for patch in patches]
    # how many updates there are is the machine's pace (a busy one hands several tokens at once)
    assert patches and all(p["draft"] and p["rev"] == 2 for p in patches)
    assert all(reply.startswith(text) for text in texts) and texts[-1]  # the reply so far, growing
    assert on_screen and all(kept == shown for shown, kept in on_screen)  # what was on screen
    assert handlers.directory.find(key).conversation.to_dict() == final  # drafting changed nothing


def test_a_message_typed_during_a_reply_never_rebuilds_it_from_its_own_draft(make_engine):
    """Enter pressed while a reply streamed sent the page's probe with the revision of
    that reply's own draft; the server took it for another tab's change, rebuilt the conversation
    from the draft and so stopped the reply (an empty "stopped" bubble, a "rebuilt" stats line).
    Now the page's own draft is known: the reply goes on and the message is refused as busy (the
    page holds it and sends it when the reply ends)."""
    import pytest

    handlers, chat_list = make_list(make_engine)
    browser, book = Browser(), Book()
    key = send(chat_list, browser, book, "First?", None)
    long = Settings(system_prompt="Be brief.", max_new_tokens=400, temperature=0.0).values()
    conversation = handlers.directory.find(key).conversation
    drafted, asked = threading.Event(), threading.Event()

    def stream():  # what Gradio's worker does with the event, and the page with its drafts
        for outputs in chat_list.copying_reply(streamed(handlers.send))(None, "Write a lot.", key, *long, key, book):
            if isinstance(outputs[-1], dict) and outputs[-1].get("records"):
                browser.apply(outputs[-1])
                if browser.reply_of(browser.current)["content"]:  # some of the reply is drafted
                    drafted.set()
                    asked.wait(30)

    reader = threading.Thread(target=stream)
    reader.start()
    assert drafted.wait(30)
    assert browser.records[browser.current]["draft"]  # the browser holds this page's draft
    typed_ahead = chat_list.ensure(browser.probe(), key, book)
    with pytest.raises(gr.Error, match="still being generated"):
        list(handlers.send(None, "Typed ahead?", key, *long))
    still_running = conversation.is_running and handlers.directory.find(key) is not None
    conversation.stop()
    asked.set()
    reader.join(timeout=30)
    assert typed_ahead == (book, None) and still_running
    reply = conversation.messages[-1]
    assert reply["role"] == "assistant" and reply["content"] and not conversation.stats.rebuilt
    assert [m["content"] for m in conversation.messages if m["role"] == "user"] == ["First?", "Write a lot."]


def test_new_chat_during_a_reply_stops_it_and_keeps_the_partial_reply(make_engine):
    handlers, chat_list = make_list(make_engine)
    browser, book = Browser(), Book()
    key = send(chat_list, browser, book, "First?", None)
    long = Settings(system_prompt="Be brief.", max_new_tokens=400, temperature=0.0).values()
    outputs: list = []
    reader = threading.Thread(target=lambda: outputs.extend(handlers.send(None, "Write a lot.", key, *long)))
    reader.start()  # what Gradio's worker does with the stream
    deadline = time.monotonic() + 30
    while len(outputs) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    result = chat_list.new_chat(key, book)
    reader.join(timeout=30)
    kept = result[OUTBOX]["records"][0]["data"]
    last = kept["messages"][kept["path"][-1]]
    assert last["role"] == "assistant" and last["stopped"] is True and result[OUTBOX]["current"] is None
    assert len(outputs) >= 3 and not handlers.directory.find(key).conversation.is_busy
    # Gradio repeats a stream's last update when it ends, maybe after New chat's view: it changes nothing
    assert all(value == gr.skip() for value in outputs[-1].to_gradio())


def test_export_then_import_gives_the_same_conversation_and_its_name(make_engine, tmp_path):
    handlers, chat_list = make_list(make_engine)
    browser, book = Browser(), Book()
    key = send(chat_list, browser, book, "First question?", None)
    list(handlers.directory.find(key).conversation.regenerate(max_new_tokens=4, do_sample=False))
    browser.apply(chat_list.rename("My renamed chat", book)[0])
    assert browser.records[browser.current]["title"] == "My renamed chat" and "data" in browser.records[browser.current]
    exported = chat_list.files.export("json", key, book)  # the page downloads it at once, by this name
    assert exported["name"] == "My-renamed-chat.json" and exported["type"] == "application/json"
    assert json.loads(exported["text"])["title"] == "My renamed chat"
    markdown = chat_list.files.export("markdown", key, book)
    assert markdown["name"] == "My-renamed-chat.md" and markdown["type"] == "text/markdown"
    assert markdown["text"].startswith("# My renamed chat") and "## User" in markdown["text"]
    assert "First question?" in markdown["text"]

    result = chat_list.import_text(None, exported["text"], key, book)  # what the page read of the file
    browser.apply(result[OUTBOX])
    new_key = result[KEY]
    assert new_key != key and len(browser.records) == 2
    assert browser.records[browser.current]["title"] == "My renamed chat"  # the name came with the file
    imported = handlers.directory.find(new_key).conversation
    assert imported.to_dict() == handlers.directory.find(key).conversation.to_dict()

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "rewind-chat.conversation", "version": 1, "messages": [{"role": "tool"}]}))
    before = len(handlers.directory.manager)
    chat_list.import_text(None, bad.read_text(), new_key, book)
    assert len(handlers.directory.manager) == before  # refused: nothing created
    # a path is not text: nothing is opened, nothing deleted (whatever file of
    # Gradio's upload folder the event names)
    someone_elses = tmp_path / "someone-elses-upload.json"
    someone_elses.write_text(exported["text"])
    for sent in (str(someone_elses), {"path": str(someone_elses)}, None, "x" * (saved.MAX_JSON_BYTES + 1)):
        chat_list.import_text(None, sent, new_key, book)
        assert len(handlers.directory.manager) == before
    assert someone_elses.exists()


def test_delete_leaves_a_tombstone_and_frees_the_server(make_engine):
    handlers, chat_list = make_list(make_engine)
    browser, book = Browser(), Book()
    key = send(chat_list, browser, book, "Delete me?", None)
    chat_id = browser.current
    result = chat_list.delete(key, book)
    browser.apply(result[OUTBOX])
    assert browser.records[chat_id]["deleted"] and browser.records[chat_id]["rev"] == 2
    assert browser.current is None and book.index == [] and key not in handlers.directory.manager


def test_an_export_is_the_shown_conversations_and_leaves_nothing_behind(make_engine, monkeypatch, tmp_path):
    """The file goes to the page with the event, for the browser to download at
    once; nothing is written to disk, so nothing of one conversation can be offered for another."""
    handlers, chat_list = make_list(make_engine)
    warnings = []
    monkeypatch.setattr(gr, "Warning", lambda text: warnings.append(text))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert chat_list.files.export("json", None, Book()) == gr.skip()
    assert warnings and "no conversation to export" in warnings[-1]
    browser, book = Browser(), Book()
    first = send(chat_list, browser, book, "Name me?", None)
    assert chat_list.files.export("markdown", first, book)["name"] == "Name-me.md"
    browser.apply(chat_list.new_chat(first, book)[OUTBOX])
    second = send(chat_list, browser, book, "Another one?", None)
    exported = chat_list.files.export("markdown", second, book)
    assert exported["name"] == "Another-one.md"
    assert "Another one?" in exported["text"] and "Name me?" not in exported["text"]
    assert not list(tmp_path.iterdir())


def test_a_record_for_another_id_or_a_broken_one_changes_nothing(make_engine, monkeypatch):
    handlers, chat_list = make_list(make_engine)
    warnings = []
    monkeypatch.setattr(gr, "Warning", lambda text: warnings.append(text))
    browser, book = Browser(), Book()
    key = send(chat_list, browser, book, "Mine?", None)
    mine = dict(browser.records[browser.current])
    handlers.directory.close(key)
    wrong = {**mine, "id": browser_copy.new_id()}
    assert chat_list.recover(None, wrong, None, book) == (gr.skip(), gr.skip())  # not the shown one
    broken = {**mine, "data": {"format": "rewind-chat.conversation", "version": 1, "messages": [["x"]]}}
    before = len(handlers.directory.manager)
    assert chat_list.recover(None, broken, None, book) == (gr.skip(), gr.skip())
    assert len(handlers.directory.manager) == before and "could not be opened" in warnings[-1]


def test_a_snapshot_mid_reply_is_the_conversation_as_a_stop_there_leaves_it(make_engine):
    """`Conversation.snapshot()` (what drafts carry), for a new reply and for a Continue: the
    shown path with the reply so far, marked stopped; the tree itself is untouched meanwhile."""
    engine = make_engine("full")
    conversation = engine.conversation("Be brief.")
    list(conversation.send("First?", max_new_tokens=3, do_sample=False))
    for start, new_messages in ((lambda: conversation.send("Second?", max_new_tokens=30, do_sample=False), 2),
                                (lambda: conversation.continue_reply(max_new_tokens=30, do_sample=False), 0)):
        before = conversation.to_dict()
        stream = iter(start())
        for _ in range(4):
            next(stream)
        snapshot = conversation.snapshot()
        assert conversation.to_dict() == before  # nothing recorded yet
        list(stream)
        final = conversation.to_dict()
        shown = [snapshot["messages"][i] for i in snapshot["path"]]
        assert [m["content"] for m in shown[:-1]] == [final["messages"][i]["content"] for i in final["path"][:-1]]
        assert shown[-1]["stopped"] and final["messages"][final["path"][-1]]["content"].startswith(shown[-1]["content"])
        assert len(snapshot["path"]) == len(before["path"]) + new_messages
        if not new_messages:  # a Continue: the earlier reply, longer
            assert shown[-1]["content"].startswith(before["messages"][before["path"][-1]]["content"])


def test_a_reply_stopped_before_its_first_word_says_stopped_at_once(make_engine):
    """A reply stopped before any text was an empty bubble until a reload. Stop comes
    right after the message is shown, before the stream's first step: the reply ends at once
    (a stop at that moment was once cleared as the stream began) and the last view says so."""
    handlers, _ = make_list(make_engine)
    long = Settings(system_prompt="Be brief.", max_new_tokens=400, temperature=0.0).values()
    stream = handlers.send(None, "Write a lot.", None, *long)
    shown = next(stream)  # the message, before the reply
    handlers.stop(shown.key)
    outputs = list(stream)
    chat = handlers.directory.find(shown.key)
    reply = chat.conversation.history.entries[-1].reply
    assert reply.stopped and chat.conversation.stats.generated_tokens <= 2
    assert outputs[-1].chat[-1]["role"] == "assistant" and "stopped" in outputs[-1].chat[-1]["content"]


def test_a_snapshot_as_a_reply_is_recorded_shows_it_once(make_engine, monkeypatch):
    """`snapshot()` took no lock, and a reply is recorded before its run ends; a
    snapshot in between recorded it again on its copy (2 replies where there is 1), and the
    page's draft kept a spurious version. Forced: a snapshot is asked for from another thread
    right after the reply is recorded."""
    from chat.dialogue.history import History

    engine = make_engine("full")
    conversation = engine.conversation("Be brief.")
    record, snapshots = History.record_reply, []

    def recorded_then_snapshot(self, *args):
        node = record(self, *args)
        other = threading.Thread(target=lambda: snapshots.append(conversation.snapshot()))
        other.start()
        other.join(0.5)  # the old code finished here; now it waits for the run to end
        snapshots.append(other)
        return node

    monkeypatch.setattr(History, "record_reply", recorded_then_snapshot)
    list(conversation.send("First?", max_new_tokens=3, do_sample=False))
    other = next(s for s in snapshots if isinstance(s, threading.Thread))
    other.join(60)
    snapshot = next(s for s in snapshots if isinstance(s, dict))
    assert [m["role"] for m in snapshot["messages"]] == ["system", "user", "assistant"]
    assert snapshot == conversation.to_dict()


SYSTEM_PROMPT = ChatOutputs.names().index("system_prompt")
APPLIED = ChatOutputs.names().index("applied_prompt")


def test_an_import_brings_its_own_system_prompt_into_the_box(make_engine, tmp_path):
    """The box kept the page's prompt, so the next message forked the imported
    conversation onto a new system-prompt branch and its history left the view."""
    handlers, chat_list = make_list(make_engine)
    browser, book = Browser(), Book()
    key = send(chat_list, browser, book, "First question?", None)  # with "Be brief."
    exported = chat_list.files.export("json", key, book)["text"]
    result = chat_list.import_text(None, exported, None, Book())
    assert result[SYSTEM_PROMPT] == "Be brief." and result[APPLIED] == {"prompt": "Be brief."}


def test_a_reload_keeps_a_system_prompt_typed_and_not_yet_applied(make_engine):
    """The load drew the record's prompt over the one typed before the reload."""
    handlers, chat_list = make_list(make_engine)
    browser, book = Browser(), Book()
    send(chat_list, browser, book, "First question?", None)
    record = browser.records[browser.current]
    for pending, shown in (({"id": browser.current, "text": "Be terse."}, "Be terse."),
                           ({"id": "another-record-id", "text": "Be terse."}, "Be brief."),  # another chat's
                           ({"id": browser.current, "text": "x" * 10_000}, "Be brief."),  # over the limit
                           (None, "Be brief.")):
        loaded = chat_list.load(None, None, browser.probe(record=record, index=[[browser.current, "First question?"]],
                                              pending=pending), Book())
        assert loaded[SYSTEM_PROMPT] == shown and loaded[APPLIED] == {"prompt": "Be brief."}


def test_the_chats_trash_button_starts_a_new_chat_and_says_so(make_engine):
    """It blanked the view only; the next message went on with the old conversation."""
    from ui import views

    handlers, chat_list = make_list(make_engine)
    browser, book = Browser(), Book()
    key = send(chat_list, browser, book, "First question?", None)
    old_id = browser.current
    cleared = chat_list.clear(key, book)
    browser.apply(cleared[OUTBOX])
    assert cleared[CHAT] == [] and cleared[KEY] is None and cleared[ChatOutputs.names().index("stats")] == views.CLEARED
    assert browser.current is None and book.current is None
    assert cleared[OUTBOX + 2]["value"] is None and [entry for entry, _ in book.index] == [old_id]  # kept, not shown
    new_key = send(chat_list, browser, book, "A new start?", None)
    assert new_key != key and browser.current != old_id
    users = [m["content"] for m in handlers.directory.find(new_key).conversation.messages if m["role"] == "user"]
    assert users == ["A new start?"]


def test_titles_several_chats_share_are_numbered_from_the_oldest():
    """An import twice gave two "Pirate chat"; six "What is 33 + 44?" in a row."""
    from ui.chat_list import distinct_titles

    index = [("d", "Sum"), ("c", "Pirate chat"), ("b", "Sum"), ("a", "Sum"), ("e", "Pirate chat")]  # newest first
    assert distinct_titles(index) == ["Sum (3)", "Pirate chat (2)", "Sum (2)", "Sum", "Pirate chat"]
    assert distinct_titles(index[1:]) == distinct_titles(index)[1:]  # an older label stays as a newer one comes
