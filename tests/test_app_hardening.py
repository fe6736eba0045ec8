"""A public Space's hardening, through a launched app on the demo model: forged proxy headers,
secrets, request and upload sizes, data nested past what the format allows, restarts, /status."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from gradio_client import Client

from app_server import AppServer, free_port
from ui.outputs import Settings

SECRET = "zebra-quartz-9931-not-for-pages"


def settings() -> list:
    return Settings(system_prompt="S.", max_new_tokens=4, temperature=0.0).values()


@pytest.fixture(scope="module")
def uploads(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gradio-temp")


@pytest.fixture(scope="module")
def app(tmp_path_factory, uploads):
    """Trusts no proxy (the default off a Space); one conversation per client address."""
    server = AppServer("--max-per-client", "1", "--max-request-mb", "4", env={"STORAGE_SECRET": SECRET,
                       "GRADIO_TEMP_DIR": str(uploads)}, log_path=tmp_path_factory.mktemp("log") / "a.log")
    yield server
    server.close()


def get(app, path: str) -> str:
    with urllib.request.urlopen(app.url + path, timeout=30) as response:
        return response.read().decode()


def status(app) -> dict:
    return json.loads(get(app, "status"))


def wait_for(condition, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_forged_forwarded_headers_from_a_local_peer_are_one_client(app):
    """Each call claims another address; the peer is 127.0.0.1 and no proxy is trusted, so they
    are one client, held to one conversation (before, each forged address got its own)."""
    before = status(app)["conversations"]
    for address in ("203.0.113.1", "203.0.113.2", "203.0.113.3"):
        user = Client(app.url, verbose=False, headers={"X-Forwarded-For": address})
        user.predict(f"Hello from {address}?", *settings(), api_name="/send")
    assert status(app)["conversations"] <= max(before, 1)


def test_no_secret_and_no_memory_address_in_anything_a_visitor_can_fetch(app):
    for path in ("", "config", "gradio_api/info", "status", "metrics", "healthz"):
        body = get(app, path)
        assert SECRET not in body, path
        assert " at 0x" not in body, path  # callbacks printed by address


def test_a_forwarded_host_from_an_untrusted_peer_is_not_reflected(app):
    """No proxy is trusted: what a client says the host is must not become the page's root
    address (a cache in front would hand the other host to everyone)."""
    forged = {"X-Forwarded-Host": "evil.example", "X-Gradio-Server": "http://evil.example",
              "X-Forwarded-Proto": "https"}
    for path in ("config", ""):
        with urllib.request.urlopen(urllib.request.Request(app.url + path, headers=forged), timeout=30) as response:
            body = response.read().decode()
        assert "evil.example" not in body and "https://127.0.0.1" not in body, path


def test_status_says_which_app_and_model_since_when(app):
    shown = status(app)
    assert shown["model"] == "demo" and shown["version"].startswith("0.") and shown["uptime_s"] >= 0
    assert shown["started_at"].endswith("+00:00") and "planning" in shown and "busy" in shown


def post(app, path: str, body: bytes, content_type: str = "application/json") -> int:
    request = urllib.request.Request(app.url + path, data=body, headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


def declared_large(app, path: str, content_type: str, head: bytes, size: int) -> int:
    """A request that declares `size` bytes and sends only its first 64 KiB: the status the server
    answers with before it reads on (a client sending it all would see the connection closed)."""
    import http.client

    connection = http.client.HTTPConnection("127.0.0.1", app.port, timeout=60)
    connection.putrequest("POST", "/" + path)
    connection.putheader("Content-Type", content_type)
    connection.putheader("Content-Length", str(size))
    connection.endheaders()
    connection.send(head + b"{" * (2**16 - len(head)))
    try:
        return connection.getresponse().status
    finally:
        connection.close()


def test_bodies_and_uploads_over_the_limits_are_refused_and_nothing_stays(app, uploads):
    assert declared_large(app, "gradio_api/queue/join", "application/json", b"", 5 * 2**20) == 413
    boundary = "rewindboundary"
    head = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"files\"; filename=\"big.json\"\r\n"
            f"Content-Type: application/json\r\n\r\n").encode()
    assert declared_large(app, "gradio_api/upload", f"multipart/form-data; boundary={boundary}", head,
                          5 * 2**20) == 413  # (the size is checked first; the route is closed besides)
    assert post(app, "gradio_api/queue/join", b"{}") != 413  # a small body goes through
    kept = [path for path in uploads.rglob("*") if path.is_file() and path.stat().st_size > 2**16]
    assert kept == []


def event(app, fn_index: int, data: list) -> list[dict]:
    """One event through Gradio's queue by hand (what a page does), its messages until it ends."""
    session = f"hardening{fn_index}{time.monotonic_ns()}"
    body = json.dumps({"data": data, "fn_index": fn_index, "session_hash": session, "event_data": None,
                       "trigger_id": None}).encode()
    assert post(app, "gradio_api/queue/join", body) == 200
    messages = []
    with urllib.request.urlopen(f"{app.url}gradio_api/queue/data?session_hash={session}", timeout=60) as response:
        for line in response:
            if line.startswith(b"data: "):
                messages.append(json.loads(line[6:]))
                if messages[-1]["msg"] in ("process_completed", "unexpected_error"):
                    return messages
    return messages


def test_a_stored_record_nested_past_the_format_is_left_out_not_a_crash(app):
    load = load_index(app)
    deep: list = []
    for _ in range(500):
        deep = [deep]
    good = {"format": "rewind-chat.conversation", "version": 1, "shown": 0,
            "messages": [{"parent": None, "role": "user", "content": "Kept?", "shown": None}]}
    for record, shown in (({"id": "deepentry1", "rev": 1, "title": "deep", "data": {"x": deep}}, False),
                          ({"id": "goodentry1", "rev": 1, "title": "good", "data": good}, True)):
        probe = {"current": record["id"], "rev": 1, "record": record,
                 "index": [["deepentry1", "deep"], ["goodentry1", "good"]]}
        answer = event(app, load, [probe, None])[-1]["output"]  # loads are queued, one record at a time
        assert ("Kept?" in json.dumps(answer["data"])) is shown, answer


def load_index(app) -> int:
    config = json.loads(get(app, "config"))
    return next(i for i, d in enumerate(config["dependencies"]) if "onLoad" in (d.get("js") or ""))


def test_a_page_keeps_no_copy_of_what_its_load_carried(app, uploads):
    """A forged load carrying 3 MB: what the server keeps of that page (Gradio's per-page state,
    which its public deep-link route writes out) is its default config, not the 3 MB. Before, each
    such load kept its whole value for as long as Gradio kept the page (1,000 pages, an hour)."""
    session = f"bigload{time.monotonic_ns()}"
    filler = "x" * (3 * 2**20)
    probe = {"current": "bigentry01", "rev": 1,
             "record": {"id": "bigentry01", "rev": 1, "title": "big", "data": {"filler": filler}}}
    body = json.dumps({"data": [probe, None], "fn_index": load_index(app), "session_hash": session,
                       "event_data": None, "trigger_id": None}).encode()
    assert post(app, "gradio_api/queue/join", body) == 200
    with urllib.request.urlopen(f"{app.url}gradio_api/queue/data?session_hash={session}", timeout=60) as response:
        assert any(b"process_completed" in line for line in response)
    with urllib.request.urlopen(f"{app.url}gradio_api/deep_link?session_hash={session}", timeout=60) as response:
        link = json.loads(response.read())
    written = [path.stat().st_size for path in uploads.rglob("state.json") if link in str(path)]
    assert written and max(written) < 2**20, written


def test_the_upload_route_is_closed_and_keeps_nothing(app, uploads):
    """No component of the page uploads (an Import is read in the browser): the upload route
    answers 404 unread, so no client fills the disk with spooled files (30 uploads of 15 MB from one
    client were all kept, 430 MB, until Gradio's sweep), small or large, sent whole or chunked."""
    import http.client

    boundary = "rewindboundary"
    head = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"files\"; filename=\"small.json\"\r\n"
            f"Content-Type: application/json\r\n\r\n").encode()
    for path in ("gradio_api/upload", "upload", "gradio_api/upload/"):
        small = head + b"{}\r\n" + f"--{boundary}--\r\n".encode()
        assert post(app, path, small, f"multipart/form-data; boundary={boundary}") == 404
    connection = http.client.HTTPConnection("127.0.0.1", app.port, timeout=60)
    connection.putrequest("POST", "/gradio_api/upload")
    connection.putheader("Content-Type", f"multipart/form-data; boundary={boundary}")
    connection.putheader("Transfer-Encoding", "chunked")
    connection.endheaders()
    try:
        for piece in [head] + [b"{" * 2**16] * 80:
            connection.send(b"%x\r\n%s\r\n" % (len(piece), piece))
        connection.send(b"0\r\n\r\n")
    except OSError:
        pass  # the server answered and closed before the end
    assert connection.getresponse().status == 404
    connection.close()
    kept = [path for path in uploads.rglob("small.json")]
    assert kept == []


def test_a_stopped_app_starts_again_at_once_on_the_same_port(tmp_path):
    """Stopped while browsers hold connections open (their sockets then linger on the server's
    port), it starts again at once; before, its start-up check said the port was in use for
    about a minute."""
    import http.client

    port = free_port()
    first = AppServer(log_path=tmp_path / "first.log", port=port)
    held = []
    for _ in range(3):  # keep-alive connections, open when the server stops
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        connection.request("GET", "/config")
        connection.getresponse().read()
        held.append(connection)
    first.close()
    try:
        second = AppServer(log_path=tmp_path / "second.log", port=port)
    finally:
        for connection in held:
            connection.close()
    try:
        assert status(second)["conversations"] == 0
    finally:
        second.close()
