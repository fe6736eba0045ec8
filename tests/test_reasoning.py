"""Reasoning: split while streaming, stored apart, given to the template the way it expects."""

import pytest

from chat.dialogue.reasoning import ReasoningSplitter
from chat.dialogue.templates import ChatTemplate
from conftest import THINKING_TEMPLATE, tokenizer_with_template
from reference import cached_vs_scratch_logit_error, check_exact, render_ids, scratch_greedy_reply
from tiny_models import ARCHS


def split(chunks, starts_in_reasoning=False):
    splitter = ReasoningSplitter(starts_in_reasoning)
    deltas = [d for chunk in chunks for d in splitter.feed(chunk)] + splitter.finish()
    reasoning = "".join(d.text for d in deltas if d.kind == "reasoning")
    answer = "".join(d.text for d in deltas if d.kind == "answer")
    return reasoning, answer, splitter.message_fields()


@pytest.mark.parametrize("chunks", [
    ["<think>\nadd two and two\n</think>\n\nIt is 4."],
    ["<th", "ink>\nadd two", " and two\n</th", "ink>\n\nIt is 4."],
    list("<think>\nadd two and two\n</think>\n\nIt is 4."),
])
def test_tags_split_across_chunks(chunks):
    reasoning, answer, (content, reasoning_content) = split(chunks)
    assert reasoning == "\nadd two and two\n"
    assert answer == "\n\nIt is 4."
    assert (content, reasoning_content) == ("It is 4.", "add two and two")


def test_generation_prompt_already_opened_the_block():
    reasoning, answer, fields = split(["hmm, four", "</think>\n\nFour."], starts_in_reasoning=True)
    assert (reasoning, answer) == ("hmm, four", "\n\nFour.")
    assert fields == ("Four.", "hmm, four")


def test_think_tag_later_in_the_answer_is_plain_text():
    _, answer, fields = split(["The tag <think> is ", "just text here."])
    assert answer == "The tag <think> is just text here."
    assert fields == (answer, "")


def test_reply_cut_inside_reasoning_keeps_it_as_reasoning():
    reasoning, answer, fields = split(["<think>\nstill thinking</th"])
    assert reasoning == "\nstill thinking</th" and answer == ""
    assert fields == ("", "still thinking</th")


def test_plain_reply_is_kept_byte_for_byte():
    assert split(["  spaced\n reply \n"])[2] == ("  spaced\n reply \n", "")


HISTORY = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "It is 4.", "reasoning_content": "add two and two"},
    {"role": "user", "content": "And 3+3?"},
]


def test_reasoning_goes_where_the_template_reads_it(base_tokenizer):
    qwen3 = ChatTemplate(tokenizer_with_template(base_tokenizer, "qwen3"))
    plain = ChatTemplate(tokenizer_with_template(base_tokenizer, "qwen2_5"))
    assert qwen3.reads_reasoning_content and not plain.reads_reasoning_content
    assert qwen3.template_messages(HISTORY)[1]["reasoning_content"] == "add two and two"
    assert "reasoning_content" not in plain.template_messages(HISTORY)[1]
    # Qwen3 drops reasoning of turns before the last user message; a plain template never sees it.
    assert "add two and two" not in qwen3.render(HISTORY).text
    assert "add two and two" not in plain.render(HISTORY).text
    # ...but Qwen3 keeps it for a reply after the last user message.
    kept = qwen3.tokenizer.decode(qwen3.render_history(HISTORY[:2]))
    assert "<think>\nadd two and two\n</think>" in kept


def test_enable_thinking_is_passed_to_the_template(base_tokenizer):
    qwen3 = ChatTemplate(tokenizer_with_template(base_tokenizer, "qwen3"))
    assert qwen3.render(HISTORY, enable_thinking=False).text.endswith("<think>\n\n</think>\n\n")
    assert not qwen3.render(HISTORY, enable_thinking=False).opens_reasoning
    qwq = ChatTemplate(tokenizer_with_template(base_tokenizer, "qwq"))
    assert qwq.render(HISTORY).opens_reasoning


@pytest.mark.parametrize("arch", ARCHS)
def test_reply_inside_an_opened_block_is_stripped_and_stays_exact(models, base_tokenizer, arch):
    """QwQ's prompt opens <think>: the whole (random) reply is reasoning, the template drops it."""
    from chat import ChatEngine

    tokenizer = tokenizer_with_template(base_tokenizer, "qwq")
    conv = ChatEngine(models[arch], tokenizer).conversation()
    deltas = list(conv.send("First?", max_new_tokens=10, do_sample=False))
    assert deltas and all(d.kind == "reasoning" for d in deltas)
    assert conv.messages[-1]["content"] == "" and conv.messages[-1]["reasoning_content"]
    check_exact(conv, models[arch], tokenizer, max_new_tokens=10)
    first_prompt_tokens = conv.stats.prompt_tokens
    list(conv.send("Second?", max_new_tokens=10, do_sample=False))
    check_exact(conv, models[arch], tokenizer, max_new_tokens=10)
    # The stripped reply is gone from the prompt: the cache rolled back to where it began.
    assert conv.stats.reused_tokens <= first_prompt_tokens


@pytest.mark.parametrize("arch", ARCHS)
def test_think_block_is_split_stored_apart_and_dropped_from_history_exactly(models, tokenizers, arch):
    from chat import ChatEngine
    from tiny_models import with_scripted_think_block

    tokenizer = tokenizers[THINKING_TEMPLATE]
    model = with_scripted_think_block(models[arch], tokenizer)
    conv = ChatEngine(model, tokenizer).conversation()
    deltas = list(conv.send("Why?", max_new_tokens=10, do_sample=False))
    kinds = [d.kind for d in deltas]
    assert kinds[:2] == ["reasoning", "reasoning"] and set(kinds[2:]) == {"answer"}
    reply = conv.messages[-1]
    assert reply["reasoning_content"] == " reason" and "<think>" not in reply["content"]
    check_exact(conv, model, tokenizer, max_new_tokens=10)
    first_prompt = conv.stats.prompt_tokens
    list(conv.send("And then?", max_new_tokens=10, do_sample=False))
    check_exact(conv, model, tokenizer, max_new_tokens=10)
    # Qwen3 renders the earlier reply without its reasoning: the cache went back to its start.
    assert conv.stats.reused_tokens <= first_prompt
    assert "reason\n</think>" not in tokenizer.decode(conv.session.token_ids[:first_prompt + 5])
    for operation in (lambda: conv.regenerate(max_new_tokens=10, do_sample=False),
                      lambda: conv.edit(0, "Why not?", max_new_tokens=10, do_sample=False)):
        list(operation())
        check_exact(conv, model, tokenizer, max_new_tokens=10)
        assert conv.messages[-1]["reasoning_content"] == " reason"


def test_template_without_a_system_role_gets_it_in_the_first_user_turn(models, base_tokenizer):
    """Gemma's template raises on a system message: it goes into the first user message instead."""
    from chat import ChatEngine

    tokenizer = tokenizer_with_template(base_tokenizer, "gemma")
    engine = ChatEngine(models["mixed"], tokenizer)
    assert not engine.template.accepts_system
    conv = engine.conversation("Answer in French.")
    list(conv.send("Hello?", max_new_tokens=8, do_sample=False))
    assert conv.messages[0] == {"role": "system", "content": "Answer in French."}
    assert "<start_of_turn>user\nAnswer in French.\n\nHello?" in engine.template.render(conv.messages[:-1]).text
    list(conv.send("Again?", max_new_tokens=8, do_sample=False))
    list(conv.regenerate(max_new_tokens=8, do_sample=False))
    assert conv.stats.prefilled_tokens == (0 if conv.session.crops_anywhere() else 1)
    # exact against the same merged history rendered by the template itself, from scratch
    merged = [{"role": "user", "content": "Answer in French.\n\nHello?"}] + conv.messages[2:]
    for message in merged:
        message.pop("reasoning_content", None)
    prompt = render_ids(tokenizer, merged[:-1])
    assert conv.reply_ids == scratch_greedy_reply(models["mixed"], prompt, 8, {tokenizer.eos_token_id})
    assert cached_vs_scratch_logit_error(models["mixed"], conv.session.cache, conv.session.token_ids, 7) < 1e-4


def test_a_stray_close_tag_in_an_answer_stays_literal(base_tokenizer):
    """Found by the property test: an answer that contains "</think>" must be re-rendered as
    generated, not split by the template into reasoning and answer."""
    qwen3 = ChatTemplate(tokenizer_with_template(base_tokenizer, "qwen3"))
    history = [{"role": "user", "content": "Hi"},
               {"role": "assistant", "content": "</think> literal text", "reasoning_content": ""},
               {"role": "user", "content": "Again"}]
    assert "<|im_start|>assistant\n</think> literal text<|im_end|>" in qwen3.render(history).text
