"""Faults from outside: clients that go away, operations racing each other."""

import subprocess
import sys
from pathlib import Path

import gradio as gr
import pytest

from ui.directory import ChatDirectory
from ui.handlers import ChatHandlers
from ui.outputs import Settings


@pytest.fixture
def endless(models, monkeypatch):
    """The full tiny model with its end token off: a reply runs to its token limit."""
    monkeypatch.setattr(models["full"].generation_config, "eos_token_id", None)
    return models["full"]


def test_a_client_that_drops_its_stream_stops_the_reply_and_frees_the_conversation(make_engine, endless):
    engine = make_engine("full")
    handlers = ChatHandlers(engine, ChatDirectory(engine))
    settings = Settings(system_prompt="S.", max_new_tokens=400, temperature=0.0).values()
    stream = handlers.send(None, "Talk a lot.", None, *settings)
    outputs = [next(stream) for _ in range(3)]  # the message shown, then two streamed updates
    key = outputs[0].key  # the first update names the new conversation; streamed ones leave it
    stream.close()  # what Gradio does when the connection drops or the client cancels
    chat = handlers.directory.find(key)
    conv = chat.conversation
    assert not conv.is_busy
    assert conv.stats.stopped and conv.stats.generated_tokens < 400  # stopped, its partial reply kept
    assert [m["role"] for m in conv.messages] == ["system", "user", "assistant"]
    assert engine.batch_stats().decoding == 0 and handlers.directory.manager.stats().busy == 0
    short = Settings(system_prompt="S.", max_new_tokens=4, temperature=0.0).values()
    *_, last = handlers.send(None, "Next.", key, *short)
    assert [m["role"] for m in conv.messages] == ["system", "user", "assistant", "user", "assistant"]


def test_a_refused_first_message_or_prompt_change_keeps_everything(make_engine):
    engine = make_engine("full", context_limit=64)
    handlers = ChatHandlers(engine, ChatDirectory(engine))
    short = Settings(system_prompt="S.", max_new_tokens=4, temperature=0.0).values()
    with pytest.raises(gr.Error, match="too long for this model"):  # cannot fit: refused, nothing created
        list(handlers.send(None, "word " * 80, None, *short))
    assert len(handlers.directory.manager) == 0
    key = list(handlers.send(None, "Hello.", None, *short))[0].key
    for _ in handlers.send(None, "Hi again.", key, *short):
        pass
    conv = handlers.directory.find(key).conversation
    messages = conv.messages
    long_prompt = Settings(system_prompt="word " * 80, max_new_tokens=4, temperature=0.0).values()
    with pytest.raises(gr.Error, match="too long for this model"):
        list(handlers.send(None, "With a new system prompt.", key, *long_prompt))
    assert handlers.directory.find(key) is not None and conv.messages == messages  # the old one is kept
    assert len(handlers.directory.manager) == 1


EXIT_WHILE_STREAMING = """
import sys
sys.path[:0] = [{tests!r}, {root!r}]
from chat import ChatEngine
from chat.demo import build_tokenizer
from tiny_models import build_model
tokenizer = build_tokenizer()
tokenizer.chat_template = open({template!r}).read()
engine = ChatEngine(build_model("full", len(tokenizer), None), tokenizer)
stream = iter(engine.conversation("Be brief.").send("Talk for a long time.", max_new_tokens=1900,
                                                     do_sample=False))
next(stream)
print("streaming", flush=True)
"""


def test_a_process_that_exits_while_a_reply_streams_ends_cleanly():
    """A script that left a reply streaming aborted at exit ("terminate called
    without an active exception", status 134): the compute thread was still inside torch while
    the interpreter tore down. Now the scheduler stops its requests and the thread ends first."""
    tests = Path(__file__).parent
    script = EXIT_WHILE_STREAMING.format(tests=str(tests), root=str(tests.parent),
                                         template=str(tests / "fixtures" / "qwen3.jinja"))
    for _ in range(3):
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
        assert done.stdout.strip() == "streaming" and done.returncode == 0, (done.returncode, done.stderr[-2000:])
        assert "terminate called" not in done.stderr


def test_sends_at_once_from_one_address_keep_exactly_its_limit(make_engine, monkeypatch):
    """16 sends at once from one address kept 6 conversations under a limit of 4:
    each read the client's count before any had recorded its own. Here every open is held at a
    barrier until all 16 reach it (the interleaving the attack hit) or it times out (opens taken
    one at a time: only one ever gets there)."""
    import threading

    engine = make_engine("full")
    directory = ChatDirectory(engine, max_per_client=4)
    barrier, opened = threading.Barrier(16, timeout=2.0), []
    open_session = directory.manager.open

    def held_open(owner):
        try:
            barrier.wait()
        except threading.BrokenBarrierError:
            pass
        key = open_session(owner)
        opened.append(key)
        return key

    monkeypatch.setattr(directory.manager, "open", held_open)
    errors = []

    def send() -> None:
        try:
            directory.chat(None, "", client="203.0.113.7")
        except Exception as error:  # noqa: BLE001 (a refusal is allowed; a crash is counted)
            errors.append(error)

    threads = [threading.Thread(target=send) for _ in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors and len(opened) == 16
    kept = [key for key in opened if directory.find(key) is not None]
    assert len(kept) == 4 and len(directory.manager) == 4
    assert sorted(directory._keys_of_client["203.0.113.7"]) == sorted(kept)
