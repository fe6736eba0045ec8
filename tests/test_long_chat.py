"""A conversation that outgrows the model's context goes on for ever, and
its turns past the context mostly reuse the cache (chat/dialogue/fitting.py: the cut is kept while it fits).

Before, each trimmed turn copied the kept turns under the system prompt as a new branch, and the
32nd was refused ("this message already has 32 versions"). Every reply here is checked against
an independent reference: the template's rendering, from scratch, of the system prompt and the
turns after the cut, and greedy decoding of that prompt from scratch."""

import random

import pytest
from reference import check_states, render_ids, scratch_greedy_reply, without_oldest_turns

from chat import Regenerate
from chat.dialogue.options import GenerationOptions

CONTEXT, MAX_NEW = 1024, 24
WORDS = "the cache rolls back to where the prompt parts from it and prefills only the rest".split()


def message(rng: random.Random, tokenizer, tokens: int) -> str:
    text = ""
    while len(tokenizer(text)["input_ids"]) < tokens:
        text += rng.choice(WORDS) + " "
    return text.strip() + "?"


@pytest.mark.parametrize("arch", ["full", "sliding"])
def test_a_chat_far_past_the_context_answers_every_turn_exactly_and_mostly_from_the_cache(
        make_engine, models, tokenizers, arch):
    tokenizer = tokenizers["qwen3"]
    engine = make_engine(arch, context_limit=CONTEXT)
    conv = engine.conversation("You are terse.")
    rng, eos = random.Random(arch), {tokenizer.convert_tokens_to_ids("<|im_end|>")}
    past, prefilled, turns = 0, [], 45
    for turn in range(turns):
        list(conv.send(message(rng, tokenizer, 150), fit_context=True, max_new_tokens=MAX_NEW, do_sample=False))
        stats = conv.stats
        assert conv.messages[-1]["role"] == "assistant" and len(conv.messages) == 1 + 2 * (turn + 1)
        if stats.dropped_turns:
            past += 1
            prefilled.append(stats.prefilled_tokens)
        if turn % 7 == 6 or turn == turns - 1:  # the reference is slow: every 7th turn and the last
            prompt = render_ids(tokenizer, without_oldest_turns(conv.messages[:-1], stats.dropped_turns))
            assert stats.prompt_tokens == len(prompt) and len(prompt) + MAX_NEW <= CONTEXT
            assert conv.reply_ids == scratch_greedy_reply(models[arch], prompt, MAX_NEW, eos)
            check_states(models[arch], conv.session.cache, conv.session.token_ids)
    assert past >= 30  # well past the 32nd trimmed turn
    # one branch all along: the whole conversation stays shown, nothing copied
    assert all(count == 1 for count in (len(node.children) for node in conv.history.nodes()[:-1]))
    # most turns past the context reuse the cache: the cut moves in blocks, not every turn
    mean = sum(prefilled) / len(prefilled)
    print(f"{arch}: {past} of {turns} turns past the context; prefilled per turn there: mean {mean:.0f} "
          f"({mean / CONTEXT:.2f}x the context), each: {prefilled}")
    assert mean <= 0.3 * CONTEXT, (mean, prefilled)  # the target: 0.3x
    # a Retry past the context keeps its reply's cut: its prompt is the cache's, nothing prefilled
    dropped = conv.stats.dropped_turns
    list(conv.start(Regenerate(), GenerationOptions(max_new_tokens=MAX_NEW, do_sample=False)))
    assert conv.stats.dropped_turns == dropped and conv.stats.prefilled_tokens <= 1
    assert conv.versions == (1, 2)


def test_a_hundred_turns_past_the_context_through_the_page_are_all_answered(make_engine, tokenizers, monkeypatch):
    """The attack's case through the page's own handler (Send fits the context): every turn is
    answered, the conversation stays one branch and the person is told once per cut, not per turn."""
    from ui.directory import ChatDirectory
    from ui.handlers import ChatHandlers
    from ui.outputs import Settings

    import ui.replies

    told = []
    monkeypatch.setattr(ui.replies.gr, "Warning", lambda text, *a, **k: told.append(text))
    engine = make_engine("full", context_limit=512)
    handlers = ChatHandlers(engine, ChatDirectory(engine))
    settings = Settings(system_prompt="S.", max_new_tokens=16, temperature=0.0).values()
    rng, key, past = random.Random(3), None, 0
    for turn in range(130):
        outputs = list(handlers.send(None, message(rng, tokenizers["qwen3"], 60), key, *settings))
        key = next((output.key for output in outputs if isinstance(output.key, str)), key)
        conv = handlers.directory.find(key).conversation
        assert conv.messages[-1]["role"] == "assistant" and len(conv.messages) == 2 * turn + 3
        past += conv.stats.dropped_turns > 0
    assert past >= 100
    assert all(len(node.children) == 1 for node in conv.history.nodes()[:-1])
    cuts = [text for text in told if "longer than the model's context" in text]
    assert 0 < len(cuts) < past / 2, (len(cuts), past)  # told when the cut moves, not at every turn
