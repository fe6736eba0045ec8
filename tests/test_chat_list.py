"""The browser's list of conversations (issue #8) through its handlers, without a server: what a
browser keeps, what comes back from it (untrusted), New chat, switching, export and import."""

import json
from pathlib import Path
import threading
import time

from ui.chat_list import MAX_TITLE_CHARS, ChatList, checked_store, empty_store
from ui.directory import ChatDirectory
from ui.handlers import ChatHandlers
from ui.outputs import ChatOutputs, Settings

GREEDY = Settings(system_prompt="Be brief.", max_new_tokens=6, temperature=0.0).values()
CHAT = ChatOutputs.names().index("chat")
KEY = ChatOutputs.names().index("key")
STORE, PARKED = len(ChatOutputs.names()), len(ChatOutputs.names()) + 1


def make_list(make_engine):
    engine = make_engine("full")
    handlers = ChatHandlers(engine, ChatDirectory(engine))
    return handlers, ChatList(handlers)


def send(handlers, text, key):
    keys = [out.key for out in handlers.send(None, text, key, *GREEDY) if isinstance(out.key, str)]
    return keys[0] if keys else key


def test_what_a_browser_sends_back_is_checked_and_the_bad_parts_left_out():
    for garbage in (None, 3, "x", [], {"chats": "no"}, {"chats": [1, None, {"id": "../etc"}]}):
        assert checked_store(garbage) == empty_store()
    good = {"id": "abcdefgh12", "title": "t" * 500, "data": {}}
    store = checked_store({"current": "zzzzzzzz99", "chats": [good, dict(good), {**good, "id": "short"}]})
    assert [c["id"] for c in store["chats"]] == ["abcdefgh12"]  # duplicate and malformed ids out
    assert len(store["chats"][0]["title"]) == MAX_TITLE_CHARS and store["current"] is None


def test_new_chat_keeps_the_old_one_and_switching_back_costs_no_prefill(make_engine):
    handlers, chat_list = make_list(make_engine)
    key = send(handlers, "First question?", None)
    store, _ = chat_list.sync(key, empty_store())
    assert [c["title"] for c in store["chats"]] == ["First question?"] and store["current"]
    first_id = store["current"]

    result = chat_list.new_chat(key, store, {})
    store, parked = result[STORE], result[PARKED]
    assert store["current"] is None and parked == {first_id: key} and len(store["chats"]) == 1
    other = send(handlers, "Second question?", None)
    store, _ = chat_list.sync(other, store)
    assert [c["title"] for c in store["chats"]] == ["Second question?", "First question?"]

    result = chat_list.open(first_id, other, store, {**parked})
    assert result[KEY] == key and result[STORE]["current"] == first_id  # the server still held it
    send(handlers, "And then?", key)
    stats = handlers.directory.find(key).conversation.stats
    assert stats.reused_tokens > 20 and not stats.rebuilt  # the history came from the kept cache


def test_a_reload_rebuilds_the_conversation_from_the_browsers_copy(make_engine):
    handlers, chat_list = make_list(make_engine)
    key = send(handlers, "First question?", None)
    send(handlers, "Second?", key)
    conversation = handlers.directory.find(key).conversation
    list(conversation.edit(1, "First, edited?", max_new_tokens=4, do_sample=False))
    store, _ = chat_list.sync(key, empty_store())
    store = json.loads(json.dumps(store))  # what the browser keeps
    handlers.directory.close(key)  # the server forgot it (restart, expiry)

    loaded = chat_list.load(store)
    users = [m["content"] for m in loaded[CHAT] if m["role"] == "user" and "branch-nav" not in m["content"]]
    assert users[0] == "First, edited?" and any("2 / 2" in m["content"] for m in loaded[CHAT])
    new_key = chat_list.ensure(None, None, store)
    restored = handlers.directory.find(new_key).conversation
    assert restored.to_dict() == conversation.to_dict() and restored.branches(1) == (1, 2)
    send(handlers, "Third?", new_key)
    assert restored.stats.rebuilt  # and the stats line says so


def test_new_chat_during_a_reply_stops_it_and_keeps_the_partial_reply(make_engine):
    handlers, chat_list = make_list(make_engine)
    key = send(handlers, "First?", None)
    store, _ = chat_list.sync(key, empty_store())
    long = Settings(system_prompt="Be brief.", max_new_tokens=400, temperature=0.0).values()
    outputs: list = []
    reader = threading.Thread(target=lambda: outputs.extend(handlers.send(None, "Write a lot.", key, *long)))
    reader.start()  # what Gradio's worker does with the stream
    deadline = time.monotonic() + 30
    while len(outputs) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    result = chat_list.new_chat(key, store, {})
    reader.join(timeout=30)
    kept = result[STORE]["chats"][0]["data"]
    last = kept["messages"][kept["path"][-1]]
    assert last["role"] == "assistant" and last["stopped"] is True and result[STORE]["current"] is None
    assert len(outputs) >= 3 and not handlers.directory.find(key).conversation.is_busy


def test_export_then_import_gives_the_same_conversation(make_engine, tmp_path):
    handlers, chat_list = make_list(make_engine)
    key = send(handlers, "First question?", None)
    list(handlers.directory.find(key).conversation.regenerate(max_new_tokens=4, do_sample=False))
    store, _ = chat_list.sync(key, empty_store())
    exported = chat_list.files.export("json", key, store)["value"]
    markdown = open(chat_list.files.export("markdown", key, store)["value"], encoding="utf-8").read()
    assert "## User" in markdown and "First question?" in markdown

    result = chat_list.import_file(None, exported, key, store, {})
    assert not Path(exported).exists()  # the uploaded file is deleted once read
    new_key = result[KEY]
    assert new_key != key and len(result[STORE]["chats"]) == 2
    imported = handlers.directory.find(new_key).conversation
    assert imported.to_dict() == handlers.directory.find(key).conversation.to_dict()

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "rewind-chat.conversation", "version": 1, "messages": [{"role": "tool"}]}))
    before = len(handlers.directory.manager)
    result = chat_list.import_file(None, str(bad), new_key, result[STORE], {})
    assert len(handlers.directory.manager) == before  # refused: nothing created


def test_delete_removes_it_from_the_list_and_the_server(make_engine):
    handlers, chat_list = make_list(make_engine)
    key = send(handlers, "Delete me?", None)
    store, _ = chat_list.sync(key, empty_store())
    result = chat_list.delete(key, store, {})
    assert result[STORE] == empty_store() and key not in handlers.directory.manager


def test_exports_come_from_checked_data_carry_the_name_and_do_not_pile_up(make_engine, monkeypatch):
    import gradio as gr

    import ui.chat_list

    handlers, chat_list = make_list(make_engine)
    warnings = []
    monkeypatch.setattr(gr, "Warning", lambda text: warnings.append(text))
    malformed = {"current": "abcdefgh12", "chats": [{"id": "abcdefgh12", "title": "t", "data": {
        "format": "rewind-chat.conversation", "version": 1, "messages": [["not", "a", "message"]]}}]}
    assert chat_list.files.export("json", None, malformed) == gr.skip()  # no server copy: the browser's, checked
    assert warnings and "cannot be exported" in warnings[-1] and "messages[0] must be an object" in warnings[-1]
    deep: list = []
    for _ in range(500):
        deep = [deep]
    assert checked_store({"chats": [{"id": "abcdefgh12", "title": "t", "data": {"x": deep}}]}) == empty_store()

    key = send(handlers, "Name me?", None)
    store, _ = chat_list.sync(key, empty_store())
    store, _ = chat_list.rename("My renamed chat", store)
    first = chat_list.files.export("markdown", key, store)["value"]
    assert first.endswith("My-renamed-chat.md") and open(first, encoding="utf-8").read().startswith("# My renamed chat")
    monkeypatch.setattr(ui.chat_list, "SWEEP_AFTER_S", -1.0)  # as if Gradio had long taken its copy
    second = chat_list.files.export("json", key, store)["value"]
    assert not Path(first).exists() and Path(second).exists()
