"""Issue check 1: after every operation, on every layer mix, the session equals recomputation."""

import pytest

from conftest import PLAIN_TEMPLATE, THINKING_TEMPLATE
from reference import check_exact
from tiny_models import ARCHS

MAX_NEW = 12


def drain(stream):
    return list(stream)


def stop_after_first_delta(conv, stream):
    deltas = []
    for delta in stream:
        deltas.append(delta)
        if len(deltas) == 1:
            conv.stop()
    return deltas


@pytest.mark.parametrize("template", [THINKING_TEMPLATE, PLAIN_TEMPLATE])
@pytest.mark.parametrize("arch", ARCHS)
def test_every_operation_matches_recomputation(make_engine, models, tokenizers, arch, template):
    engine = make_engine(arch, template)
    conv = engine.conversation("You are terse.")
    every_operation(conv, lambda **kwargs: check_exact(conv, models[arch], tokenizers[template],
                                                       max_new_tokens=MAX_NEW, **kwargs))


def every_operation(conv, check) -> None:
    """Send, regenerate, stop, undo, edit: `check(**check_exact's flags)` after each."""
    options = dict(max_new_tokens=MAX_NEW, do_sample=False)
    drain(conv.send("Hello there, what is two plus two?", **options))
    check()
    drain(conv.send("And what about three plus three, please?", **options))
    check()
    drain(conv.regenerate(**options))
    check()
    # regenerate reuses the whole prompt, its first token from the logits kept after it (where every
    # layer crops anywhere), or all of it but the last token (a checkpoint at the generation start)
    assert conv.stats.prefilled_tokens == (0 if conv.session.crops_anywhere() else 1)
    stop_after_first_delta(conv, conv.regenerate(**options))
    check(stopped=True)
    assert conv.stats.stopped
    drain(conv.send("Tell me a longer story about the cache.", **options))
    check()
    conv.undo()
    check(generated=False, stopped=True)  # the last reply is now the stopped one
    drain(conv.send("Something else then.", **options))
    check()
    drain(conv.edit(1, "Hi! Edited first question?", **options))
    check()
    assert len(conv.messages) == 3
    drain(conv.send("One more turn after the edit.", **options))
    check()


@pytest.mark.parametrize("arch", ARCHS)
def test_abandoned_stream_keeps_partial_reply_and_exact_cache(make_engine, models, tokenizers, arch):
    engine = make_engine(arch)
    conv = engine.conversation()
    stream = conv.send("Count from one to ten.", max_new_tokens=MAX_NEW, do_sample=False)
    next(stream)
    stream.close()  # the browser went away mid-reply
    assert conv.messages[-1]["role"] == "assistant"
    assert conv.stats.stopped
    check_exact(conv, models[arch], tokenizers[THINKING_TEMPLATE], max_new_tokens=MAX_NEW, stopped=True)
    drain(conv.send("Next question.", max_new_tokens=MAX_NEW, do_sample=False))
    check_exact(conv, models[arch], tokenizers[THINKING_TEMPLATE], max_new_tokens=MAX_NEW)


@pytest.mark.parametrize("arch", ARCHS)
def test_thinking_disabled_matches_recomputation(make_engine, models, tokenizers, arch):
    engine = make_engine(arch)
    conv = engine.conversation()
    for text in ("First question?", "Second question?"):
        drain(conv.send(text, max_new_tokens=MAX_NEW, do_sample=False, enable_thinking=False))
        check_exact(conv, models[arch], tokenizers[THINKING_TEMPLATE], max_new_tokens=MAX_NEW, enable_thinking=False)
