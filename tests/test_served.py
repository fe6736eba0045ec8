"""The same conversations with replies from a real OpenAI-compatible server
(`transformers serve` on the demo model, started once for this module on 127.0.0.1)."""

import os
import shutil
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from gradio_client.exceptions import AppError

from chat import ConversationError
from chat.demo import demo_folder
from chat.backends.served import ServedEngine, ServerError

SERVE = shutil.which("transformers")
GREEDY = dict(max_new_tokens=40, do_sample=False)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Serve:
    """`transformers serve` in a subprocess, which a test may kill and start again."""

    def __init__(self, model: str, log: Path):
        self.model, self.port, self.log = model, free_port(), log
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.process: subprocess.Popen | None = None

    def start(self, timeout_s: float = 120) -> None:
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_NO_ADVISORY_WARNINGS="1")
        self.process = subprocess.Popen([SERVE, "serve", "--host", "127.0.0.1", "--port", str(self.port), self.model],
                                        env=env, stdout=open(self.log, "a"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"transformers serve exited; see {self.log}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2):
                    return
            except OSError:
                time.sleep(0.3)
        raise TimeoutError("transformers serve did not start")

    def kill(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait(timeout=30)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if SERVE is None:
        pytest.fail("the transformers CLI is missing", pytrace=False)
    serve = Serve(str(demo_folder()), tmp_path_factory.mktemp("serve") / "serve.log")
    serve.start()
    yield serve
    serve.kill()


@pytest.fixture(scope="module")
def engine(server):
    return ServedEngine(server.url, server.model, timeout_s=30, max_retries=0)


def test_a_served_conversation_branches_like_a_local_one(engine):
    conv = engine.conversation("You are a helpful assistant.")
    list(conv.send("What is 47 + 38?", **GREEDY))
    first = conv.messages
    assert first[-1]["role"] == "assistant" and (first[-1]["content"] or first[-1]["reasoning_content"])
    stats = conv.stats
    assert stats.prompt_tokens > 10 and stats.generated_tokens > 0 and stats.ttft_s > 0
    # what the server said of its cache: `transformers serve` reports no cached_tokens
    assert stats.cache_reuse_known is False and stats.reused_tokens == 0

    list(conv.regenerate(max_new_tokens=40, do_sample=True, temperature=1.0, seed=1))
    assert conv.branches(2) == (1, 2)
    assert conv.switch_branch(2, 0) is False and conv.messages == first  # no local states: the server's cache
    list(conv.send("and plus 7?", **GREEDY))
    assert [m["content"] for m in conv.messages if m["role"] == "user"] == ["What is 47 + 38?", "and plus 7?"]
    # the server rendered the history (reasoning it split off included) exactly as this app would
    assert conv.stats.prompt_tokens == len(engine.template.render(conv.messages[:-1]).ids)
    assert not conv.messages[2]["reasoning_content"].startswith("\n") and conv.messages[2]["content"] == \
        conv.messages[2]["content"].lstrip()
    list(conv.edit(1, "What is 7 * 46?", **GREEDY))
    assert conv.branches(1) == (1, 2) and len(conv.messages) == 3
    conv.undo()
    assert [m["role"] for m in conv.messages] == ["system"]


def test_continue_through_chat_messages_is_refused_clearly_where_the_server_lacks_it(server):
    """`transformers serve` 5.23 refuses `continue_final_message` (422, by name): the app says so, the
    conversation stays as it was, and later Continues are refused before any request."""
    engine = ServedEngine(server.url, server.model, timeout_s=30, max_retries=0)
    conv = engine.conversation()
    list(conv.send("What is 47 + 38?", **GREEDY))
    if not conv.messages[-1]["content"]:  # a reply that stopped while thinking is refused for its own reason
        conv.edit_reply(len(conv.messages) - 1, "85")
    before = conv.to_dict()
    with pytest.raises(ServerError, match="cannot continue a reply through chat messages"):
        list(conv.continue_reply(**GREEDY))
    assert conv.to_dict() == before and "continue_final_message" in engine.runtime.refused_fields
    with pytest.raises(ConversationError, match="cannot continue a reply through chat messages"):
        conv.continue_reply(**GREEDY)  # refused at once, nothing sent
    assert conv.to_dict() == before


class WireRecorder:
    """What the app puts on the wire, answered by a fixed SSE stream: vLLM and SGLang cannot run
    here, so their side of Continue (rendering the messages with the model's template, the last
    one left open) is done below with the tokenizer, as vLLM's chat endpoint does it."""

    def __init__(self, *replies: str):
        self.replies, self.bodies = list(replies), []

    def __call__(self, request):
        import json

        import httpx

        self.bodies.append(json.loads(request.content))
        chunk = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m",
                 "choices": [{"index": 0, "delta": {"content": self.replies.pop(0)}, "finish_reason": None}]}
        stream = f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n"
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=stream.encode())


def wired_engine(base_tokenizer, folder: Path, template: str, *replies: str) -> tuple[ServedEngine, WireRecorder]:
    """A served engine on a tokenizer with `template`, whose requests a `WireRecorder` answers."""
    import httpx
    import openai

    from conftest import tokenizer_with_template

    tokenizer_with_template(base_tokenizer, template).save_pretrained(folder)
    engine = ServedEngine("http://wire.invalid/v1", "m", tokenizer=str(folder), max_retries=0)
    wire = WireRecorder(*replies)
    engine.runtime.client = openai.OpenAI(base_url="http://wire.invalid/v1", api_key="none", max_retries=0,
                                          http_client=httpx.Client(transport=httpx.MockTransport(wire)))
    return engine, wire


@pytest.mark.parametrize("template, reply", [("qwen3", "<think>\nadd them\n</think>\n\nIt is 85"),
                                             ("qwen2_5", "It is 85")])
def test_continue_through_chat_messages_sends_the_reply_so_far_left_open(base_tokenizer, tmp_path, template, reply):
    engine, wire = wired_engine(base_tokenizer, tmp_path, template, reply, ", since 47 + 38 = 85.")
    conv = engine.conversation("Be brief.")
    list(conv.send("What is 47 + 38?", max_new_tokens=16, do_sample=False))
    list(conv.continue_reply(max_new_tokens=16, do_sample=False))

    asked, continued = wire.bodies
    assert "continue_final_message" not in asked and continued["continue_final_message"] is True
    assert continued["add_generation_prompt"] is False
    tokenizer = engine.tokenizer
    prompt = tokenizer.apply_chat_template(asked["messages"], tokenize=False, add_generation_prompt=True,
                                           **asked.get("chat_template_kwargs", {}))
    rendered = tokenizer.apply_chat_template(continued["messages"], tokenize=False, add_generation_prompt=False,
                                             continue_final_message=True, **continued.get("chat_template_kwargs", {}))
    assert rendered == prompt + reply  # the server goes on from exactly what the model wrote
    assert conv.messages[-1]["content"] == "It is 85, since 47 + 38 = 85." and len(conv.messages) == 3


def test_a_message_being_typed_warms_the_servers_prefix_cache_with_the_sends_own_request(base_tokenizer, tmp_path):
    """Behind a model server, `prepare` sends the request the Send will make (same
    messages, salt and affinity, so a prefix-caching server keeps the prompt's blocks where the
    Send looks), for one token; nothing is recorded in the conversation."""
    engine, wire = wired_engine(base_tokenizer, tmp_path, "qwen2_5", "ignored", "It is 85")
    conv = engine.conversation("Be brief.")
    assert conv.prepare("What is 47 + 38?", max_new_tokens=16, do_sample=False)
    deadline = time.monotonic() + 60
    while engine.runtime.warmed < 1:
        assert time.monotonic() < deadline, "the warm-up request was not answered"
        time.sleep(0.01)
    assert len(conv.messages) == 1  # the system prompt only: a warm-up records nothing
    list(conv.send("What is 47 + 38?", max_new_tokens=16, do_sample=False))
    warm, sent = wire.bodies
    assert warm["max_tokens"] == 1 and sent["max_tokens"] == 16
    assert warm["messages"] == sent["messages"]
    assert (warm["cache_salt"], warm["user"]) == (sent["cache_salt"], sent["user"])
    assert conv.messages[-1]["content"] == "It is 85" and len(conv.messages) == 3


def test_a_conversations_warm_ups_start_at_most_every_warm_every_s(base_tokenizer, tmp_path):
    """The page asks at each keystroke; behind a model server that would be a request a
    keystroke. Asks within `WARM_EVERY_S` of a conversation's last warm-up start none."""
    from chat.backends import served

    engine, wire = wired_engine(base_tokenizer, tmp_path, "qwen2_5", "ignored", "ignored", "It is 85")
    conv = engine.conversation("Be brief.")
    text = "What is 47 + 38?"

    def warmed(count: int) -> None:
        deadline = time.monotonic() + 60
        while engine.runtime.warmed < count:
            assert time.monotonic() < deadline, "the warm-up request was not answered"
            time.sleep(0.01)

    for end in range(4, len(text) + 1, 4):  # typed on: four asks within the second
        conv.prepare(text[:end], max_new_tokens=16, do_sample=False)
    warmed(1)
    assert len(wire.bodies) == 1 and wire.bodies[0]["messages"][-1]["content"] == text[:4]
    conv.source._warmed_at -= served.WARM_EVERY_S  # (a made-up clock) that second has passed
    conv.prepare(text, max_new_tokens=16, do_sample=False)
    warmed(2)
    assert len(wire.bodies) == 2 and wire.bodies[1]["messages"][-1]["content"] == text


def test_warming_a_server_can_be_turned_off(base_tokenizer, tmp_path):
    from chat.backends import served

    engine, wire = wired_engine(base_tokenizer, tmp_path, "qwen2_5", "It is 85")
    engine.runtime.warm_while_typing = False
    conv = engine.conversation()
    conv.prepare("What is 47 + 38?", max_new_tokens=16)
    assert served._WARMING._value == served.MAX_WARMING  # no warm-up took a place (none started)
    list(conv.send("What is 47 + 38?", max_new_tokens=16, do_sample=False))
    assert len(wire.bodies) == 1 and engine.runtime.warmed == 0


def test_stop_closes_the_stream_and_keeps_the_partial_reply(engine):
    conv = engine.conversation()
    pieces = 0
    for _ in conv.send("What is 12 + 34?", max_new_tokens=200, do_sample=False):
        pieces += 1
        if pieces == 3:
            conv.stop()
    assert conv.stats.stopped and conv.history.last_reply().reply.stopped
    assert pieces <= 4  # nothing after the stop was read


def test_a_server_that_dies_mid_reply_leaves_the_conversation_as_it_was(server, engine):
    conv = engine.conversation()
    list(conv.send("What is 1 + 2?", **GREEDY))
    before = conv.to_dict()
    with pytest.raises(ServerError):
        for index, _ in enumerate(conv.send("What is 3 + 4?", max_new_tokens=400, do_sample=False)):
            if index == 2:
                server.kill()
    assert conv.to_dict() == before and not conv.is_busy
    with pytest.raises(ServerError, match="cannot be reached"):
        list(conv.send("Anyone there?", **GREEDY))
    assert conv.to_dict() == before
    server.start()  # back: the same conversation goes on
    list(conv.send("What is 5 + 6?", **GREEDY))
    assert [m["content"] for m in conv.messages if m["role"] == "user"] == ["What is 1 + 2?", "What is 5 + 6?"]


def test_the_app_talks_to_the_server(server, tmp_path):
    from gradio_client import Client

    from app_server import AppServer
    from ui.outputs import Settings

    app = AppServer("--backend", "openai", "--base-url", server.url, "--model", server.model,
                    log_path=tmp_path / "app.log")
    try:
        client = Client(app.url, verbose=False)
        values = Settings(max_new_tokens=40, temperature=0.0).values()
        result = client.predict("What is 47 + 38?", *values, api_name="/send")
        assert "What is 47 + 38?" in str(result[0]) and "did not say" in result[2]
        again = client.predict(*values, api_name="/regenerate")
        assert "2 / 2" in str(again[0])
        with pytest.raises(AppError):  # transformers serve takes no continue_final_message: refused
            client.predict(*values, api_name="/continue")
        assert "1 / 2" in str(client.predict(*values, api_name="/previous_version")[0])  # nothing changed
    finally:
        app.close()


def test_with_the_prompt_rendered_here_continue_works_and_the_prompt_is_the_local_one(server):
    from chat.dialogue.templates import ChatTemplate

    engine = ServedEngine(server.url, server.model, timeout_s=30, max_retries=0, prompt_format="text")
    conv = engine.conversation("You are a helpful assistant.")
    list(conv.send("What is 47 + 38?", max_new_tokens=8, do_sample=False))
    first = conv.messages[-1]
    assert conv.history.last_reply().reply.stopped is False
    template = ChatTemplate(engine.tokenizer)
    # the server was sent exactly what this app renders: its prompt count is that of the local ids
    assert conv.stats.prompt_tokens == len(template.render(conv.messages[:-1]).ids)
    list(conv.continue_reply(max_new_tokens=20, do_sample=False))
    after = conv.messages[-1]
    assert len(conv.messages) == 3  # the same turn, extended
    assert (after["reasoning_content"] + after["content"]).startswith(first["reasoning_content"])
    assert len(after["reasoning_content"] + after["content"]) > len(first["reasoning_content"] + first["content"])
    assert conv.branches(2) == (0, 1)

    ids = ServedEngine(server.url, server.model, timeout_s=30, max_retries=0, prompt_format="token-ids")
    with pytest.raises(ServerError, match="refused the request \\(400\\)"):  # transformers serve takes text only
        list(ids.conversation().send("Hi", max_new_tokens=4, do_sample=False))


def test_the_served_benchmark_reports_what_the_server_said(server, tmp_path):
    import json

    from benchmarks.multiturn import main as multiturn

    out = tmp_path / "served.json"
    multiturn(["--backend", "openai", "--base-url", server.url, "--model", server.model, "--turns", "2",
               "--max-new-tokens", "8", "--json", str(out)])
    result = json.loads(out.read_text())
    assert [row["turn"] for row in result["turns"]] == [1, 2]
    first, second = result["turns"]
    assert second["session"]["prompt_tokens"] > first["session"]["prompt_tokens"]  # the history grows
    assert second["session"]["prompt_tokens"] == second["naive"]["prompt_tokens"]  # the same prompt both ways
    assert result["server_reports_cached_tokens"] is False  # transformers serve 5.23: no cached_tokens
    assert "cache_salt" in result["server_refused_fields"]


@pytest.fixture(scope="module")
def endless_server(tmp_path_factory, base_tokenizer):
    """A tiny random model with no end token, served: a reply runs until it is stopped."""
    from tiny_models import save_endless_model

    folder = tmp_path_factory.mktemp("endless")
    save_endless_model(folder, base_tokenizer)
    serve = Serve(str(folder), tmp_path_factory.mktemp("serve") / "endless.log")
    serve.start()
    yield serve
    serve.kill()


def test_stop_ends_the_request_on_the_server(endless_server):
    """The server's own CPU time: busy while the reply streams, idle once Stop closed the stream
    (an uncancelled request would go on for thousands of tokens)."""
    import psutil

    server = psutil.Process(endless_server.process.pid)

    def cpu_seconds() -> float:
        times = server.cpu_times()
        return times.user + times.system

    conv = ServedEngine(endless_server.url, endless_server.model, timeout_s=30, max_retries=0).conversation()
    stream = conv.send("Go on forever.", max_new_tokens=8000, do_sample=False)
    next(stream)
    start, begun = cpu_seconds(), time.monotonic()
    for _ in stream:
        if time.monotonic() - begun > 1.0:
            break
    busy = (cpu_seconds() - start) / (time.monotonic() - begun)
    conv.stop()
    list(stream)
    assert conv.stats.stopped and conv.stats.generated_tokens < 8000

    def rate_over(seconds: float) -> float:  # the server's CPU use over a window (cores)
        start, begun = cpu_seconds(), time.monotonic()
        time.sleep(seconds)
        return (cpu_seconds() - start) / (time.monotonic() - begun)

    # it goes idle within 20 s (each window is a measurement, not a guess at how long that takes);
    # relative to its own busy rate, so a machine busy with other work does not change the verdict
    deadline = time.monotonic() + 20
    while (idle := rate_over(0.5)) >= max(0.05, busy / 4) and time.monotonic() < deadline:
        pass
    assert busy > 0.05 and idle < max(0.05, busy / 4), (busy, idle)


def test_a_reply_that_stopped_while_thinking_is_not_continued_through_chat_messages(base_tokenizer, tmp_path):
    """The template would close the thought before the server went on; the app says so, sends nothing."""
    engine, wire = wired_engine(base_tokenizer, tmp_path, "qwen3", "<think>\nadd the tens, then")
    conv = engine.conversation()
    list(conv.send("What is 47 + 38?", max_new_tokens=16, do_sample=False))
    assert conv.messages[-1]["content"] == "" and conv.messages[-1]["reasoning_content"]
    before = conv.to_dict()
    with pytest.raises(ConversationError, match="stopped while thinking"):
        conv.continue_reply(max_new_tokens=16, do_sample=False)
    assert len(wire.bodies) == 1 and conv.to_dict() == before
