"""Continue, reply versions, context fitting and shared prefixes: exact like every other operation."""

import pytest
import torch

from chat import ChatEngine, ContextOverflowError, ConversationError
from conftest import PLAIN_TEMPLATE, THINKING_TEMPLATE, count_forwards, forwards_before_first_token
from reference import check_exact, render_ids, scratch_greedy_reply, cached_vs_scratch_logit_error, LOGIT_TOLERANCE
from tiny_models import ARCHS

GREEDY = dict(max_new_tokens=8, do_sample=False)


@pytest.mark.parametrize("arch", ARCHS)
def test_continue_extends_the_reply_with_one_token_of_prefill(make_engine, models, tokenizers, arch):
    model, tokenizer = models[arch], tokenizers[THINKING_TEMPLATE]
    conv = make_engine(arch).conversation("Be brief.")
    list(conv.send("Tell me about caches.", **GREEDY))
    first = conv.reply_ids
    list(conv.continue_reply(**GREEDY))
    assert conv.stats.prefilled_tokens == 1 and conv.stats.rollback in ("none", "crop")
    assert conv.reply_ids[: len(first)] == first and len(conv.messages) == 3
    # reference: greedy from scratch on the original prompt followed by the reply so far
    prompt = render_ids(tokenizer, conv.messages[:-1])
    assert conv.reply_ids == first + scratch_greedy_reply(model, prompt + first, 8, {tokenizer.eos_token_id})
    assert cached_vs_scratch_logit_error(model, conv.session.cache, conv.session.token_ids, 7) < LOGIT_TOLERANCE
    assert conv.stats.prefilled_tokens == conv.stats.prompt_tokens - conv.stats.reused_tokens
    # and the conversation goes on exactly
    list(conv.send("Next?", **GREEDY))
    check_exact(conv, model, tokenizer, max_new_tokens=8)


@pytest.mark.parametrize("arch", ARCHS)
def test_versions_switch_back_without_running_the_model(make_engine, models, tokenizers, arch, monkeypatch):
    model, tokenizer = models[arch], tokenizers[PLAIN_TEMPLATE]
    conv = make_engine(arch, PLAIN_TEMPLATE).conversation()
    list(conv.send("Pick a number.", **GREEDY))
    texts = [conv.messages[-1]["content"]]
    for seed in (1, 2):
        torch.manual_seed(seed)
        list(conv.regenerate(max_new_tokens=8, do_sample=True, temperature=1.5))
        texts.append(conv.messages[-1]["content"])
    assert conv.versions == (2, 3) and len(set(texts)) > 1

    forwards = count_forwards(model, monkeypatch)
    for index in (0, 1, 2, 0):
        assert conv.select_version(index) is True
        assert conv.versions == (index, 3)
        assert conv.messages[-1]["content"] == texts[index]
    assert forwards == []  # switching ran no forward pass
    monkeypatch.undo()
    # the cache now holds version 0 exactly, and the next turn continues from it
    assert cached_vs_scratch_logit_error(model, conv.session.cache, conv.session.token_ids, 7) < LOGIT_TOLERANCE
    assert conv.session.token_ids[-len(conv.reply_ids) + 1:] == conv.reply_ids[:-1]
    list(conv.send("Another?", **GREEDY))
    check_exact(conv, model, tokenizer, max_new_tokens=8)
    assert conv.versions == (0, 1)  # a new turn: the earlier reply keeps the version shown


def test_version_index_out_of_range_changes_nothing(make_engine):
    conv = make_engine("full").conversation()
    with pytest.raises(ConversationError):
        conv.select_version(0)
    list(conv.send("Hi", **GREEDY))
    before = (conv.messages, list(conv.session.token_ids))
    for bad in (-1, 1, "0"):
        with pytest.raises(ConversationError):
            conv.select_version(bad)
    assert (conv.messages, conv.session.token_ids) == before


@pytest.mark.parametrize("arch", ["full", "hybrid"])
def test_fit_context_drops_the_oldest_turns_and_stays_exact(models, tokenizers, arch):
    model, tokenizer = models[arch], tokenizers[THINKING_TEMPLATE]
    conv = ChatEngine(model, tokenizer, context_limit=60).conversation("System stays.")
    for question in ("First question here?", "Second question here?", "Third question here?"):
        stream = conv.send(question, fit_context=True, **GREEDY)
        list(stream)
    assert stream.dropped_turns >= 1 and conv.stats.dropped_turns == stream.dropped_turns
    messages = conv.messages  # the whole conversation stays: the prompt leaves turns out
    assert messages[0] == {"role": "system", "content": "System stays."}
    assert [m["content"] for m in messages if m["role"] == "user"] == [
        "First question here?", "Second question here?", "Third question here?"]
    check_exact(conv, model, tokenizer, max_new_tokens=8, dropped_turns=conv.stats.dropped_turns)
    with pytest.raises(ContextOverflowError):  # one message alone too long: refused, nothing dropped
        conv.send("word " * 200, fit_context=True, **GREEDY)
    assert conv.messages == messages


@pytest.mark.parametrize("arch", ARCHS)
def test_shared_system_prompt_is_prefilled_once(make_engine, models, tokenizers, arch):
    model, tokenizer = models[arch], tokenizers[THINKING_TEMPLATE]
    engine = make_engine(arch)
    first = engine.conversation("You are a shared system prompt.")
    list(first.send("Hello!", **GREEDY))
    assert first.stats.shared_prefix_tokens == 0 and len(engine.prefix_store) == 1
    second = engine.conversation("You are a shared system prompt.")
    list(second.send("Hi there, other question.", **GREEDY))
    system_text = tokenizer.apply_chat_template([{"role": "system", "content": "You are a shared system prompt."}],
                                                tokenize=False)
    system_tokens = len(tokenizer(system_text, add_special_tokens=False)["input_ids"])
    assert second.stats.shared_prefix_tokens == system_tokens == second.stats.reused_tokens
    check_exact(second, model, tokenizer, max_new_tokens=8)
    check_exact(first, model, tokenizer, max_new_tokens=8)  # the copy did not disturb the first
    other = engine.conversation("A different system prompt.")
    list(other.send("Hello!", **GREEDY))
    assert other.stats.shared_prefix_tokens == 0
    check_exact(other, model, tokenizer, max_new_tokens=8)


def test_continue_on_a_reply_the_model_ended_is_refused_and_changes_nothing():
    """The trained demo ends its answers itself: Continue then says so and leaves everything as it
    was (it once wrote one more end token, "0 tokens/s · 1 tokens written", and dropped "edited").
    A reply cut off by its length goes on."""
    from chat.demo import demo_folder
    from chat.loading import load_model_and_tokenizer
    from chat import ReplyEndedError
    from chat.dialogue import saved

    model, tokenizer = load_model_and_tokenizer(str(demo_folder()), device="cpu")
    conv = ChatEngine(model, tokenizer).conversation()
    list(conv.send("What is 10 + 10?", max_new_tokens=200, do_sample=False))
    assert conv.history.entries[-1].reply.ended and "20" in conv.messages[-1]["content"]
    before = (saved.to_dict(conv.history), list(conv.session.token_ids), conv.stats)
    with pytest.raises(ReplyEndedError, match="had ended"):
        conv.continue_reply(max_new_tokens=20, do_sample=False)
    assert (saved.to_dict(conv.history), list(conv.session.token_ids), conv.stats) == before
    restored = saved.from_dict(saved.to_dict(conv.history))  # the mark travels with the saved record
    assert restored.entries[-1].reply.ended
    # it thought first: how long travels too (a reload or an import once lost it)
    thought = conv.history.entries[-1].reply.thought_s
    assert conv.messages[-1]["reasoning_content"] and thought is not None and thought >= 0
    assert restored.entries[-1].reply.thought_s == round(thought, 1)
    list(conv.regenerate(max_new_tokens=3, do_sample=False))  # cut off by its length: not ended
    assert not conv.history.entries[-1].reply.ended
    list(conv.continue_reply(max_new_tokens=200, do_sample=False))
    assert conv.history.entries[-1].reply.ended and conv.stats.generated_tokens > 0


@pytest.mark.parametrize("arch", ARCHS)
def test_a_retry_takes_its_first_token_from_the_logits_kept_after_its_prompt(make_engine, models, tokenizers,
                                                                              monkeypatch, arch):
    """A reply's first logits, after its prompt's last token, stay with its cache; a Retry
    keeps the whole prompt and chooses its first token from them with no model step. Where a layer
    keeps earlier states only at checkpoints (sliding windows, recurrent states) none are kept and
    the Retry feeds the prompt's last token again. The kept logits are a from-scratch forward's,
    and the Retry is exact either way; a Retry of the Retry too."""
    model, tokenizer = models[arch], tokenizers[THINKING_TEMPLATE]
    engine = make_engine(arch, draft="off")
    conv = engine.conversation("Be brief.")
    list(conv.send("Tell me about caches.", **GREEDY))
    first, prompt = conv.reply_ids, conv.session.token_ids[:conv.stats.prompt_tokens]
    kept, crops = conv.session.next_logits(prompt), conv.session.crops_anywhere()
    if crops:
        with torch.no_grad():
            scratch = model(torch.tensor([prompt])).logits[0, -1]
        assert kept.shape == (1, scratch.shape[-1]) and (kept[0] - scratch).abs().max().item() < LOGIT_TOLERANCE
    else:
        assert kept is None
    measure = forwards_before_first_token(model, monkeypatch)
    for _ in range(2):
        assert measure(lambda: list(conv.regenerate(**GREEDY))) == [0 if crops else 1]
        assert conv.reply_ids == first
        assert conv.stats.prefilled_tokens == (0 if crops else 1)
        check_exact(conv, model, tokenizer, max_new_tokens=8)
    # another message: the kept logits are not its prompt's, and its first token needs a step
    at_first = measure(lambda: list(conv.send("Next?", **GREEDY)))
    assert len(at_first) == 1 and at_first[0] >= 1
    assert engine.status()["batch"]["first_tokens_kept"] == (2 if crops else 0)  # what /status says
    check_exact(conv, model, tokenizer, max_new_tokens=8)
