"""ZeroGPU's way of running: each operation in a forked worker, arguments and results pickled.

`fake_spaces_gpu` does what `spaces.GPU` does on ZeroGPU (a forked process; what crosses is
pickled), so a conversation's cache session must travel to the worker and back intact.
"""

import multiprocessing
import re
import pickle

import pytest
import torch

from chat import (ChatEngine, Continue, Edit, EmptyMessageError, GenerationOptions, NothingToRegenerateError,
                  Regenerate, Send)
from chat.backends import remote
from conftest import THINKING_TEMPLATE
from reference import check_exact

GREEDY = GenerationOptions(max_new_tokens=8, do_sample=False)


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


@pytest.fixture
def worker_calls(engine):
    """Every reply of the engine's conversations runs in a forked worker; the kinds are listed."""
    calls, forked = [], fake_spaces_gpu(remote.run_in_worker)

    def runner(session, request, stop_file):
        calls.append(request.kind)
        yield from forked(session, request, stop_file)

    engine.run_replies_in(runner)
    return calls


def test_a_conversation_runs_in_a_forked_worker_and_comes_back_exact(engine, models, tokenizers, worker_calls):
    conv = engine.conversation("System.")
    deltas = list(conv.send("Hello over there?", max_new_tokens=8, do_sample=False))
    assert deltas and conv.messages[-1]["role"] == "assistant" and conv.session.token_ids
    check_exact(conv, models["hybrid"], tokenizers[THINKING_TEMPLATE], max_new_tokens=8)

    list(conv.regenerate(max_new_tokens=8, do_sample=False))
    assert conv.stats.prefilled_tokens == 1 and conv.versions == (1, 2)  # the cache made the round trip
    check_exact(conv, models["hybrid"], tokenizers[THINKING_TEMPLATE], max_new_tokens=8)
    assert conv.select_version(0)  # switching happens on the server, without a forward pass
    list(conv.send("And then?", max_new_tokens=8, do_sample=False))
    check_exact(conv, models["hybrid"], tokenizers[THINKING_TEMPLATE], max_new_tokens=8)
    assert worker_calls == ["reply", "reply", "reply"]
    assert {t.device.type for t in conv.session.tensors()} == {"cpu"}


def test_bad_input_fails_on_the_server_before_any_worker_runs(engine):
    def runner(*args):
        raise AssertionError("the worker must not be called")

    engine.run_replies_in(runner)
    conv = engine.conversation()
    with pytest.raises(EmptyMessageError):
        conv.send("  ", **GREEDY.generate_kwargs())
    with pytest.raises(NothingToRegenerateError):
        conv.continue_reply()


def test_stop_reaches_the_worker(engine, worker_calls):
    conv = engine.conversation()
    stream = conv.send("A long one.", max_new_tokens=400, do_sample=False)
    for index, _ in enumerate(stream):
        if index == 0:
            conv.stop()
    assert conv.stats.stopped and conv.stats.generated_tokens < 400
    list(conv.send("Next.", max_new_tokens=8, do_sample=False))
    assert conv.messages[-2]["content"] == "Next."


def test_the_app_runs_every_operation_through_the_worker_on_zerogpu(engine, worker_calls):
    from ui.directory import ChatDirectory
    from ui.handlers import ChatHandlers
    from ui.outputs import Settings

    handlers = ChatHandlers(engine, ChatDirectory(engine))
    settings = Settings(system_prompt="System.", max_new_tokens=8, temperature=0.0).values()
    outputs = list(handlers.send(None, "Hello?", None, *settings))
    key, last = outputs[0].key, outputs[-1]  # the first update names the conversation
    assert [m["role"] for m in last.chat] == ["user", "assistant"]
    *_, last = handlers.regenerate(None, key, *settings)
    assert "**1 computed**" in last.stats
    messages = lambda chat: [m for m in chat if not m["content"].startswith('<div class="branch-nav"')]  # noqa: E731
    before = messages(last.chat)[-1]["content"]
    *_, last = handlers.continue_reply(None, key, *settings)
    conv = handlers.directory.find(key).conversation
    assert conv.stats.prefilled_tokens == 1 and conv.versions == (1, 2)  # continued in place, in the worker
    unmarked = lambda text: re.sub(r"\n*<sub[^>]*>[^<]*</sub>$", "", text).strip()  # noqa: E731  (the stopped note)
    assert unmarked(messages(last.chat)[-1]["content"]).startswith(unmarked(before)) and len(messages(last.chat)) == 2
    *_, last = handlers.edit(None, 1, "Edited?", key, *settings)
    assert messages(last.chat)[0]["content"] == "Edited?"
    assert worker_calls == ["reply", "reply", "continue", "reply"]
    assert {t.device.type for t in conv.session.tensors()} == {"cpu"}


def test_message_ids_stay_unique_through_the_worker_and_the_saved_copy_restores_exact(engine, models, tokenizers,
                                                                                      worker_calls):
    """Send, Regenerate, Edit, a switch and Continue, each through fork + pickle: the tree's ids
    stay unique (a process-wide counter gave the worker and the server the same ones), so the
    saved copy restores, and its branches switch with their kept states, exactly."""
    model, tokenizer = models["hybrid"], tokenizers[THINKING_TEMPLATE]
    conv = engine.conversation("System.")
    for operation in (Send("First?"), Regenerate(), Send("Second?"), Edit(1, "First, edited?"), Continue()):
        list(conv.start(operation, GREEDY))
        uids = [node.uid for node in conv.history.nodes()]
        assert len(uids) == len(set(uids)), uids
    assert conv.switch_branch(1, 0)  # back to the first question's branch, on the server
    list(conv.start(Send("Third?"), GREEDY))
    check_exact(conv, model, tokenizer, max_new_tokens=8)
    uids = [node.uid for node in conv.history.nodes()]
    assert len(uids) == len(set(uids)), uids

    restored = engine.restore(conv.to_dict())
    assert restored.to_dict() == conv.to_dict()
    list(restored.send("Fourth?", max_new_tokens=8, do_sample=False))
    check_exact(restored, model, tokenizer, max_new_tokens=8)
    shown = restored.messages
    list(restored.edit(1, "Another first?", max_new_tokens=8, do_sample=False))
    assert restored.switch_branch(1, 0) is True  # the kept states are put back
    assert restored.messages == shown
    check_exact(restored, model, tokenizer, max_new_tokens=8, generated=False)
    list(restored.send("Fifth?", max_new_tokens=8, do_sample=False))
    check_exact(restored, model, tokenizer, max_new_tokens=8)


def test_a_reply_in_a_forked_worker_under_a_tiny_budget_is_exact(models, tokenizers, monkeypatch):
    """The worker starts with no record of the server's pins, so its budget evicted
    the very session it was decoding (garbage, then "generated sequence does not extend the
    cache ledger"). What is in use is the scheduler's own record of its requests, in the worker
    too: under a budget smaller than one conversation the reply is the local engine's."""
    engine = ChatEngine(models["full"], tokenizers[THINKING_TEMPLATE], offload_sessions=True, cache_budget_bytes=1)
    monkeypatch.setattr(remote, "ENGINE", engine)
    engine.run_replies_in(fake_spaces_gpu(remote.run_in_worker))
    conv = engine.conversation("System.")
    for question in ("Hello over there?", "And then, what happened next?"):
        list(conv.send(question, max_new_tokens=24, do_sample=False))
        engine.caches.enforce_budget()  # the budget, posted as the reply came back, has run: nothing moves now
        check_exact(conv, models["full"], tokenizers[THINKING_TEMPLATE], max_new_tokens=24)
