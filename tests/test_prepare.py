"""Prefill while typing (library and scheduler): `Conversation.prepare(text)`
prefills the conversation as it will be with that message, only in steps where no reply has
work; a Send of the same text then starts from the cache, and every reply is exactly what it
would have been unprepared (the independent references of tests/reference.py)."""

import threading
import time

import pytest
import torch
from conftest import THINKING_TEMPLATE
from reference import check_exact

import chat.model_step.runner

GREEDY = dict(max_new_tokens=8, do_sample=False)
TEXT = "Here is the long message I was typing, about the cache and how it rolls back to the prefix."


def wait_until(condition, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.001)


@pytest.mark.parametrize("arch", ["full", "sliding", "hybrid"])
def test_a_prepared_message_is_answered_from_the_cache_and_exactly(make_engine, models, tokenizers, arch):
    engine = make_engine(arch)
    conv = engine.conversation("You are terse.")
    list(conv.send("First question?", **GREEDY))
    assert conv.prepare(TEXT, **GREEDY)
    wait_until(lambda: engine.batch_stats().preparing == 0)
    list(conv.send(TEXT, **GREEDY))
    # full attention: held whole, its first token from the logits kept after it; windows and
    # recurrent states: all but the last token, which the first step feeds
    held = conv.stats.prompt_tokens - (arch != "full")
    assert conv.stats.reused_tokens == held and conv.stats.prefilled_tokens == conv.stats.prompt_tokens - held
    check_exact(conv, models[arch], tokenizers[THINKING_TEMPLATE], max_new_tokens=8)
    # prepared, then another text sent: the shared part is reused, the reply exact all the same
    assert conv.prepare(TEXT + " And one more line I deleted.", **GREEDY)
    wait_until(lambda: engine.batch_stats().preparing == 0)
    list(conv.send("Something else entirely?", **GREEDY))
    check_exact(conv, models[arch], tokenizers[THINKING_TEMPLATE], max_new_tokens=8)


def test_a_newer_draft_or_the_send_calls_the_last_one_off(make_engine, models, tokenizers):
    engine = make_engine("full", prefill_chunk=4)  # small pieces: still going when called off
    conv = engine.conversation("You are terse.")
    with_held_loop(engine, lambda: (conv.prepare(TEXT, **GREEDY), conv.prepare(TEXT + " Edited.", **GREEDY)))
    wait_until(lambda: engine.batch_stats().preparing == 0)  # the first ended at once, the second prefilled
    list(conv.send(TEXT + " Edited.", **GREEDY))
    assert conv.stats.prefilled_tokens <= 1
    check_exact(conv, models["full"], tokenizers[THINKING_TEMPLATE], max_new_tokens=8)
    assert not conv.prepare("   ") and not conv.prepare(TEXT + "x" * 20_000, max_new_tokens=8)  # empty; too long


def with_held_loop(engine, action) -> None:
    """Run `action` while a job holds the engine's loop (nothing steps meanwhile)."""
    gate, started = threading.Event(), threading.Event()
    engine.worker.submit(lambda: (started.set(), gate.wait(60)))
    assert started.wait(60)
    try:
        action()
    finally:
        gate.set()


def test_a_draft_never_runs_while_a_reply_has_work(make_engine, models, tokenizers, monkeypatch):
    """A reply streams in one conversation while another prepares: no forward carries the draft
    until that reply ended; then it is prefilled, and its Send is exact."""
    monkeypatch.setattr(models["full"].generation_config, "eos_token_id", None)
    engine = make_engine("full")
    streaming, typing = engine.conversation("You are terse."), engine.conversation("You are terse.")
    carried: list[tuple[bool, bool]] = []  # per forward: (the draft's session in it, a reply decoding)
    forward = chat.model_step.runner.packed_step

    def watched(model, rows, logits_of, plain, tails=None, alone=()):
        carried.append((any(session is typing.session for session, _ in rows),
                        any(session is streaming.session for session, _ in rows)))
        return forward(model, rows, logits_of, plain, tails, alone)

    monkeypatch.setattr(chat.model_step.runner, "packed_step", watched)
    stream = streaming.send("Talk for a while.", max_new_tokens=60, do_sample=False)
    reader = threading.Thread(target=lambda: list(stream), daemon=True)
    reader.start()
    wait_until(lambda: engine.batch_stats().decoding == 1)
    assert typing.prepare(TEXT, **GREEDY)
    start = engine.batch_stats().steps
    wait_until(lambda: engine.batch_stats().steps >= start + 20 or not reader.is_alive())
    assert engine.batch_stats().decoding == 1 and engine.batch_stats().preparing == 1  # the reply still runs
    assert not any(draft for draft, _ in carried)  # and the draft waited
    reader.join(60)
    wait_until(lambda: engine.batch_stats().preparing == 0)
    assert any(draft for draft, _ in carried) and not any(draft and decoding for draft, decoding in carried)
    monkeypatch.undo()
    list(typing.send(TEXT, **GREEDY))
    assert typing.stats.prefilled_tokens <= 1
    check_exact(typing, models["full"], tokenizers[THINKING_TEMPLATE], max_new_tokens=8)


@pytest.mark.parametrize("weights", ["full", "int8"])
def test_a_prepared_sends_first_token_needs_no_step(models, tokenizers, monkeypatch, weights):
    """A draft's last piece goes with the prompt's last token, and the logits after it stay with
    the cache: the Send of that text chooses its first token from them, with no model step (the
    wait is the sampling). With int8 weights too (the last piece within the rows its products keep
    apart, the token attending alone), the reply is an unprepared one's."""
    from chat import ChatEngine
    from conftest import forwards_before_first_token
    from tiny_models import wide_heads_model
    from reference import LOGIT_TOLERANCE, int8_logit_tolerance

    tokenizer = tokenizers[THINKING_TEMPLATE]
    if weights == "int8":  # converted in place: a model of its own (128-wide heads, as at real size)
        model = wide_heads_model("full", len(tokenizer), tokenizer.convert_tokens_to_ids("<|im_end|>"))
    else:
        model = models["full"]
    replies, measure = {}, None
    for prepared in (False, True):
        engine = ChatEngine(model, tokenizer, draft="off", weights=weights)
        measure = measure or forwards_before_first_token(model, monkeypatch)  # the head as converted
        conv = engine.conversation("You are terse.")
        list(conv.send("First question?", **GREEDY))
        if prepared:
            assert conv.prepare(TEXT, **GREEDY)
            wait_until(lambda: engine.batch_stats().preparing == 0)
        at_first = measure(lambda: list(conv.send(TEXT, **GREEDY)))
        assert len(at_first) == 1 and (at_first[0] == 0) == prepared
        replies[prepared] = conv.reply_ids
        prompt = conv.session.token_ids[:conv.stats.prompt_tokens]
        with torch.no_grad():
            scratch = model(torch.tensor([prompt])).logits[0, -1]
        tolerance = int8_logit_tolerance(model) if weights == "int8" else LOGIT_TOLERANCE
        assert (conv.session.next_logits(prompt)[0] - scratch).abs().max().item() < tolerance
        if weights == "full":
            check_exact(conv, model, tokenizer, max_new_tokens=8)
    assert replies[True] == replies[False]


def test_racing_asks_leave_one_text_in_work(make_engine, models, tokenizers):
    """Asks to prepare one conversation, from many threads at once (a client that does not wait
    for its answers): at most one text is in work once they are in; the others were called off
    before any step."""
    engine = make_engine("full", prefill_chunk=4)
    conv = engine.conversation("You are terse.")
    list(conv.send("First question?", **GREEDY))
    drafts = engine.scheduler.planner.requests.ahead
    asks = [f"{TEXT} Ask {number}." for number in range(48)]
    barrier = threading.Barrier(8)

    def ask(texts):
        barrier.wait()
        for text in texts:
            conv.prepare(text, **GREEDY)

    def burst():
        threads = [threading.Thread(target=ask, args=(asks[i::8],)) for i in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    live = []  # while the loop is held nothing steps: what is in work is what the asks left
    with_held_loop(engine, lambda: (burst(), live.extend(d for d in drafts if not d.stop.is_set())))
    assert len(live) <= 1
    wait_until(lambda: engine.batch_stats().preparing == 0)
    list(conv.send(asks[-1], **GREEDY))
    check_exact(conv, models["full"], tokenizers[THINKING_TEMPLATE], max_new_tokens=8)
