"""The OpenAI API over HTTP: `POST /v1/chat/completions`, `POST /v1/completions`, `GET /v1/models`,
as Starlette routes: the app serves them beside its page (same port), `python -m chat.api`
alone.

Each request runs on a thread of its own (a reply waits on the engine's loop, which an event
loop must not); its events cross to the event loop through a queue. A streamed reply is
server-sent events as OpenAI sends them (`data: {chunk}` ... `data: [DONE]`); a client that goes
away stops its reply, streamed or not. Errors come in the API's shape with nothing changed.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import threading
import time
import uuid
from typing import Any, AsyncIterator, Awaitable, Callable

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from chat.api.protocol import ApiError, Call, ChatCall, Endpoint, invalid, parse
from chat.api.runs import ApiRuns, Ending
from chat.dialogue.reasoning import Delta

DEFAULT_MAX_BODY_BYTES = 8 * 2**20
STATE_HEADER = "X-Rewind-State"  # how the request's kept state was found (chat/api/kept_states.py)
_Event = tuple[str, Any]  # ("started", How) | ("delta", Delta) | ("end", Ending) | ("error", exception)


def api_routes(runs: ApiRuns, *, api_key: str | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> list[Route]:
    """The routes; with `api_key`, every request must send it as `Authorization: Bearer <key>`."""
    created = int(time.time())

    def model_card() -> dict[str, Any]:
        return {"id": runs.model_name, "object": "model", "created": created, "owned_by": "rewind-chat"}

    async def models(request: Request) -> Response:
        if (refused := _unauthorized(request, api_key)) is not None:
            return refused
        return JSONResponse({"object": "list", "data": [model_card()]})

    async def model(request: Request) -> Response:
        if (refused := _unauthorized(request, api_key)) is not None:
            return refused
        if request.path_params["name"] != runs.model_name:
            return _error(ApiError(404, "no such model here", param="model", code="model_not_found"))
        return JSONResponse(model_card())

    def serving(endpoint: Endpoint) -> Callable[[Request], Awaitable[Response]]:
        async def serve(request: Request) -> Response:
            if (refused := _unauthorized(request, api_key)) is not None:
                return refused
            try:
                call = parse(await _body(request, max_body_bytes), endpoint, runs.model_name, runs.max_new_tokens,
                             runs.vocab_size)
            except ApiError as error:
                return _error(error)
            except ClientDisconnect:
                return Response(status_code=499)
            return await _respond(runs, request, call)
        return serve

    return [Route("/v1/models", models), Route("/v1/models/{name:path}", model),
            Route("/v1/chat/completions", serving("chat"), methods=["POST"]),
            Route("/v1/completions", serving("text"), methods=["POST"])]


def _unauthorized(request: Request, api_key: str | None) -> Response | None:
    if api_key is None:
        return None
    sent = request.headers.get("authorization", "")
    scheme, _, token = sent.partition(" ")
    if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), api_key.encode()):
        return None
    return _error(ApiError(401, "a valid API key is needed (Authorization: Bearer <key>)", "invalid_request_error",
                           code="invalid_api_key"))


async def _body(request: Request, limit: int) -> Any:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the request body is over {limit} bytes", code="request_too_large")
    data = bytearray()
    async for chunk in request.stream():
        data += chunk
        if len(data) > limit:
            raise ApiError(413, f"the request body is over {limit} bytes", code="request_too_large")
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError) as error:
        raise invalid(f"the request body is not JSON: {error}") from error


def _error(error: ApiError) -> Response:
    return JSONResponse(error.body, status_code=error.status)


def _client(request: Request) -> str:
    """Who asked: the address (uvicorn has read X-Forwarded-For where the app trusts a proxy), as
    the page counts its clients, so a person's page and API share one part of the prompt budget."""
    return request.client.host if request.client else "unknown"


async def _respond(runs: ApiRuns, request: Request, call: Call) -> Response:
    loop, events = asyncio.get_running_loop(), asyncio.Queue[_Event]()
    stop = threading.Event()

    def put(event: _Event) -> None:
        loop.call_soon_threadsafe(events.put_nowait, event)

    threading.Thread(target=_run, args=(runs, call, _client(request), stop, put), daemon=True,
                     name="api-request").start()
    kind, first = await events.get()
    if kind == "error":
        stop.set()
        return _error(first if isinstance(first, ApiError) else _failure(first))
    headers = {STATE_HEADER: first}
    answer = _Answer(runs.model_name, isinstance(call, ChatCall))
    if call.sampling.stream:
        return StreamingResponse(_stream(events, answer, call.sampling.include_usage, stop, request), headers=headers,
                                 media_type="text/event-stream")
    return await _whole(events, answer, stop, request, headers)


def _run(runs: ApiRuns, call: Call, client: str, stop: threading.Event, put: Callable[[_Event], None]) -> None:
    """On the request's own thread: admit, start, stream, end."""
    try:
        with runs.admitted(client):
            run = runs.start(call, client, stop)
            put(("started", run.claim.how))
            try:
                for delta in run.pieces():
                    put(("delta", delta))
            finally:
                ending = run.end()
            put(("end", ending))
    except BaseException as error:  # noqa: BLE001 - every failure is the client's answer
        put(("error", error))


def _failure(error: BaseException) -> ApiError:
    return ApiError(500, f"the reply failed: {type(error).__name__}: {error}", "server_error", code="reply_failed")


class _Answer:
    """The response's shape: chat completion or text completion, its id and time."""

    def __init__(self, model: str, chat: bool):
        self.model, self.chat = model, chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def head(self, stream: bool) -> dict[str, Any]:
        kind = ("chat.completion" if self.chat else "text_completion") + (".chunk" if stream and self.chat else "")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def chunk(self, delta: Delta | None, finish: str | None = None, with_role: bool = False,
              tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        if self.chat:
            fields: dict[str, Any] = {"role": "assistant", "content": ""} if with_role else {}
            if delta is not None:
                fields["reasoning_content" if delta.kind == "reasoning" else "content"] = delta.text
            if tool_calls:
                fields["tool_calls"] = tool_calls
            choice: dict[str, Any] = {"index": 0, "delta": fields}
        else:
            choice = {"index": 0, "text": delta.text if delta is not None else ""}
        return {**self.head(True), "choices": [{**choice, "logprobs": None, "finish_reason": finish}]}

    def whole(self, ending: Ending) -> dict[str, Any]:
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": ending.content}
            if ending.reasoning:
                message["reasoning_content"] = ending.reasoning
            if ending.tool_calls:
                message["tool_calls"] = [call.as_dict() for call in ending.tool_calls]
                message["content"] = ending.content or None
            choice: dict[str, Any] = {"index": 0, "message": message}
        else:
            choice = {"index": 0, "text": ending.content}
        return {**self.head(False), "choices": [{**choice, "logprobs": None, "finish_reason": ending.finish_reason}],
                "usage": ending.usage()}


def _sse(data: Any) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


async def _stream(events: asyncio.Queue[_Event], answer: _Answer, include_usage: bool, stop: threading.Event,
                  request: Request) -> AsyncIterator[str]:
    usage = {"usage": None} if include_usage else {}
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        if answer.chat:
            yield _sse({**answer.chunk(None, with_role=True), **usage})
        while (event := await _next(events, gone)) is not None:
            kind, value = event
            if kind == "delta":
                yield _sse({**answer.chunk(value), **usage})
                continue
            if kind == "end":
                if value.tool_calls:
                    calls = [call.as_dict(index) for index, call in enumerate(value.tool_calls)]
                    yield _sse({**answer.chunk(None, tool_calls=calls), **usage})
                yield _sse({**answer.chunk(None, value.finish_reason), **usage})
                if include_usage:
                    yield _sse({**answer.head(True), "choices": [], "usage": value.usage()})
            else:
                yield _sse((value if isinstance(value, ApiError) else _failure(value)).body)
            yield "data: [DONE]\n\n"
            break
    finally:
        gone.cancel()
        stop.set()  # the client went away (or it ended: setting it then changes nothing)


async def _whole(events: asyncio.Queue[_Event], answer: _Answer, stop: threading.Event, request: Request,
                 headers: dict[str, str]) -> Response:
    """A reply not streamed: collected until it ends; a client that goes away meanwhile stops it."""
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        while (event := await _next(events, gone)) is not None:
            kind, value = event
            if kind == "end":
                return JSONResponse(answer.whole(value), headers=headers)
            if kind == "error":
                return _error(value if isinstance(value, ApiError) else _failure(value))
        return Response(status_code=499)
    finally:
        gone.cancel()
        stop.set()


async def _next(events: asyncio.Queue[_Event], gone: asyncio.Future[None]) -> _Event | None:
    """The request's next event, or None once its client went away (whichever comes first): a
    reply still waiting for its first token is stopped as soon as its client leaves."""
    getting = asyncio.ensure_future(events.get())
    await asyncio.wait({getting, gone}, return_when=asyncio.FIRST_COMPLETED)
    if getting.done():
        return getting.result()
    getting.cancel()
    return None


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
