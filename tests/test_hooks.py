"""A model with forward hooks (a steering vector, a logits processor written as a hook) replies as
`model.generate` with the same hooks: on send, edit, regenerate and restore, with guesses on. The
plain step runs past the modules those hooks sit on, so while one is registered every row runs
the model's own forward alone; a model whose forward is patched, or whose attention is not one
the plain step computes, never gets the plain step; /status says which step runs and why."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import THINKING_TEMPLATE
from reference import render_ids, scratch_greedy_reply

from chat import ChatEngine
from chat.model_step.runner import ModelRunner

GREEDY = dict(max_new_tokens=10, do_sample=False)


def generated(model, tokenizer, messages) -> list[int]:
    """Greedy `generate` from scratch, hooks and all: the reply's token ids."""
    return scratch_greedy_reply(model, render_ids(tokenizer, messages), GREEDY["max_new_tokens"],
                                {tokenizer.convert_tokens_to_ids("<|im_end|>")})


def steer(model):
    """A steering vector added to decoder layer 1's output, where the plain step never calls it."""
    direction = torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(3)) * 4

    def hook(module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output
        hidden = hidden + direction
        return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

    return model.model.layers[1].register_forward_hook(hook)


def bias_by_input(model):
    """A logits processor as a hook on the model: after an even token, favour token 42 strongly."""
    def hook(module, args, kwargs, output):
        ids = kwargs.get("input_ids") if kwargs.get("input_ids") is not None else args[0]
        favoured = (ids[:, -1:] % 2 == 0).float() * 30.0
        output.logits[..., 42] += favoured.to(output.logits.dtype)
        return output

    return model.register_forward_hook(hook, with_kwargs=True)


@pytest.mark.parametrize("hook", [steer, bias_by_input])
def test_a_hooked_model_replies_as_generate_with_the_same_hooks(models, tokenizers, hook):
    model = copy.deepcopy(models["full"])
    tokenizer = tokenizers[THINKING_TEMPLATE]
    engine = ChatEngine(model, tokenizer, draft="auto")
    conv = engine.conversation("You are terse.")
    list(conv.send("Tell me about caches.", **GREEDY))  # before the hook: the plain step
    assert engine.status()["model_step"]["eager"] == "plain"
    handle = hook(model)
    try:
        status = engine.status()
        assert status["model_step"]["eager"] == "the model's own forward, row by row"
        assert "forward hook" in status["model_step"]["not_plain_because"]
        assert "forward hook" in status["guessing"]["off_because"]
        turns = [lambda: conv.send("And about rollback?", **GREEDY),
                 lambda: conv.regenerate(**GREEDY),
                 lambda: conv.edit(len(conv.messages) - 2, "And about branches?", **GREEDY)]
        for turn in turns:
            list(turn())
            reference = generated(model, tokenizer, conv.messages[:-1])
            assert conv.reply_ids == reference
        restored = engine.restore(conv.to_dict())
        list(restored.regenerate(**GREEDY))
        assert restored.reply_ids == generated(model, tokenizer, restored.messages[:-1])
        guessed = engine.status()["guessing"]["guessed"]
        list(conv.regenerate(**GREEDY))  # a Retry would guess from the version it replaces
        assert engine.status()["guessing"]["guessed"] == guessed
    finally:
        handle.remove()
    assert engine.status()["model_step"]["eager"] == "plain"  # the hook gone, the plain step again


def test_without_the_runner_noticing_the_hook_replies_differ(models, tokenizers, monkeypatch):
    """The test above can fail: with the runner told nothing is hooked, the plain step runs past
    the steering hook and the replies are not generate's."""
    model = copy.deepcopy(models["full"])
    tokenizer = tokenizers[THINKING_TEMPLATE]
    monkeypatch.setattr(ModelRunner, "hooked", lambda self: None)
    engine = ChatEngine(model, tokenizer, draft="off")
    conv = engine.conversation("You are terse.")
    handle = steer(model)
    try:
        list(conv.send("Tell me about caches.", **GREEDY))
        assert conv.reply_ids != generated(model, tokenizer, conv.messages[:-1])
    finally:
        handle.remove()


def test_a_patched_forward_or_an_unknown_attention_is_refused(models, tokenizers):
    tokenizer = tokenizers[THINKING_TEMPLATE]
    patched = copy.deepcopy(models["full"])
    layer = patched.model.layers[0]
    layer.forward = lambda *args, **kwargs: type(layer).forward(layer, *args, **kwargs)
    step = ChatEngine(patched, tokenizer).status()["model_step"]
    assert step["eager"] != "plain" and "decoder layer 0's forward is replaced" in step["not_plain_because"]

    custom = copy.deepcopy(models["full"])
    custom.config._attn_implementation = "my_own_attention"
    assert "my_own_attention" in ModelRunner(custom).plain_refusal


def test_a_step_that_does_not_match_the_models_forward_on_the_probe_is_refused(models, monkeypatch):
    """The load probe: a plain step that computes something else (here, its logits nudged) is
    found out before it serves, and the model's own forward runs instead."""
    import chat.model_step.runner

    model = models["full"]
    honest = ModelRunner(model)
    honest.probe_plain()
    assert honest.plain_refusal is None
    real = chat.model_step.runner.run_plain
    monkeypatch.setattr(chat.model_step.runner, "run_plain", lambda *args, **kwargs: real(*args, **kwargs) + 1e-2)
    nudged = ModelRunner(model)
    nudged.probe_plain()
    assert "load probe" in nudged.plain_refusal
