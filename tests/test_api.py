"""The OpenAI API served from the engine, through the real `openai` client over HTTP: replies equal
greedy `generate` from scratch, kept states are found by their tokens (a next turn, a Regenerate,
an edit, another conversation with the same system prompt), errors come in the API's shape with
nothing changed, and a client that goes away stops its reply."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch
import uvicorn
from starlette.applications import Starlette

from chat import ChatEngine
from chat.api import ApiRuns, KeptStates, api_routes
from chat.api.routes import STATE_HEADER
from chat.dialogue.reasoning import ReasoningSplitter

SYSTEM = "You are a careful calculator."
MAX_BODY = 64 * 1024
API_KEY = "secret-key"


class Served:
    """An engine's API on a free port, served by uvicorn on a thread."""

    def __init__(self, runs: ApiRuns, api_key: str | None = None):
        app = Starlette(routes=api_routes(runs, api_key=api_key, max_body_bytes=MAX_BODY))
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("the API server did not start")
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.base = f"http://127.0.0.1:{port}/v1"

    def client(self, key: str = "none") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base, api_key=key, max_retries=0, timeout=120)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join()


@pytest.fixture(scope="module")
def engine():
    return ChatEngine.load("demo", device="cpu")


@pytest.fixture(scope="module")
def runs(engine):
    return ApiRuns(engine, max_new_tokens=96)


@pytest.fixture(scope="module")
def served(runs):
    served = Served(runs)
    yield served
    served.close()


def scratch(engine: ChatEngine, messages: list[dict], max_new_tokens: int) -> tuple[str, str, list[int]]:
    """(answer, reasoning, prompt ids) of greedy `generate` from scratch on the same model."""
    rendered = engine.template.render(messages)
    ids = torch.tensor([rendered.ids])
    with torch.no_grad():
        output = engine.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                       do_sample=False)
    new = [token for token in output[0, ids.shape[1]:].tolist() if token not in engine.eos_token_ids]
    splitter = ReasoningSplitter(starts_in_reasoning=rendered.opens_reasoning)
    splitter.feed(engine.tokenizer.decode(new, skip_special_tokens=False))
    splitter.finish()
    content, reasoning = splitter.message_fields()
    return content, reasoning, rendered.ids


def ask(client: openai.OpenAI, messages: list[dict], max_tokens: int = 64, **extra):
    """A greedy chat completion: (the completion, how its kept state was found)."""
    raw = client.chat.completions.with_raw_response.create(model="demo", messages=messages, temperature=0,
                                                           max_tokens=max_tokens, **extra)
    return raw.parse(), raw.headers[STATE_HEADER]


def shared(a: list[int], b: list[int]) -> int:
    count = 0
    while count < min(len(a), len(b)) and a[count] == b[count]:
        count += 1
    return count


def test_models_lists_the_served_model(served):
    models = served.client().models.list()
    assert [model.id for model in models.data] == ["demo"]
    assert served.client().models.retrieve("demo").id == "demo"


def test_a_reply_streamed_and_not_equals_generate_and_reports_its_usage(served, engine):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is 17 + 25?"}]
    content, reasoning, prompt = scratch(engine, messages, 64)
    assert reasoning  # the demo model thinks first: the reasoning comes apart from the answer
    whole, _ = ask(served.client(), messages)
    assert whole.choices[0].message.content == content
    assert whole.choices[0].message.reasoning_content == reasoning
    assert whole.usage.prompt_tokens == len(prompt)
    stream = served.client().chat.completions.create(model="demo", messages=messages, temperature=0, max_tokens=64,
                                                      stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    deltas = [chunk.choices[0].delta for chunk in chunks if chunk.choices]
    assert deltas[0].role == "assistant"
    assert "".join(delta.content or "" for delta in deltas) == content
    assert "".join(getattr(delta, "reasoning_content", None) or "" for delta in deltas) == reasoning
    assert [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices][-1] == whole.choices[0].finish_reason
    usage = chunks[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (whole.usage.prompt_tokens, whole.usage.completion_tokens)
    # the same prompt again (a Regenerate of that reply): every prompt token's states were kept
    assert usage.prompt_tokens_details.cached_tokens == len(prompt)


def test_a_regenerate_computes_nothing_before_its_first_token(served, engine, monkeypatch):
    from conftest import forwards_before_first_token

    messages = [{"role": "user", "content": "What is 8 + 9?"}]
    first, how = ask(served.client(), messages)
    assert how == "new"  # what it shares with the other tests' conversations is too little to copy
    measure = forwards_before_first_token(engine.model, monkeypatch)
    result: list = []
    forwards = measure(lambda: result.extend(ask(served.client(), messages)))
    again, how = result
    assert how == "rolls back"
    assert forwards == [0]  # its first token came from the logits kept after the prompt
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens
    assert again.choices[0].message.content == first.choices[0].message.content  # greedy: the same reply


def test_an_edit_of_the_last_message_computes_only_what_changed_and_keeps_the_old_turn(served, engine):
    client = served.client()
    before = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is 31 + 11?"}]
    ask(client, before)
    edited = [before[0], {"role": "user", "content": "What is 31 + 12?"}]
    reply, how = ask(client, edited)
    old_prompt, new_prompt = engine.template.render(before).ids, engine.template.render(edited).ids
    assert how == "copies"
    assert reply.usage.prompt_tokens_details.cached_tokens == shared(old_prompt, new_prompt)
    assert reply.choices[0].message.content == scratch(engine, edited, 64)[0]
    # the old turn was kept for its own conversation: asking it again computes nothing
    again, how = ask(client, before)
    assert how == "rolls back" and again.usage.prompt_tokens_details.cached_tokens == len(old_prompt)


def test_sixteen_conversations_interleaved_each_reuse_their_states(served, engine):
    client, turns, system = served.client(), 3, "Answer each sum."  # a system prompt no other test sends
    questions = [[f"What is {a} + {a + 3}?", f"And {a} * 2?", "Add 1 to that."] for a in range(11, 27)]
    system_prefix = len(engine.template.render_history([{"role": "system", "content": system}]))
    histories = [[{"role": "system", "content": system}] for _ in questions]
    seen: list[list[tuple]] = [[] for _ in questions]

    def turn(index: int, number: int) -> None:
        history = histories[index]
        history.append({"role": "user", "content": questions[index][number]})
        reply, how = ask(client, history, max_tokens=40)
        message = reply.choices[0].message
        seen[index].append((how, reply.usage, message.content, scratch(engine, history, 40)[0]))
        history.append({"role": "assistant", "content": message.content,
                        "reasoning_content": message.reasoning_content})

    for index in range(len(questions)):  # first turns one by one: each later one copies the system prompt
        turn(index, 0)
    with ThreadPoolExecutor(8) as pool:  # then the rest interleaved
        for number in range(1, turns):
            list(pool.map(lambda index: turn(index, number), range(len(questions))))
    for index, conversation in enumerate(seen):
        assert [content for *_, content, expected in conversation] == [expected for *_, expected in conversation]
        assert conversation[0][0] == ("new" if index == 0 else "copies")
        assert conversation[0][1].prompt_tokens_details.cached_tokens >= (system_prefix if index else 0)
        for (_, earlier, *_), (how, usage, *_) in zip(conversation, conversation[1:]):
            # found its own state: everything before its last reply was kept
            assert how in ("continues", "rolls back")
            assert usage.prompt_tokens_details.cached_tokens >= earlier.prompt_tokens


def test_a_stop_string_ends_the_reply_before_it(served, engine):
    messages = [{"role": "user", "content": "What is 40 + 2?"}]
    content, reasoning, _ = scratch(engine, messages, 64)
    stop = content[len(content) // 2: len(content) // 2 + 2]
    reply, _ = ask(served.client(), messages, stop=[stop])
    assert reply.choices[0].message.content == content[: content.find(stop)]
    assert reply.choices[0].finish_reason == "stop"


def test_a_text_completion_takes_text_or_token_ids(served, engine):
    prompt = "<|im_start|>user\nWhat is 5 + 5?<|im_end|>\n<|im_start|>assistant\n"
    ids = engine.template.encode(prompt)
    as_text = served.client().completions.create(model="demo", prompt=prompt, max_tokens=24, temperature=0)
    as_ids = served.client().completions.create(model="demo", prompt=ids, max_tokens=24, temperature=0)
    with torch.no_grad():
        output = engine.model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)
    expected = engine.tokenizer.decode([t for t in output[0, len(ids):].tolist() if t not in engine.eos_token_ids],
                                       skip_special_tokens=False)
    assert as_text.choices[0].text == as_ids.choices[0].text == expected
    assert as_ids.usage.prompt_tokens_details.cached_tokens == len(ids)  # the same prompt again: kept


@pytest.mark.parametrize("request_body, status, param", [
    ({"model": "demo", "messages": []}, 400, "messages"),
    ({"model": "demo", "messages": [{"role": "function", "content": "x"}]}, 400, "messages[0].role"),
    ({"model": "demo", "messages": [{"role": "user", "content": "hi"}], "tool_choice": "required",
      "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tool_choice"),
    ({"model": "demo", "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, 400,
     "tools[0]"),
    ({"model": "demo", "messages": [{"role": "user", "content": "hi"}], "n": 2}, 400, "n"),
    ({"model": "demo", "messages": [{"role": "user", "content": "hi"}], "temperature": -1}, 400, "temperature"),
    ({"model": "demo", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages[0].content"),
    ({"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}, 404, "model"),
    ({"model": "demo", "messages": [{"role": "user", "content": "x" * MAX_BODY}]}, 413, None),
    ({"model": "demo", "messages": [{"role": "user", "content": "word " * 3000}]}, 400, "messages"),
])
def test_a_bad_request_gets_an_error_in_the_api_shape_and_changes_nothing(served, runs, engine, request_body, status,
                                                                          param):
    before, sessions = runs.states.stats(), engine.caches.stats().sessions
    response = httpx.post(f"{served.base}/chat/completions", json=request_body, timeout=60)
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"] and error["param"] == param
    assert runs.states.stats() == before and engine.caches.stats().sessions == sessions


def test_an_api_key_is_required_when_set(engine):
    served = Served(ApiRuns(engine, max_new_tokens=8), api_key=API_KEY)
    try:
        with pytest.raises(openai.AuthenticationError) as refused:
            served.client("wrong").models.list()
        assert refused.value.body["code"] == "invalid_api_key"
        assert [model.id for model in served.client(API_KEY).models.list().data] == ["demo"]
    finally:
        served.close()


def test_past_its_share_a_client_is_told_to_wait_and_nothing_changes(engine, monkeypatch):
    runs = ApiRuns(engine, max_new_tokens=8, max_per_client=1)
    served = Served(runs)
    held, claiming = threading.Event(), threading.Event()
    claim = runs.states.claim

    def slow_claim(client, prompt_ids):
        claiming.set()
        held.wait()
        return claim(client, prompt_ids)

    monkeypatch.setattr(runs.states, "claim", slow_claim)
    messages = [{"role": "user", "content": "What is 1 + 1?"}]
    try:
        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(ask, served.client(), messages, 8)
            claiming.wait()
            with pytest.raises(openai.RateLimitError) as refused:
                ask(served.client(), messages, 8)
            assert refused.value.body["code"] == "rate_limit_exceeded"
            assert runs.states.stats()["kept"] == 0
            held.set()
            assert first.result()[0].choices[0].message is not None
    finally:
        held.set()
        served.close()


def test_a_client_that_goes_away_stops_its_reply(served, runs, monkeypatch):
    from chat.scheduling.requests import GenerationRequest

    holding, stopped_while_running, emit = threading.Event(), [], GenerationRequest._emit

    def emit_then_hold(request, token_id):
        emit(request, token_id)
        if request.token_count == 3:  # the reply cannot go on until something stops it
            holding.set()
            stopped_while_running.append(request.stop.wait(60))

    monkeypatch.setattr(GenerationRequest, "_emit", emit_then_hold)
    messages = [{"role": "user", "content": "What is 3 + 4?"}]
    with httpx.stream("POST", f"{served.base}/chat/completions", timeout=60,
                      json={"model": "demo", "messages": messages, "stream": True, "max_tokens": 96,
                            "temperature": 0}) as response:
        lines = response.iter_lines()  # (a line iterator dropped would close the connection)
        assert next(lines).startswith("data: {")  # the first chunk: it runs
        assert holding.wait(60)
    while runs.states.stats()["in_use"]:  # a condition, not a bound: its session comes back
        time.sleep(0.01)
    assert stopped_while_running == [True]  # the server saw it go and stopped the reply


def test_kept_states_stay_within_their_limits(engine):
    states = KeptStates(engine.caches, engine.scheduler.call, max_states=3, max_per_client=2)
    claims = [states.claim("a", [1, 2, 3, index]) for index in range(2)]
    for claim in claims:
        states.give_back(claim, [], 0)
    for client in ("b", "c"):
        states.give_back(states.claim(client, [5, 6]), [], 0)
    assert states.stats()["kept"] == 3  # the least recently used idle state went
    states.give_back(states.claim("a", [7]), [], 0)
    assert states.stats()["kept"] == 3


def test_the_app_serves_the_api_beside_its_page(engine, tmp_path):
    from app_server import AppServer

    server = AppServer("--serve-api-key", API_KEY, log_path=tmp_path / "app.log")
    try:
        client = openai.OpenAI(base_url=server.url + "v1", api_key=API_KEY, max_retries=0, timeout=120)
        messages = [{"role": "user", "content": "What is 6 + 7?"}]
        chunks = list(client.chat.completions.create(model="demo", messages=messages, temperature=0, max_tokens=64,
                                                      stream=True))
        streamed = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
        again, how = ask(client, messages)
        status = httpx.get(server.url + "status", timeout=30).json()["openai_api"]
        refused = httpx.get(server.url + "v1/models", timeout=30)
        page = httpx.get(server.url, timeout=30)
    finally:
        server.close()
    assert streamed == again.choices[0].message.content == scratch(engine, messages, 64)[0]
    assert how == "rolls back" and again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens
    assert status["states"]["kept"] == 1 and status["in_flight"] == 0
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    assert page.status_code == 200  # the page, on the same port


def test_a_reply_sent_back_as_text_is_read_as_the_tokens_the_model_chose(make_engine):
    """A plain template renders the reply verbatim: its text re-encoded splits otherwise than the
    random model's tokens, and the next turn still finds all of it kept and reads it as chosen."""
    from conftest import PLAIN_TEMPLATE

    engine = make_engine("full", PLAIN_TEMPLATE)
    served = Served(ApiRuns(engine, max_new_tokens=24, model_name="demo"))
    try:
        first = [{"role": "user", "content": "Say something."}]
        reply, _ = ask(served.client(), first, 24)
        said = reply.choices[0].message.content
        second = first + [{"role": "assistant", "content": said}, {"role": "user", "content": "And again."}]
        again, how = ask(served.client(), second, 24)
        retried, retried_how = ask(served.client(), second, 24)  # a Regenerate of that turn
    finally:
        served.close()
    prompt = engine.template.render(first).ids
    with torch.no_grad():
        output = engine.model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0].tolist()
    chosen = prompt + [token for token in output[len(prompt):] if token not in engine.eos_token_ids]
    text = engine.template.render(second).text
    assert engine.template.render(second).ids[: len(chosen)] != chosen  # re-encoded, the reply splits otherwise
    held = engine.tokenizer.decode(chosen, skip_special_tokens=False)
    assert text.startswith(held)
    expected = chosen + engine.template.encode(text[len(held):])  # the prompt as the model wrote its part
    with torch.no_grad():
        output = engine.model.generate(torch.tensor([expected]), max_new_tokens=24, do_sample=False)[0].tolist()
    new = [token for token in output[len(expected):] if token not in engine.eos_token_ids]
    assert how == "continues"
    assert again.choices[0].message.content == engine.tokenizer.decode(new, skip_special_tokens=False)
    assert again.usage.prompt_tokens == len(expected)
    assert again.usage.prompt_tokens_details.cached_tokens >= len(chosen) - 1  # all it held (the last is unfed)
    # its Regenerate reads the earlier reply as chosen too: the whole prompt was kept, the reply the same
    assert retried_how == "rolls back"
    assert retried.usage.prompt_tokens_details.cached_tokens == retried.usage.prompt_tokens == len(expected)
    assert retried.choices[0].message.content == again.choices[0].message.content


WEATHER = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                             "parameters": {"type": "object",
                                                            "properties": {"city": {"type": "string"}}}}}]


def test_tools_are_offered_by_the_template_and_a_call_comes_back_as_tool_calls(base_tokenizer, tokenizers):
    from chat.models import script_reply
    from conftest import THINKING_TEMPLATE
    from tiny_models import build_model

    tokenizer = tokenizers[THINKING_TEMPLATE]
    model = build_model("full", len(tokenizer), tokenizer.convert_tokens_to_ids("<|im_end|>"))
    script_reply(model, tokenizer, 'Let me look.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
                                   '\n</tool_call>')
    engine = ChatEngine(model, tokenizer)
    served = Served(ApiRuns(engine, max_new_tokens=256, model_name="demo"))
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    try:
        client = served.client()
        whole = client.chat.completions.create(model="demo", messages=messages, tools=WEATHER, temperature=0,
                                               max_tokens=256)
        chunks = list(client.chat.completions.create(model="demo", messages=messages, tools=WEATHER, temperature=0,
                                                     max_tokens=256, stream=True))
        call = whole.choices[0].message.tool_calls[0]
        answered = messages + [{"role": "assistant", "content": "Let me look.",
                                "tool_calls": [{"id": call.id, "type": "function",
                                                "function": {"name": "get_weather", "arguments": call.function.arguments}}]},
                               {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"}]
        after = client.chat.completions.create(model="demo", messages=answered, tools=WEATHER, temperature=0,
                                               max_tokens=4)
    finally:
        served.close()
    expected = tokenizer.apply_chat_template(messages, tools=WEATHER, add_generation_prompt=True, tokenize=True,
                                             return_dict=False)
    assert whole.usage.prompt_tokens == len(expected)  # the tools were written into the prompt by the template
    assert whole.choices[0].finish_reason == "tool_calls"
    assert whole.choices[0].message.content == "Let me look."
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    deltas = [chunk.choices[0].delta for chunk in chunks if chunk.choices]
    assert "".join(delta.content or "" for delta in deltas) == "Let me look."
    streamed = [tool for delta in deltas for tool in delta.tool_calls or ()]
    assert [(tool.function.name, json.loads(tool.function.arguments)) for tool in streamed] == \
        [("get_weather", {"city": "Paris"})]
    assert [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices][-1] == "tool_calls"
    template_messages = [{**message, "reasoning_content": ""} if message["role"] == "assistant" else message
                         for message in answered]
    rendered = tokenizer.apply_chat_template(template_messages, tools=WEATHER, add_generation_prompt=True,
                                             tokenize=False)
    assert "<tool_response>\nSunny, 21 C\n</tool_response>" in rendered
    assert after.usage.prompt_tokens == len(tokenizer(rendered, add_special_tokens=False)["input_ids"])


def test_tools_for_a_template_without_a_call_format_are_refused(models, base_tokenizer):
    from conftest import tokenizer_with_template

    engine = ChatEngine(models["full"], tokenizer_with_template(base_tokenizer, "gemma"))
    served = Served(ApiRuns(engine, max_new_tokens=8, model_name="demo"))
    try:
        with pytest.raises(openai.BadRequestError) as refused:
            served.client().chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi"}],
                                                    tools=WEATHER)
    finally:
        served.close()
    assert refused.value.body["param"] == "tools"
