"""ZeroGPU's way of running: each operation in a forked worker, arguments and results pickled.

`fake_spaces_gpu` does what `spaces.GPU` does on ZeroGPU (a forked process; what crosses is
pickled), so the conversation must travel to the worker and back with its cache intact.
"""

import multiprocessing
import pickle

import pytest
import torch

from chat import ChatEngine, EmptyMessageError
from chat import remote
from chat.remote import RemoteOperation
from conftest import THINKING_TEMPLATE
from reference import check_exact

GREEDY = dict(max_new_tokens=8, do_sample=False)


def fake_spaces_gpu(function):
    def run(*args, **kwargs):
        context = multiprocessing.get_context("fork")
        results = context.SimpleQueue()

        def child():
            torch.set_num_threads(1)  # OpenMP's pool does not survive a fork
            try:
                arguments, keywords = pickle.loads(pickle.dumps((args, kwargs)))  # what spaces does
                for item in function(*arguments, **keywords):
                    results.put(pickle.dumps(("item", item)))  # bytes: the data itself crosses
                results.put(pickle.dumps(("end", None)))
            except BaseException as error:
                results.put(pickle.dumps(("error", error)))

        process = context.Process(target=child, daemon=True)
        process.start()
        try:
            while True:
                kind, value = pickle.loads(results.get())
                if kind == "item":
                    yield value
                elif kind == "end":
                    return
                else:
                    raise value
        finally:
            process.join(timeout=60)

    return run


@pytest.fixture
def engine(models, tokenizers, monkeypatch):
    engine = ChatEngine(models["hybrid"], tokenizers[THINKING_TEMPLATE], offload_sessions=True)
    monkeypatch.setattr(remote, "ENGINE", engine)
    return engine


def test_a_conversation_runs_in_a_forked_worker_and_comes_back_exact(engine, models, tokenizers):
    runner = fake_spaces_gpu(remote.run_operation)
    conv = engine.conversation("System.")
    deltas = list(RemoteOperation(conv, engine, runner, "send", "Hello over there?", **GREEDY))
    assert deltas and conv.messages[-1]["role"] == "assistant" and conv.session.token_ids
    check_exact(conv, models["hybrid"], tokenizers[THINKING_TEMPLATE], max_new_tokens=8)

    list(RemoteOperation(conv, engine, runner, "regenerate", **GREEDY))
    assert conv.stats.prefilled_tokens == 1 and conv.versions == (1, 2)  # the cache made the round trip
    check_exact(conv, models["hybrid"], tokenizers[THINKING_TEMPLATE], max_new_tokens=8)
    assert conv.select_version(0)  # switching happens on the server, without a forward pass
    list(RemoteOperation(conv, engine, runner, "send", "And then?", **GREEDY))
    check_exact(conv, models["hybrid"], tokenizers[THINKING_TEMPLATE], max_new_tokens=8)


def test_bad_input_fails_on_the_server_before_any_worker_runs(engine):
    def runner(*args):
        raise AssertionError("the worker must not be called")

    conv = engine.conversation()
    with pytest.raises(EmptyMessageError):
        RemoteOperation(conv, engine, runner, "send", "  ", **GREEDY)


def test_stop_reaches_the_worker(engine):
    runner = fake_spaces_gpu(remote.run_operation)
    conv = engine.conversation()
    operation = RemoteOperation(conv, engine, runner, "send", "A long one.", max_new_tokens=400, do_sample=False)
    for index, _ in enumerate(operation):
        if index == 0:
            operation.stop()
    assert conv.stats.stopped and conv.stats.generated_tokens < 400
    list(RemoteOperation(conv, engine, runner, "send", "Next.", **GREEDY))
    assert conv.messages[-2]["content"] == "Next."


def test_the_app_runs_every_operation_through_the_worker_on_zerogpu(engine, monkeypatch):
    from app import ChatApp
    from cache_sessions.manager import SessionManager

    calls = []
    forked = fake_spaces_gpu(remote.run_operation)

    def runner(*args):
        calls.append(args[1])
        yield from forked(*args)

    app = ChatApp(engine, SessionManager(), runner=runner)
    settings = ["System.", True, 8, 0.0, 0.95, 50, 1.0]
    *_, last = app.send("Hello?", None, *settings)
    key = last[2]
    assert [m["role"] for m in last[0]] == ["user", "assistant"]
    *_, last = app.regenerate(key, *settings)
    assert "prefilled **1**" in last[3]
    *_, last = app.continue_reply(key, *settings)
    *_, last = app.edit(1, "Edited?", key, *settings)
    assert last[0][0]["content"] == "Edited?"
    assert calls == ["send", "regenerate", "continue_reply", "edit"]
    conv = app.manager.get(key).conversation
    assert {t.device.type for t in conv.session.tensors()} == {"cpu"}
