"""End to end through `gradio_client` against a launched app on the demo model."""

import html
import re
import threading

import pytest
import torch
from gradio_client import Client
from gradio_client.exceptions import AppError

from app_server import AppServer
from chat.config import DEFAULT_PREFILL_CHUNK
from ui.outputs import Settings

SYSTEM = "You are a helpful assistant."


def settings(max_new_tokens=12, temperature=0.0, thinking=True, system_prompt=SYSTEM):
    return Settings(system_prompt=system_prompt, thinking=thinking, max_new_tokens=max_new_tokens,
                    temperature=temperature).values()


def reply_text(chat) -> str:
    """The last reply's shown text: its thinking message and its answer, joined."""
    shown = texts(chat)
    last_user = max(i for i, (role, _) in enumerate(shown) if role == "user")
    return "".join(text for _, text in shown[last_user + 1:])


def texts(chat) -> list[tuple[str, str]]:
    """(role, text) of each shown message, without the note under a reply (stopped, edited) and
    without the controls shown under messages ("‹ 2 / 3 ›", ↻)."""
    shown = [(m["role"], "".join(p["text"] for p in m["content"] if p.get("type") == "text")) for m in chat]
    # a person's message is shown as typed: its Markdown and HTML characters as references (ui/views.py)
    return [(role, html.unescape(text) if role == "user" else re.sub(r"\n*<sub[^>]*>[^<]*</sub>$", "", text))
            for role, text in shown
            if not text.startswith('<div class="branch-nav"')]


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    server = AppServer(log_path=tmp_path_factory.mktemp("logs") / "app.log")
    yield server
    server.close()


@pytest.fixture
def client(app):
    return Client(app.url, verbose=False)


def test_send_streams_and_every_button_works(client):
    # a reply long enough to span several 40 ms updates (12 tokens of the demo take about 35 ms)
    job = client.submit("Hello there!", *settings(max_new_tokens=64), api_name="/send")
    outputs = job.outputs()
    final = job.result()
    assert len(outputs) > 3  # streamed: several updates, not one
    chat = texts(final[0])
    assert chat[0] == ("user", "Hello there!") and chat[1][0] == "assistant" and chat[1][1]
    # the message box: its placeholder says a reply runs; its text is the page's to empty (it
    # empties it only if it still holds what was sent: a message typed meanwhile stays)
    box = outputs[0][1]
    assert "from the cache" in final[2] and isinstance(box, dict) and "value" not in box
    assert "when this reply ends" in box.get("placeholder", "")
    first_reply = chat[-1][1]  # its last message shown (the answer, after its thinking)

    regenerated = client.predict(*settings(temperature=1.5), api_name="/regenerate")
    assert "2 / 2" in regenerated[3]
    assert "**0 computed**" in regenerated[2]  # regenerate: the whole prompt and the logits after it kept
    back = client.predict(*settings(), api_name="/previous_version")
    assert texts(back[0])[-1][1] == first_reply and "without running the model" in back[2]
    forward = client.predict(*settings(), api_name="/next_version")
    assert texts(forward[0])[-1][1] == texts(regenerated[0])[-1][1]

    continued = client.predict(*settings(), api_name="/continue")
    assert reply_text(continued[0]).startswith(reply_text(forward[0]))  # thinking and answer, extended
    assert "**1 computed**" in continued[2]

    client.predict("Second question?", *settings(), api_name="/send")
    undone = client.predict(*settings(), api_name="/undo")
    assert [role for role, _ in texts(undone[0])].count("user") == 1 and undone[1] == "Second question?"

    edited = client.predict(1, "Hello, edited!", *settings(), api_name="/edit")  # index 1: after the system prompt
    assert texts(edited[0])[0] == ("user", "Hello, edited!")
    assert [role for role, _ in texts(edited[0])].count("user") == 1

    cleared = client.predict(*settings(), api_name="/clear")
    assert cleared[0] == []


def test_changing_the_system_prompt_starts_a_new_branch_and_keeps_the_old_one(client):
    client.predict("Under the first system prompt.", *settings(), api_name="/send")
    other = settings(system_prompt="You are a pirate.")
    result = client.predict("Under the second one.", *other, api_name="/send")
    assert [text for role, text in texts(result[0]) if role == "user"] == ["Under the second one."]
    count = int(re.search(r"\d+ / (\d+)", "".join(p["text"] for p in result[0][0]["content"]))[1])
    back = client.predict("0:" + str(count - 2), *other, api_name="/switch_branch")  # the branch before
    assert [text for role, text in texts(back[0]) if role == "user"][-1] == "Under the first system prompt."
    assert back[-2] == SYSTEM  # the settings show that branch's system prompt
    assert back[-1] == {"prompt": SYSTEM}  # and it is the one that branch runs with


@pytest.fixture(scope="module")
def endless_app(tmp_path_factory, base_tokenizer):
    """A tiny model with its end token off: a reply runs until it is stopped (or its limit)."""
    from tiny_models import save_endless_model

    folder = tmp_path_factory.mktemp("endless-model")
    save_endless_model(folder, base_tokenizer)
    server = AppServer("--model", str(folder), log_path=tmp_path_factory.mktemp("logs") / "endless.log")
    yield server
    server.close()


def test_stop_keeps_the_partial_reply(endless_app):
    """(On a model that cannot end its reply: the demo's story sometimes ended, 43 tokens, before
    the Stop arrived, on a quiet machine.)"""
    import time

    client = Client(endless_app.url, verbose=False)
    job = client.submit("Write a very long story.", *settings(max_new_tokens=512), api_name="/send")
    deadline = time.monotonic() + 60
    while len(job.outputs()) < 3 and not job.done() and time.monotonic() < deadline:
        time.sleep(0.05)
    client.predict(api_name="/stop")
    final = job.result()
    assert "stopped" in final[2]
    reply = texts(final[0])[-1]
    assert reply[0] == "assistant"
    after = client.predict("Next one.", *settings(), api_name="/send")  # the conversation goes on
    assert [text for role, text in texts(after[0]) if role == "user"] == ["Write a very long story.", "Next one."]


def test_refusals_are_errors_a_client_can_catch_and_change_nothing(client):
    """A refusal is an error for an API client (before, `predict` returned normally
    with only a toast for a page), with its reason, and the conversation is as it was."""
    for api_name, reason in (("/regenerate", "no conversation yet"), ("/continue", "no conversation yet"),
                             ("/undo", "nothing to undo")):
        with pytest.raises(AppError, match=reason):
            client.predict(*settings(), api_name=api_name)
    first = client.predict("A question.", *settings(), api_name="/send")[0]
    for args, api_name, reason in ((("   ",), "/send", "empty"),
                                   ((0, "edit the system prompt?"), "/edit", "not a user message"),
                                   (("x " * 5000,), "/send", "too long for this model by about"), ((), "/next_version", "has no branch 1")):
        with pytest.raises(AppError, match=reason):
            client.predict(*args, *settings(), api_name=api_name)
    after = client.predict("Next.", *settings(), api_name="/send")[0]
    answers = [t for r, t in texts(first) if r == "assistant"]
    assert [t for r, t in texts(after) if r == "user"] == ["A question.", "Next."]
    assert all(answer in [t for r, t in texts(after) if r == "assistant"] for answer in answers)


def test_the_api_names_its_parameters_and_refuses_a_wrong_number_of_inputs(app, client):
    """The parameters were `param_2`... and an input too many was silently dropped on
    every endpoint. Now they are named, the settings have the panel's defaults, and a call with
    more values than its event takes is refused with an error that says so."""
    import json
    import urllib.request
    info = client.view_api(print_info=False, return_format="dict")["named_endpoints"]
    names = [parameter["parameter_name"] for parameter in info["/send"]["parameters"]]
    assert names == ["text", *Settings.names()]
    assert all(parameter["parameter_name"].startswith("param_") is False for endpoint in info.values()
               for parameter in endpoint["parameters"])
    reply = client.predict("A question.", max_new_tokens=4, api_name="/send")[0]  # the settings left out
    assert [t for r, t in texts(reply) if r == "user"] == ["A question."]

    def call(api_name: str, data: list) -> str:
        """The raw HTTP API (gradio_client counts the arguments itself): what the event stream says."""
        request = urllib.request.Request(f"{app.url}gradio_api/call/{api_name}", json.dumps({"data": data}).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as response:
            event_id = json.load(response)["event_id"]
        with urllib.request.urlopen(f"{app.url}gradio_api/call/{api_name}/{event_id}", timeout=60) as response:
            return response.read().decode()

    # (the raw protocol carries the page's state as its first value: null for an API client)
    refused = call("clear", [None, *settings(), "one too many"])
    assert "event: error" in refused and "takes 8 input values, not 9" in refused
    assert "event: complete" in call("clear", [None, *settings()])


def test_two_clients_see_only_their_own_conversations(app):
    first, second = Client(app.url, verbose=False), Client(app.url, verbose=False)
    results = {}

    def talk(name, client):
        results[name] = client.predict(f"I am {name}.", *settings(), api_name="/send")

    threads = [threading.Thread(target=talk, args=(n, c)) for n, c in (("alice", first), ("bob", second))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for name in ("alice", "bob"):  # its own message, then its reply (a thinking block, an answer or a note)
        shown = texts(results[name][0])
        assert shown[0] == ("user", f"I am {name}.") and [role for role, _ in shown[1:]] == ["assistant"] * (len(shown) - 1)
        assert len(shown) >= 2
    again = first.predict("Still me?", *settings(), api_name="/send")
    assert [t for r, t in texts(again[0]) if r == "user"] == ["I am alice.", "Still me?"]


def test_tiny_budget_evicts_and_the_evicted_conversation_answers_exactly(tmp_path):
    from chat import ChatEngine

    server = AppServer("--cache-budget-mb", "0.01", log_path=tmp_path / "app.log")
    try:
        alice, bob = Client(server.url, verbose=False), Client(server.url, verbose=False)
        alice.predict("Remember the word cache.", *settings(64), api_name="/send")
        bob.predict("Hello, I push alice out of memory.", *settings(64), api_name="/send")
        result = alice.predict("Which word?", *settings(64), api_name="/send")
    finally:
        server.close()
    assert "rebuilt" in result[2]
    # reference: the same demo weights, every turn recomputed from scratch, greedy
    engine = ChatEngine.load("demo", device="cpu")

    def scratch_reply(messages):
        prompt = engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = engine.tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            output = engine.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=64,
                                           do_sample=False)
        new = [t for t in output[0, ids.shape[1]:].tolist() if t not in engine.eos_token_ids]
        return engine.tokenizer.decode(new, skip_special_tokens=False)

    history = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Remember the word cache."}]
    history.append({"role": "assistant", "content": scratch_reply(history)})
    history.append({"role": "user", "content": "Which word?"})
    expected = [history[2]["content"], scratch_reply(history)]
    # the answers (the thinking shows apart, as a titled message); the chatbot trims what it shows
    kept = [m for m in result[0] if not "".join(p.get("text", "") for p in m["content"]).startswith('<div class="branch-nav"')]
    shown = [text for (role, text), message in zip(texts(kept), kept)
             if role == "assistant" and not (message.get("metadata") or {}).get("title")]
    answers = [text.split("</think>")[-1].strip() for text in expected]
    assert shown == [answer for answer in answers if answer]  # a reply that only thought shows no answer


def test_a_model_that_cannot_load_ends_with_one_clear_line(tmp_path):
    import subprocess
    import sys

    from app_server import ROOT

    result = subprocess.run([sys.executable, str(ROOT / "app.py"), "--model", str(tmp_path / "missing-model")],
                            capture_output=True, text=True, timeout=120, env={**__import__("os").environ,
                                                                               "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("rewind-chat: cannot load") and "missing-model" in last


def test_browsers_sending_at_once_share_decode_steps_and_get_their_own_replies(app):
    """Three browsers send the same message at once: one greedy reply each, the same text (each
    row decodes as it would alone), and /status shows they shared batched steps."""
    clients = [Client(app.url, verbose=False) for _ in range(3)]
    jobs = [c.submit("Tell me everything you know.", *settings(max_new_tokens=48), api_name="/send")
            for c in clients]
    replies = [texts(job.result()[0])[-1] for job in jobs]
    assert replies[0][0] == "assistant" and replies[0][1] and replies.count(replies[0]) == 3
    batch = clients[0].predict(api_name="/status")["batch"]
    assert batch["largest_batch"] >= 2 and batch["max_batch_size"] == 8
    assert batch["decoding"] == batch["waiting"] == 0
    assert batch["join_wait_max_s"] >= batch["join_wait_mean_s"] >= 0
    # the timed budget: at least a token, at most the cap this app runs with (how much lower it is
    # depends on this machine's step times)
    assert batch["packed"] is True and 1 <= batch["prompt_tokens_per_step"] <= DEFAULT_PREFILL_CHUNK


def test_operators_read_plain_http_health_status_and_metrics(app, client):
    import json
    import urllib.request

    client.predict("Count me in the metrics.", *settings(), api_name="/send")
    with urllib.request.urlopen(app.url + "healthz", timeout=5) as response:
        assert json.loads(response.read()) == {"ok": True}
    with urllib.request.urlopen(app.url + "status", timeout=5) as response:
        status = json.loads(response.read())
    assert status["conversations"] >= 1 and "batch" in status and "cache_budget_bytes" in status
    named = ("version", "model", "started_at", "backend")  # what it says of itself
    assert not any(isinstance(value, str) and len(value) > 16 for name, value in status.items() if name not in named)
    assert status["model"] == "demo"  # no session key anywhere (they are 24 characters)
    with urllib.request.urlopen(app.url + "metrics", timeout=5) as response:
        assert response.headers["content-type"].startswith("text/plain")
        text = response.read().decode()
    done = [line for line in text.splitlines() if line.startswith('rewind_replies_total{operation="send"')]
    assert done and float(done[0].split()[-1]) >= 1
    for name in ("rewind_time_to_first_token_seconds_bucket", "rewind_prompt_tokens_total", "rewind_cache_bytes",
                 "rewind_batch_size", "rewind_evictions_total"):
        assert name in text


def test_a_busy_port_ends_with_one_clear_line_at_once(app):
    import subprocess
    import sys

    from app_server import ROOT

    result = subprocess.run([sys.executable, str(ROOT / "app.py"), "--port", str(app.port)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 1 and "rewind-chat: model" not in result.stdout  # refused before loading anything
    assert result.stderr.strip().splitlines()[-1].startswith(f"rewind-chat: port {app.port}")
    assert "--port" in result.stderr and "Traceback" not in result.stderr
