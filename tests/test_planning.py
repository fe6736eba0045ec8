"""Planning a reply to a history too long for the context (chat/dialogue/fitting.py): the prompt is the
template's own rendering of the kept messages, the turns left out are the fewest that bring the
prompt within `REFIT_SHARE` of the room once any must go (the same as dropping one oldest turn at
a time and rendering everything again, the old quadratic way, done here from scratch with
`apply_chat_template`), and the work is bounded by the context, not by the history. Checked on
every fixture template, on both ways through the fitting."""

import random

import pytest

import chat.dialogue.fitting
from chat import ChatEngine, ContextOverflowError, GenerationOptions, Send
from chat.errors import PlanningCancelled
from chat.dialogue.history import History, ReplyVersion
from chat.dialogue.plans import Planner
from chat.dialogue.templates import ChatTemplate
from conftest import tokenizer_with_template
from reference import render_ids

TEMPLATES = ["qwen3", "qwen2_5", "qwq", "gemma", "llama3", "mistral", "phi", "smollm3"]
WORDS = "the cache rolls back to where the prompt parts from it and prefills only the rest".split()


def history_of(turns: list[tuple[str, str]], system: str | None) -> History:
    history = History(system)
    for question, answer in turns:
        path = history.entries + [history.node("user", question)]
        history.record_reply(path, history.node("assistant"), ReplyVersion(answer, "", None, None, False, False))
    return history


def random_turns(rng: random.Random, count: int, longest: int) -> list[tuple[str, str]]:
    def text() -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, longest)))

    return [(text() + "?", text() + ".") for _ in range(count)]


def quadratic_reference(tokenizer, messages: list[dict], limit: int, max_new: int) -> tuple[list[dict], list[int], int]:
    """The old way: while it does not fit, drop the oldest user turn and render everything again;
    once one must go, down to `REFIT_SHARE` of the room where the newest turn alone fits that."""
    kept, ids, dropped = quadratic_fewest(tokenizer, messages, limit, max_new)
    if not dropped:
        return kept, ids, dropped
    try:
        return quadratic_fewest(tokenizer, messages, max_new + int((limit - max_new) * chat.dialogue.fitting.REFIT_SHARE),
                                max_new)
    except ContextOverflowError:
        return kept, ids, dropped


def quadratic_fewest(tokenizer, messages: list[dict], limit: int, max_new: int) -> tuple[list[dict], list[int], int]:
    messages, dropped = list(messages), 0
    while True:
        ids = render_ids(tokenizer, messages)
        if len(ids) + max_new <= limit:
            return messages, ids, dropped
        users = [i for i, m in enumerate(messages) if m["role"] == "user"]
        if len(users) < 2:
            raise ContextOverflowError("too long", prompt_tokens=len(ids), max_new_tokens=max_new, context_limit=limit)
        del messages[users[0]:users[1]]
        dropped += 1


@pytest.mark.parametrize("way", ["estimate", "render whole"])
@pytest.mark.parametrize("template_name", TEMPLATES)
def test_the_fewest_oldest_turns_are_dropped_and_the_prompt_is_the_templates_own(base_tokenizer, template_name, way,
                                                                                  monkeypatch):
    monkeypatch.setattr(chat.dialogue.fitting, "QUICK_CHARS_PER_TOKEN", 0 if way == "estimate" else 10**9)
    tokenizer = tokenizer_with_template(base_tokenizer, template_name)
    template = ChatTemplate(tokenizer)
    rng = random.Random(template_name)
    checked = dropped_somewhere = 0
    for case in range(6):
        turns = random_turns(rng, rng.randint(2, 9), longest=rng.choice([3, 12, 40]))
        system = "Be brief." if template.accepts_system and case % 2 == 0 else None
        history = history_of(turns[:-1], system)
        question = turns[-1][0]
        full = render_ids(tokenizer, history.messages + [{"role": "user", "content": question}])
        for limit in sorted({len(full) + 4, len(full) * 3 // 4 + 4, len(full) // 2 + 4, len(full) // 4 + 4}):
            options = GenerationOptions(max_new_tokens=4)
            try:
                kept, ids, dropped = quadratic_reference(
                    tokenizer, history.messages + [{"role": "user", "content": question}], limit, 4)
            except ContextOverflowError:
                with pytest.raises(ContextOverflowError):
                    Planner(template, limit).plan(Send(question, fit_context=True), history, options, 0)
                continue
            plan = Planner(template, limit).plan(Send(question, fit_context=True), history, options, 0)
            assert plan.request.prompt_ids == ids, (template_name, case, limit)
            assert plan.dropped_turns == dropped and plan.request.messages == kept
            checked += 1
            dropped_somewhere += dropped > 0
    assert checked >= 12 and dropped_somewhere >= 6


def long_saved_history(turns: int, chars: int, system: bool = True) -> dict:
    """A flat saved conversation (the browser's or an Import's format) of `turns` turns, `chars` in
    all (a path may be 500 messages deep: 250 turns leave no room for a system prompt)."""
    each = chars // (2 * turns)
    rng = random.Random(7)
    messages = [{"parent": None, "role": "system", "content": "Be brief.", "shown": 0}] if system else []
    for turn in range(turns):
        for role in ("user", "assistant"):
            text = " ".join(rng.choice(WORDS) for _ in range(each // 5))[:each].ljust(each, ".")
            messages.append({"parent": len(messages) - 1 if messages else None, "role": role, "content": text,
                             "shown": 0,
                             **({"reasoning_content": "", "stopped": False, "edited": False} if role == "assistant"
                                else {})})
    messages[-1]["shown"] = None
    return {"format": "rewind-chat.conversation", "version": 1, "messages": messages, "shown": 0}


def test_a_two_million_character_history_costs_what_the_context_holds(models, tokenizers, monkeypatch):
    """250 turns, 2,000,000 characters, restored: one Send renders and tokenizes a few tens of
    thousands of characters (the old way rendered and tokenized all of it once per dropped
    turn), its prompt is the template's own rendering of the kept turns, and the reply is exact."""
    engine = ChatEngine(models["full"], tokenizers["qwen3"])
    conv = engine.restore(long_saved_history(250, 2_000_000, system=False))
    assert sum(len(m["content"]) for m in conv.messages) >= 1_990_000
    seen = {"rendered": 0, "tokenized": 0}
    render_text, encode_many = ChatTemplate.render_text, ChatTemplate.encode_many

    def counted_render(self, messages, **kwargs):
        text = render_text(self, messages, **kwargs)
        seen["rendered"] += len(text)
        return text

    def counted_encode(self, texts):
        seen["tokenized"] += sum(map(len, texts))
        return encode_many(self, texts)

    monkeypatch.setattr(ChatTemplate, "render_text", counted_render)
    monkeypatch.setattr(ChatTemplate, "encode_many", counted_encode)
    monkeypatch.setattr(ChatTemplate, "encode", lambda self, text: counted_encode(self, [text])[0])
    plan = conv.plan(Send("And now a short question?", fit_context=True), GenerationOptions(max_new_tokens=8))
    monkeypatch.undo()
    assert seen["tokenized"] < 120_000 and seen["rendered"] < 200_000, seen
    assert plan.dropped_turns > 200
    question = {"role": "user", "content": "And now a short question?"}
    assert plan.request.prompt_ids == render_ids(tokenizers["qwen3"], plan.request.messages)
    k = plan.dropped_turns  # turns 0..k-1 left out: the one before the kept ones is messages[2k-2:2k]
    wider = render_ids(tokenizers["qwen3"], conv.messages[2 * k - 2:2 * k] + plan.request.messages)
    share = int((engine.context_limit - 8) * chat.dialogue.fitting.REFIT_SHARE)  # once any must go: the fewest for this
    assert len(wider) > share >= len(plan.request.prompt_ids)
    assert plan.request.messages[-1] == question
    stream = conv.start(Send("And now a short question?", fit_context=True), GenerationOptions(max_new_tokens=8))
    list(stream)
    assert conv.stats.dropped_turns == plan.dropped_turns and conv.stats.prompt_tokens == len(plan.request.prompt_ids)


def test_planning_is_counted_while_it_runs_and_stops_when_its_caller_leaves(make_engine):
    engine = make_engine("full", context_limit=256)
    conv = engine.restore(long_saved_history(40, 40_000))
    before, seen = conv.to_dict(), []

    def gone() -> bool:
        seen.append(engine.planner.planning)
        return len(seen) > 3

    with pytest.raises(PlanningCancelled):
        conv.start(Send("A question?", fit_context=True), GenerationOptions(max_new_tokens=8), cancelled=gone)
    assert seen and set(seen) == {1} and engine.planner.planning == 0
    assert conv.to_dict() == before and not conv.is_busy
    assert engine.status()["planning"] == 0


def test_a_snapshot_mid_reply_holds_when_older_turns_were_dropped(make_engine):
    """Once a conversation outgrows the context, the page's draft snapshot of a
    reply whose plan dropped older turns raised (the copied replies lost their versions), so
    every Send from the page failed. The snapshot is the tree as a stop there leaves it: the
    kept turns copied under the system prompt with their replies, the reply so far last."""
    engine = make_engine("full", context_limit=256)
    conv = engine.restore(long_saved_history(30, 30 * 2 * 300))
    stream = iter(conv.send("A short question?", fit_context=True, max_new_tokens=20, do_sample=False))
    next(stream)
    assert conv.is_running
    snapshot = conv.snapshot()
    shown = [snapshot["messages"][i] for i in snapshot["path"]]
    list(stream)
    final = conv.to_dict()
    assert conv.stats.dropped_turns > 0
    assert [m["content"] for m in shown[:-1]] == [final["messages"][i]["content"] for i in final["path"][:-1]]
    assert all("reasoning_content" in m for m in shown if m["role"] == "assistant")
    assert shown[-1]["role"] == "assistant" and shown[-1]["stopped"]
    assert engine.restore(snapshot).messages[:-1] == conv.messages[:-1]  # the draft restores


def test_many_short_turns_are_planned_in_a_few_renders(models, tokenizers, monkeypatch):
    """A history of many short messages, under `room x 8` characters but over the
    room in tokens, was rendered again for each dropped turn (212 renders for 249 turns; 5-26 CPU
    s a Send). Now the cut comes from the measured sizes there too: a few renders, and still the
    fewest turns dropped and the template's own prompt."""
    engine = ChatEngine(models["full"], tokenizers["qwen3"])
    conv = engine.restore(long_saved_history(249, 249 * 2 * 20, system=False))
    assert sum(len(m["content"]) for m in conv.messages) < (engine.context_limit - 8) * 8  # the quick path's side
    renders = []
    render_text = ChatTemplate.render_text
    monkeypatch.setattr(ChatTemplate, "render_text",
                        lambda self, messages, **kwargs: (renders.append(1), render_text(self, messages, **kwargs))[1])
    plan = conv.plan(Send("And now a short question?", fit_context=True), GenerationOptions(max_new_tokens=8))
    monkeypatch.undo()
    assert plan.dropped_turns > 100 and len(renders) <= 16, (plan.dropped_turns, len(renders))  # two fits: room, share
    assert plan.request.prompt_ids == render_ids(tokenizers["qwen3"], plan.request.messages)
    k = plan.dropped_turns
    wider = render_ids(tokenizers["qwen3"], conv.messages[2 * k - 2:2 * k] + plan.request.messages)
    share = int((engine.context_limit - 8) * chat.dialogue.fitting.REFIT_SHARE)  # once any must go: the fewest for this
    assert len(wider) > share >= len(plan.request.prompt_ids)
