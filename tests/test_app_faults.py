"""Faults and abuse through the real interface: `gradio_client` and raw HTTP against a
launched app. The model is a tiny random one with its end token off, so a reply runs as long as
it is allowed: a cancelled stream is really cut, not ended by chance."""

from __future__ import annotations

import html
import json
import re
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from gradio_client import Client
from gradio_client.exceptions import AppError
from hypothesis import HealthCheck, given, settings as hypothesis_settings
from hypothesis import strategies as st

from app_server import AppServer
from ui.outputs import Settings

LONG = 1500


def settings(max_new_tokens: int = 6, system_prompt: str = "S.") -> list:
    return Settings(system_prompt=system_prompt, max_new_tokens=max_new_tokens, temperature=0.0).values()


@pytest.fixture(scope="module")
def endless_model(tmp_path_factory, base_tokenizer):
    from tiny_models import save_endless_model

    folder = tmp_path_factory.mktemp("endless-model")
    save_endless_model(folder, base_tokenizer)
    return folder


@pytest.fixture(scope="module")
def app(endless_model, tmp_path_factory):
    # The tests stand in for a proxy the operator trusts (--trusted-proxies): each test client says
    # which address it is in X-Forwarded-For.
    server = AppServer("--model", str(endless_model), "--max-per-client", "3", "--max-sessions", "12",
                       "--max-message-chars", "5000", "--max-new-tokens", str(LONG), "--trusted-proxies", "127.0.0.1",
                       log_path=tmp_path_factory.mktemp("log") / "app.log")
    yield server
    server.close()


def client(app, address: str = "10.0.0.1") -> Client:
    return Client(app.url, verbose=False, headers={"X-Forwarded-For": address})


def status(app) -> dict:
    return client(app, "10.9.9.9").predict(api_name="/status")


def settled(app) -> int:
    """Conversations once earlier tests' clients are gone (their pages unload) and the count holds."""
    last = -1
    while (now := status(app)["conversations"]) != last:
        last = now
        time.sleep(1.5)
    return now


def wait_for(condition, timeout_s: float) -> float:
    """Seconds until `condition()` held; fails after `timeout_s`."""
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < timeout_s, "timed out"
        time.sleep(0.05)
    return time.monotonic() - started


def texts(chat) -> list[tuple[str, str]]:
    """(role, text) of each shown message, without the note under a reply (stopped, edited) and
    without the controls shown under messages ("‹ 2 / 3 ›", ↻)."""
    shown = [(m["role"], "".join(p["text"] for p in m["content"] if p.get("type") == "text")) for m in chat]
    # a person's message is shown as typed: its Markdown and HTML characters as references (ui/views.py)
    return [(role, html.unescape(text) if role == "user" else re.sub(r"\n*<sub[^>]*>[^<]*</sub>$", "", text))
            for role, text in shown
            if not text.startswith('<div class="branch-nav"')]


def test_a_cancelled_client_stops_its_reply_and_its_next_message_is_answered(app):
    user = client(app, "10.0.1.1")
    before = settled(app)
    job = user.submit("Talk for a long time.", *settings(LONG), api_name="/send")
    wait_for(lambda: len(job.outputs()) >= 3, 60)
    job.cancel()
    waited = wait_for(lambda: status(app)["generating"] == 0 and status(app)["batch"]["decoding"] == 0, 5)
    assert waited < 2.0
    reply = user.predict("And now?", *settings(), api_name="/send")
    shown = texts(reply[0])
    assert [role for role, _ in shown] == ["user", "assistant", "user", "assistant"]  # the same conversation
    assert shown[0][1] == "Talk for a long time." and shown[1][1]  # the partial reply was kept
    assert status(app)["conversations"] == before + 1  # nothing left behind


def test_new_chat_during_a_reply_leaves_one_conversation(app):
    user = client(app, "10.0.2.1")
    before = settled(app)
    job = user.submit("Talk for a long time.", *settings(LONG), api_name="/send")
    wait_for(lambda: len(job.outputs()) >= 3, 60)
    cleared = user.predict(*settings(), api_name="/clear")
    assert cleared[0] == []
    job.result(timeout=30)  # the old stream ends, writing nothing over the new chat
    wait_for(lambda: status(app)["generating"] == 0, 5)
    assert status(app)["conversations"] == before  # the old one is freed; the new one starts with a message
    reply = user.predict("Fresh start?", *settings(), api_name="/send")
    assert [role for role, _ in texts(reply[0])] == ["user", "assistant"]
    assert status(app)["conversations"] == before + 1


def test_a_system_prompt_change_during_a_reply_is_refused_not_forked(app):
    # The count was settled (several status calls) after the reply began, and on a
    # busy machine the reply could end first; now only the refused call runs while it streams
    # (1,500 tokens: the model's end token is off).
    before = settled(app)
    user = client(app, "10.0.3.1")
    job = user.submit("Talk for a long time.", *settings(LONG), api_name="/send")
    wait_for(lambda: len(job.outputs()) >= 3, 60)
    with pytest.raises(AppError, match="still being generated"):
        user.predict("Another prompt?", *settings(system_prompt="Different."), api_name="/send")
    assert not job.done()
    assert status(app)["conversations"] == before + 1  # this tab's one: no second conversation for it
    user.predict(api_name="/stop")
    job.result(timeout=30)


def test_calls_that_change_nothing_create_no_conversation(app):
    before = settled(app)
    caller = client(app, "10.0.4.1")
    caller.predict(*settings(), api_name="/clear")
    for endpoint in ("/next_version", "/previous_version", "/undo", "/regenerate", "/continue"):
        with pytest.raises(AppError):  # refused: there is nothing to do it on
            caller.predict(*settings(), api_name=endpoint)
    assert status(app)["conversations"] == before


def test_one_address_cannot_push_out_another_clients_conversation(app):
    victim = client(app, "10.0.5.1")
    first = victim.predict("Remember: the word is cache.", *settings(), api_name="/send")
    attacker = client(app, "10.0.5.2")
    for index in range(200):  # fresh sessions, each one call; most change nothing
        attacker.session_hash = f"attacker-{index}"
        endpoint = "/send" if index % 10 == 0 else "/next_version"
        if endpoint == "/send":
            attacker.predict("Push.", *settings(1), api_name="/send")
        else:
            with pytest.raises(AppError):  # refused: that fresh session has nothing to switch
                attacker.predict(*settings(), api_name=endpoint)
    again = victim.predict("Which word?", *settings(), api_name="/send")
    assert texts(again[0])[:2] == texts(first[0])  # the victim's history is all there
    assert status(app)["conversations"] <= 12


def test_one_ipv6_client_is_one_client_whatever_the_spelling(app):
    """Five spellings of addresses in one IPv6 /64 (one subscriber's network) hold at most the
    three conversations one client may; before, each spelling counted as a client of its own."""
    before = settled(app)
    spellings = ["2001:db8:5::7", "2001:DB8:5:0:0:0:0:7", "2001:db8:5:0::7", "2001:db8:5::0:0:7", "2001:db8:5::8"]
    users = [client(app, spelling) for spelling in spellings]
    for user in users:
        user.predict("Mine?", *settings(1), api_name="/send")
    assert status(app)["conversations"] <= before + 3


def test_a_huge_message_is_refused_and_changes_nothing(app):
    user = client(app, "10.0.6.1")
    shown = user.predict("A first message.", *settings(), api_name="/send")
    for turn in range(29):  # a long conversation: the refusal must not depend on it
        user.predict(f"Turn {turn}.", *settings(1), api_name="/send")
    for turn in range(29):
        user.predict(*settings(), api_name="/undo")
    with pytest.raises(AppError, match="message: 1,000,000 characters is more than the 5,000 allowed"):
        user.predict("x" * 1_000_000, *settings(), api_name="/send")
    again = user.predict(*settings(), api_name="/undo")  # the conversation is as it was
    assert texts(again[0]) == [] and again[1] == "A first message."
    assert texts(shown[0])[0] == ("user", "A first message.")


def test_gradio_monitoring_is_off(app):
    with pytest.raises(urllib.error.HTTPError) as error:
        urllib.request.urlopen(app.url + "monitoring/summary", timeout=5)
    assert error.value.code in (401, 403, 404)


def test_every_page_carries_a_content_security_policy(app):
    with urllib.request.urlopen(app.url, timeout=5) as response:
        policy = response.headers["content-security-policy"]
    assert "img-src 'self' data: blob:" in policy and "form-action 'self'" in policy and "connect-src 'self'" in policy


def raw_call(app, api_name: str, data: list) -> tuple[str, str]:
    """Gradio's REST API by hand, JSON written with escapes (a lone surrogate cannot be UTF-8):
    returns the last server-sent event and its data."""
    body = json.dumps({"data": data}, ensure_ascii=True).encode()
    request = urllib.request.Request(f"{app.url}gradio_api/call/{api_name}", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        event_id = json.loads(response.read())["event_id"]
    with urllib.request.urlopen(f"{app.url}gradio_api/call/{api_name}/{event_id}", timeout=60) as response:
        lines = response.read().decode().splitlines()
    events = [line.split(": ", 1)[1] for line in lines if line.startswith("event: ")]
    payloads = [line.split(": ", 1)[1] for line in lines if line.startswith("data: ")]
    return events[-1], payloads[-1]


def test_lone_surrogates_are_refused_by_name(app):
    event, data = raw_call(app, "send", ["bad \ud800 text", None, *settings()])
    assert event == "error" and "message: contains characters that are not valid Unicode" in data
    values = settings()
    values[0] = "\ud800"
    event, data = raw_call(app, "send", ["fine", None, *values])
    assert event == "error" and "system_prompt: contains characters" in data


def test_nan_settings_and_a_dict_for_text_are_refused_by_name_and_change_nothing(app):
    """JSON's NaN for a setting and an object where text goes (sent by hand: a page never would)."""
    user = client(app, "10.0.7.9")
    base = user.predict("Odd inputs base.", *settings(), api_name="/send")
    for field in ("temperature", "top_p"):
        values = settings()
        values[FIELDS.index(field)] = float("nan")
        event, data = raw_call(app, "send", ["hi", None, *values])
        assert event == "error" and field in data, data
    event, data = raw_call(app, "send", [{"text": "hi", "files": []}, None, *settings()])
    assert event == "error" and "message" in data, data
    values = settings()
    values[FIELDS.index("system_prompt")] = {"role": "system"}
    event, data = raw_call(app, "send", ["hi", None, *values])
    assert event == "error" and "system_prompt" in data, data
    shown = user.predict(*settings(), api_name="/undo")
    assert shown[1] == "Odd inputs base." and texts(base[0])[0] == ("user", "Odd inputs base.")


def page_call(app, fn_index: int, data: list, event_data: object = None) -> None:
    """One event as a page sends it (Gradio's queue, or directly for an unqueued one), to its end."""
    dependency = json.loads(urllib.request.urlopen(app.url + "config", timeout=30).read())["dependencies"][fn_index]
    session = f"malformed{fn_index}-{time.monotonic_ns()}"
    body = json.dumps({"data": data, "fn_index": fn_index, "session_hash": session, "event_data": event_data,
                       "trigger_id": None}).encode()
    queued = dependency.get("queue") is not False
    request = urllib.request.Request(app.url + ("gradio_api/queue/join" if queued else "gradio_api/run/predict"),
                                     data=body, headers={"Content-Type": "application/json"})
    try:
        urllib.request.urlopen(request, timeout=60).read()
    except urllib.error.HTTPError:
        return
    if queued:
        with urllib.request.urlopen(f"{app.url}gradio_api/queue/data?session_hash={session}", timeout=60) as stream:
            for line in stream:
                if b"process_completed" in line:
                    return


def test_malformed_calls_are_one_line_each_in_the_log_never_a_traceback(app):
    """Too few values, values a component cannot read, a slider out of range, malformed event data
    for a chat message's Retry, an event that runs in the page only: each refused with its reason
    in one line of the log (before, 247 such calls left 41 tracebacks)."""
    config = json.loads(urllib.request.urlopen(app.url + "config", timeout=30).read())
    dependencies = config["dependencies"]
    send = next(i for i, d in enumerate(dependencies) if d.get("api_name") == "send")
    page_only = next(i for i, d in enumerate(dependencies) if not d.get("backend_fn"))
    retry_capture = next(i for i, d in enumerate(dependencies)
                         if d["targets"] and d["targets"][0][1] == "retry" and d.get("backend_fn"))
    values = settings()
    log = Path(app.log.name)
    lines_before = log.read_text().count("\n")
    calls = [(send, ["hi"]), (send, ["hi", None, "S.", True, [1], *values[3:]]),
             (send, ["hi", None, *values[:2], 10**9, *values[3:]]), (page_only, [None]),
             (retry_capture, [], {"index": "x"}), (retry_capture, [], [1, 2])]
    for fn_index, data, *event_data in calls:
        page_call(app, fn_index, data, *event_data)
    logged = log.read_text().splitlines()[lines_before:]
    assert not any("Traceback" in line for line in logged), "\n".join(logged)
    assert sum(line.startswith("rewind-chat: refused") for line in logged) >= 4, logged


FIELDS = Settings.names()
anything = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6), st.floats(allow_nan=False, allow_infinity=False),  # (NaN: the raw test above)
                     st.text(max_size=20, alphabet=st.characters(exclude_categories=["Cs"])),
                     st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))


@hypothesis_settings(max_examples=40, deadline=None, derandomize=True,
                     suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(field=st.sampled_from(FIELDS + ["message", "index", "too few"]), value=anything)
def test_fuzzed_inputs_either_work_or_name_the_problem(app, field, value):
    """One input replaced by anything: the call works, or fails with a message naming the field,
    and the conversation is as it was."""
    user = client(app, "10.0.7.1")
    base = user.predict("Fuzz base.", *settings(), api_name="/send")
    values = settings()
    try:
        if field == "too few":
            user.predict("hi", *values[:3], api_name="/send")
        elif field == "message":
            user.predict(value, *values, api_name="/send")
        elif field == "index":
            user.predict(value, "edited", *values, api_name="/edit")
        else:
            values[FIELDS.index(field)] = value
            user.predict("hi", *values, api_name="/send")
    except AppError as error:
        named = "settings" if field == "too few" else field
        # ours name the field; Gradio's own check of a slider's value names the input by position
        position = {"message": 0, "index": 0}.get(field, 2 + FIELDS.index(field) if field in FIELDS else -1)
        said = str(error)  # a refusal of the conversation's names the message ("message 0 is the system prompt, not a user message")
        assert said.startswith(f"{named}:") or f"the {named} " in said or f"index {position}" in said or \
            (field == "index" and (said.startswith("message ") or "no message at index" in said)) or \
            "minimum value" in said or "maximum value" in said, said
        shown = user.predict(*settings(), api_name="/undo")  # unchanged: undo gives back the base message
        assert shown[1] == "Fuzz base."
    assert texts(base[0])[0] == ("user", "Fuzz base.")


def test_a_stopped_server_leaves_no_conversation_data_on_disk(endless_model, tmp_path):
    """After SIGTERM the cold tier's files (token ids of conversations) and the
    exports folder stayed on disk. A stop now ends like Ctrl-C: the exit handlers remove the cold
    tier's; exports are no longer written to disk at all."""
    cache_dir, temp = tmp_path / "cold", tmp_path / "tmp"
    temp.mkdir()
    server = AppServer("--model", str(endless_model), "--cache-dir", str(cache_dir), "--cache-budget-mb", "0",
                       log_path=tmp_path / "app.log", env={"TMPDIR": str(temp)})
    try:
        user = client(server, "10.0.8.1")
        user.predict("Hello there?", *settings(), api_name="/send")
        wait_for(lambda: list(cache_dir.glob("*/session-*.cold")), 60)  # idle, over the budget: on disk
    finally:
        server.close()
    assert server.process.returncode == 0
    assert not list(cache_dir.glob("**/*.cold")) and not list(temp.glob("rewind-chat-exports-*"))


def test_a_stop_during_a_compile_exits_cleanly(tmp_path):
    """SIGTERM while the decode steps were being compiled (a thread nothing can stop)
    aborted the process ("terminate called without an active exception", exit 134, 2 of 2). Now
    the exit handlers run and the process ends without the interpreter's teardown: exit 0, and no
    half-written file, stopped as soon as it serves (the first graph being built) and once the
    first graph is saved (the next being built)."""
    steps = tmp_path / "cache" / "rewind-chat" / "compiled-steps"
    for moment in ("serving", "first graph saved"):
        server = AppServer("--compile", "on", log_path=tmp_path / f"{moment}.log",
                           env={"XDG_CACHE_HOME": str(tmp_path / "cache")})
        try:
            status = json.loads(urllib.request.urlopen(server.url + "status", timeout=30).read())
            compiling = status["engine"]["compiled_step"] if "engine" in status else status["compiled_step"]
            assert compiling["enabled"] and len(compiling["rows_compiled"]) < 4
            if moment == "first graph saved":
                wait_for(lambda: list(steps.glob("*-1-rows-*.graph")), 300)
        finally:
            server.close()
        assert server.process.returncode == 0, (tmp_path / f"{moment}.log").read_text()[-2000:]
        assert not list(steps.glob(".sealing-*"))
