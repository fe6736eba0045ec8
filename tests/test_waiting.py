"""What clients may have waiting (ui/waiting.py): large bodies counted per client
and in all from their arrival until what they carry is done with, refused before they are read.
Driven through the middleware itself, over a stand-in for Gradio that reads each body it is given
and queues it as an event the test ends."""

import asyncio
import json

from ui.waiting import LARGE_BYTES, WaitingBodies, WaitingBook

MB = 2**20


class Queue:
    """Gradio's side: reads the whole body, answers a join with a new event id (alive until ended)."""

    def __init__(self):
        self.alive: set[str] = set()
        self.bodies_read = 0

    async def __call__(self, scope, receive, send):
        while True:
            message = await receive()
            if not message.get("more_body"):
                break
        self.bodies_read += 1
        event_id = f"event{self.bodies_read}"
        if scope["path"].endswith("/queue/join"):
            self.alive.add(event_id)
        body = json.dumps({"event_id": event_id}).encode()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": body})


def post(middleware, path: str, nbytes: int, client: str) -> tuple[int, dict]:
    scope = {"type": "http", "method": "POST", "path": path, "client": (client, 5000),
             "headers": [(b"content-length", str(nbytes).encode())]}
    sent, answer = [], []

    async def receive():
        sent.append(1)
        return {"type": "http.request", "body": b"x" * min(nbytes, 1024), "more_body": False}

    async def send(message):
        answer.append(message)

    asyncio.run(middleware(scope, receive, send))
    status = answer[0]["status"]
    body = b"".join(message.get("body", b"") for message in answer[1:])
    return status, json.loads(body) if body else {}


def test_large_bodies_are_bounded_per_client_and_in_all_and_refused_unread():
    queue = Queue()
    book = WaitingBook(per_client_bytes=8 * MB, total_bytes=11 * MB)
    book.alive = lambda event_id: event_id in queue.alive
    middleware = WaitingBodies(queue, book, largest_bytes=4 * MB)
    join = "/gradio_api/queue/join"
    assert post(middleware, join, 3 * MB, "192.0.2.1")[0] == 200
    assert post(middleware, join, 3 * MB, "192.0.2.1")[0] == 200
    status, said = post(middleware, join, 3 * MB, "192.0.2.1")  # a third: past its client's 8 MB
    assert status == 429 and "already have 6 MB of requests waiting" in said["detail"] and queue.bodies_read == 2
    assert post(middleware, join, 1024, "192.0.2.1")[0] == 200  # small: never counted
    assert post(middleware, join, 3 * MB, "198.51.100.7")[0] == 200  # another client: its own share
    status, said = post(middleware, join, 3 * MB, "198.51.100.8")  # past everyone's 11 MB
    assert status == 503 and "busy" in said["detail"] and book.held_bytes() == 9 * MB
    # a body past the largest allowed is Gradio's to refuse (413, unread): passed through uncounted
    assert post(middleware, join, 5 * MB, "192.0.2.1")[0] == 200 and book.held_bytes() == 9 * MB
    # once an event has run, what it carried is let go of: the client may send again
    queue.alive.discard("event1")
    book.settle()
    assert book.held_bytes() == 6 * MB
    assert post(middleware, join, 3 * MB, "192.0.2.1")[0] == 200
    # a request answered at once (not queued) holds its body only until it is answered
    assert post(middleware, "/gradio_api/run/predict", MB + MB // 2, "203.0.113.5")[0] == 200
    assert book.held_bytes() == 9 * MB and book.refused == 2
    assert LARGE_BYTES == MB


def test_one_client_cannot_fill_the_queue_with_small_events():
    queue = Queue()
    book = WaitingBook(per_client_bytes=8 * MB, total_bytes=11 * MB, per_client_events=3)
    book.alive = lambda event_id: event_id in queue.alive
    middleware = WaitingBodies(queue, book, largest_bytes=4 * MB)
    join = "/gradio_api/queue/join"
    assert [post(middleware, join, 200, "192.0.2.1")[0] for _ in range(3)] == [200] * 3
    status, said = post(middleware, join, 200, "192.0.2.1")
    assert status == 429 and "3 requests waiting" in said["detail"]
    assert post(middleware, join, 200, "198.51.100.7")[0] == 200  # another client: its own
    assert post(middleware, "/gradio_api/run/predict", 200, "192.0.2.1")[0] == 200  # answered at once: not counted
    queue.alive.discard("event1")
    assert post(middleware, join, 200, "192.0.2.1")[0] == 200  # one ended: room for one more
