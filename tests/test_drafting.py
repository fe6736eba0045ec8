"""Draft-and-verify decoding (chat/scheduling/drafting.py): decode rows feed guessed tokens,
the step verifies them, the cache gives back the ones refused; replies are what they are without.

References are independent of the drafting code: greedy `generate` from scratch on the rendered
prompt and a from-scratch forward over the ledger (`check_exact`), a brute-force scan for the
n-gram lookup, and the same engine with drafting off for seeded sampling.
"""

from __future__ import annotations

import random

import pytest
import torch
from conftest import THINKING_TEMPLATE
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import check_exact, render_ids, scratch_greedy_reply
from test_prepare import wait_until
from tiny_models import SLIDING_WINDOW, scripted_reply_model

import chat.scheduling.drafting
import chat.scheduling.scheduler
import chat.scheduling.step_planner
from chat.scheduling.drafting import DraftPolicy, Drafter, NgramIndex, expected_tokens
from chat.engine import ChatEngine

GREEDY = dict(max_new_tokens=3 * SLIDING_WINDOW, do_sample=False)  # replies cross the tiny window three times


def guess_counts(engine: ChatEngine) -> tuple[int, int]:
    stats = engine.runtime.scheduler.stats()
    return stats.guessed, stats.guesses_taken


def brute_force_after(tokens: list[int], tail: list[int], limit: int) -> list[int]:
    """What followed the latest earlier occurrence of the tail's last 3 (else 2) tokens."""
    for size in (3, 2):
        if len(tail) < size:
            continue
        gram = tail[-size:]
        for start in range(len(tokens) - size - 1, -1, -1):
            if tokens[start:start + size] == gram:
                return tokens[start + size:start + size + limit]
    return []


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 4), max_size=40), st.lists(st.integers(0, 4), max_size=5), st.integers(1, 6))
def test_the_ngram_lookup_finds_what_a_scan_of_the_history_finds(tokens, tail, limit):
    index = NgramIndex(tokens)
    assert index.after(tail, limit)[0] == brute_force_after(tokens, tail, limit)


def test_an_earlier_version_is_guessed_from_while_the_reply_follows_it_then_by_its_ngrams():
    prompt = [1, 2, 3]
    drafter = Drafter(prompt, len(prompt), references=[[7, 8, 9, 10, 11, 12, 13]])
    assert drafter.propose(prompt, 4) == [7, 8, 9, 10]  # the reply so far (nothing) is its prefix
    assert drafter.propose(prompt + [7, 8], 3) == [9, 10, 11]
    assert drafter.propose(prompt + [7, 5, 10, 11], 2) == [12, 13]  # parted: after "10 11" in it
    assert drafter.propose(prompt + [4, 4], 2) == []  # nowhere: neither in it nor in the prompt


@pytest.mark.parametrize("arch,kv_cache", [("full", "dynamic"), ("sliding", "dynamic"), ("mixed", "dynamic"),
                                           ("hybrid", "dynamic"), ("full", "quantized")])
def test_guesses_taken_in_part_leave_the_reply_and_the_cache_as_without(models, tokenizers, monkeypatch, arch,
                                                                          kv_cache):
    """Every step guesses the true greedy continuation with one wrong token: the first, the last,
    one at a random place, or none, in turn; so steps take some guesses and give the rest back
    (all of them, or one): the reply is `generate`'s from scratch and the cache holds what a
    scratch forward over its ledger gives."""
    model, tokenizer = models[arch], tokenizers[THINKING_TEMPLATE]
    engine = ChatEngine(model, tokenizer, draft="ngram", kv_cache=kv_cache)
    conversation = engine.conversation()
    messages = [{"role": "user", "content": "guess this"}]
    prompt = render_ids(tokenizer, messages)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    quantized = engine.config.kv_cache_kind if kv_cache == "quantized" else None
    truth = prompt + scratch_greedy_reply(model, prompt, GREEDY["max_new_tokens"], {end}, kv_cache=quantized)
    chance, turns = random.Random(4), iter(range(10**6))

    def propose(self, sequence, limit):
        right = truth[len(sequence):len(sequence) + limit]
        turn = next(turns) % 4
        if right and turn < 3:
            wrong_at = (0, len(right) - 1, chance.randrange(len(right)))[turn]
            right = right[:wrong_at] + [(right[wrong_at] + 1) % len(tokenizer)] + right[wrong_at + 1:]
        return right

    monkeypatch.setattr(chat.scheduling.drafting.Drafter, "propose", propose)
    list(conversation.send("guess this", **GREEDY))
    guessed, taken = guess_counts(engine)
    assert 0 < taken < guessed  # some taken, some given back
    check_exact(conversation, model, tokenizer, max_new_tokens=GREEDY["max_new_tokens"], kv_cache=quantized)


@pytest.mark.parametrize("arch", ["full", "sliding", "mixed", "hybrid"])
def test_a_greedy_retry_takes_its_earlier_version_as_guesses_in_a_few_steps(make_engine, models, tokenizers, arch):
    """A Retry of a greedy reply is the same reply: guessed from the version it replaces, every
    guess is taken, and the reply takes a step for every 9 tokens, not one a token."""
    engine = make_engine(arch, draft="ngram")
    conversation = engine.conversation()
    list(conversation.send("say it twice", **GREEDY))
    first, steps_before = conversation.messages[-1]["content"], engine.runtime.scheduler.stats().steps
    guessed_before, taken_before = guess_counts(engine)
    list(conversation.regenerate(**GREEDY))
    guessed, taken = guess_counts(engine)
    assert conversation.messages[-1]["content"] == first
    assert taken - taken_before == guessed - guessed_before > 0
    assert engine.runtime.scheduler.stats().steps - steps_before <= -(-len(conversation.reply_ids) // 9) + 1
    check_exact(conversation, models[arch], tokenizers[THINKING_TEMPLATE], max_new_tokens=GREEDY["max_new_tokens"])


def test_a_replys_first_step_guesses_only_from_an_earlier_version(make_engine, monkeypatch):
    """The first token is what the person waits for: a new reply's first step carries no guesses
    from the conversation's n-grams (here a lookup that always has some), its later steps do;
    a Retry's first step guesses from the version it replaces."""
    from chat.model_step.runner import ModelRunner

    # sliding windows: a first token always comes from a step (no logits kept after a prompt)
    engine = make_engine("sliding", draft="ngram")
    conversation = engine.conversation()
    steps: list[list[int]] = []  # each step's count of guesses, per decode row
    run, proposed = ModelRunner.run, chat.scheduling.drafting.Drafter.propose

    def recorded(runner, rows, logits_of, tails=None, eager=False):
        steps.append([tail - 1 for tail in tails or ()])  # logits after its last input and each guess
        return run(runner, rows, logits_of, tails, eager)

    def always(self, sequence, limit):  # the lookup's source, a guess every time
        self.source = "conversation"
        return [7] * limit

    monkeypatch.setattr(ModelRunner, "run", recorded)
    monkeypatch.setattr(chat.scheduling.drafting.Drafter, "propose", always)
    assert conversation.prepare("first", **GREEDY)  # so the reply's first step feeds one token, as a Retry's
    wait_until(lambda: engine.batch_stats().preparing == 0)
    steps.clear()
    list(conversation.send("first", **GREEDY))
    assert conversation.stats.prefilled_tokens == 1
    assert steps[0] == [0] and any(guessed and guessed[0] > 0 for guessed in steps[1:])
    monkeypatch.setattr(chat.scheduling.drafting.Drafter, "propose", proposed)
    steps.clear()
    list(conversation.regenerate(**GREEDY))
    assert steps[0][0] > 0  # a Retry: the earlier version's first tokens, fed at once


def test_an_edited_message_guesses_from_the_answer_it_replaces(tokenizers):
    model = scripted_reply_model(tokenizers[THINKING_TEMPLATE], "the same answer to every question, word for word")
    engine = ChatEngine(model, tokenizers[THINKING_TEMPLATE], draft="ngram")
    conversation = engine.conversation()
    list(conversation.send("first question", max_new_tokens=64))
    before = guess_counts(engine)
    list(conversation.edit(0, "another question", max_new_tokens=64))
    guessed, taken = guess_counts(engine)
    assert taken - before[1] >= len(conversation.reply_ids) - 2  # all but the first and the end token
    assert conversation.messages[-1]["content"] == "the same answer to every question, word for word"


def test_a_seeded_sampled_reply_is_the_same_with_guesses_as_without(models, tokenizers):
    """One draw a token from the same distribution, guessed or not: a Retry under another seed,
    guessing from the first version (taking some guesses, refusing others), gives the reply
    drafting-off gives. (Sliding windows: the Retry's first token comes from a step, which guesses
    the earlier version's first tokens; with full attention it comes from the logits kept after
    the prompt, and a first token drawn otherwise leaves no guess to make.)"""
    replies, counts = {}, {}
    for mode in ("off", "ngram"):
        engine = ChatEngine(models["sliding"], tokenizers[THINKING_TEMPLATE], draft=mode)
        conversation = engine.conversation()
        sampled = dict(max_new_tokens=24, do_sample=True, temperature=0.7, top_k=20)
        list(conversation.send("pick something", seed=1, **sampled))
        list(conversation.regenerate(seed=2, **sampled))
        replies[mode], counts[mode] = conversation.reply_ids, guess_counts(engine)
    assert replies["ngram"] == replies["off"]
    assert counts["off"] == (0, 0) and counts["ngram"][0] > 0


def test_guesses_never_run_a_reply_past_its_token_limit(make_engine, models, tokenizers):
    engine = make_engine("full", draft="ngram")
    conversation = engine.conversation()
    list(conversation.send("long one", **GREEDY))
    list(conversation.regenerate(max_new_tokens=5, do_sample=False))
    assert len(conversation.reply_ids) == 5
    check_exact(conversation, models["full"], tokenizers[THINKING_TEMPLATE], max_new_tokens=5)


def test_recurrent_states_go_back_to_the_steps_start_and_feed_again_what_it_took(make_engine, models, tokenizers,
                                                                                 monkeypatch):
    """A linear-attention layer folds every guess in and cannot crop them out: a step with
    guesses keeps the states it began from; where a guess is refused the cache goes back there
    and the next step feeds again what the step took, before its next input. Each guess here is
    right but the last: the reply is `generate`'s, the cache a scratch forward's, and every step
    after a refusal fed the tokens taken again."""
    engine = make_engine("hybrid", draft="ngram")
    model, tokenizer = models["hybrid"], tokenizers[THINKING_TEMPLATE]
    conversation = engine.conversation()
    prompt = render_ids(tokenizer, [{"role": "user", "content": "recurrent"}])
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    truth = prompt + scratch_greedy_reply(model, prompt, GREEDY["max_new_tokens"], {end})

    def propose(self, sequence, limit):
        right = truth[len(sequence):len(sequence) + min(limit, 3)]
        return right[:-1] + [(right[-1] + 1) % len(tokenizer)] if right else right

    fed_again = []
    own_apply = chat.scheduling.step_planner.StepPlanner.apply

    def apply(self, plan):
        running = own_apply(self, plan)
        fed_again.extend(len(request.unfed) - 1 for request in running.decoding)
        return running

    monkeypatch.setattr(chat.scheduling.drafting.Drafter, "propose", propose)
    monkeypatch.setattr(chat.scheduling.step_planner.StepPlanner, "apply", apply)
    list(conversation.send("recurrent", **GREEDY))
    guessed, taken = guess_counts(engine)
    assert 0 < taken < guessed
    # the step's first input and its two right guesses fed again, in a step that guesses nothing
    # (a refusal there would go back before them too), then guesses again
    assert max(fed_again) == 3 and fed_again.count(3) >= 3 and fed_again.count(0) >= 3
    check_exact(conversation, model, tokenizer, max_new_tokens=GREEDY["max_new_tokens"])


def test_a_stop_in_a_step_with_guesses_leaves_the_cache_at_the_reply(make_engine, models, tokenizers, monkeypatch):
    """Stopped at its third token, in a step that fed 9 (guessed from the version it replaces):
    the reply is those three and the cache gives back the rest."""
    engine = make_engine("sliding", draft="ngram")
    conversation = engine.conversation()
    list(conversation.send("stop me", **GREEDY))
    emit = chat.scheduling.scheduler.GenerationRequest._emit

    def emit_then_stop(request, token_id):
        emit(request, token_id)
        if request.token_count == 3:
            request.stop.set()

    monkeypatch.setattr(chat.scheduling.scheduler.GenerationRequest, "_emit", emit_then_stop)
    list(conversation.regenerate(**GREEDY))
    assert len(conversation.reply_ids) == 3 and guess_counts(engine)[0] > 0
    check_exact(conversation, models["sliding"], tokenizers[THINKING_TEMPLATE], max_new_tokens=3, stopped=True)


def test_auto_guesses_where_they_pay_and_not_where_they_are_refused():
    policy = DraftPolicy("auto")
    assert policy.length(0.9, 1, compiled=False) == 0  # a plain step is timed first
    for _ in range(3):
        policy.record_step(0.010, 1, 0)
    assert policy.length(0.9, 1, compiled=False) == policy.max_draft  # untimed lengths are tried
    for tokens in (1, 2, 4, 8):
        for _ in range(3):
            policy.record_step(0.010 + 0.002 * tokens, 1, tokens)
    assert policy.length(0.02, 1, compiled=False) == 0
    best = policy.length(0.9, 1, compiled=False)
    assert best > 0 and expected_tokens(0.9, best) / (0.010 + 0.002 * best) > 1 / 0.010
    assert DraftPolicy("off").length(1.0, 1, compiled=False) == 0
    # a row that feeds again what a refused step took (recurrent states) guesses less, and only
    # where the expected tokens still pay for that too
    for acceptance in (0.3, 0.5, 0.7, 0.9):
        again = policy.length(acceptance, 1, compiled=False, feeds_again=True)
        assert again <= policy.length(acceptance, 1, compiled=False)
    for acceptance in (0.3, 0.9):  # (here 1 guess against none, 8 against 4)
        assert policy.length(acceptance, 1, compiled=False, feeds_again=True) < policy.length(acceptance, 1,
                                                                                               compiled=False)
    assert policy.length(0.999, 1, compiled=False, feeds_again=True) == policy.max_draft  # nearly never refused


def test_auto_guesses_beside_a_compiled_step_only_where_they_beat_it():
    policy = DraftPolicy("auto")
    policy.record_step(0.004, 1, 0, compiled=True)
    assert policy.length(0.99, 1, compiled=True) == 0  # the eager step's cost is unknown: the graph serves
    for tokens in (0, 1, 2, 4, 8):
        policy.record_step(0.010 + 0.001 * tokens, 1, tokens)
    assert policy.length(0.99, 1, compiled=True) > 0  # ~8 tokens in 18 ms against one in 4 ms
    assert policy.length(0.3, 1, compiled=True) == 0  # ~1.4 tokens in 11-12 ms: the graph wins


def test_where_a_graph_serves_from_the_start_one_eager_step_is_timed_for_guesses():
    policy = DraftPolicy("auto")
    policy.record_step(0.004, 1, 0, compiled=True)
    assert policy.times_eager_first(1, compiled=True) and not policy.times_eager_first(1, compiled=False)
    policy.record_step(0.010, 1, 0)  # that step, eager
    assert not policy.times_eager_first(1, compiled=True) and policy.times_eager_first(2, compiled=True)
    assert policy.length(0.99, 1, compiled=True) > 0  # an untimed length is tried: the graph's one in 4 ms
    assert not DraftPolicy("ngram").times_eager_first(1, compiled=True)
    assert not DraftPolicy("off").times_eager_first(1, compiled=True)


class ReadyGraph:
    """A compiled graph for one row that serves from the engine's first step (one loaded from
    disk at start), standing in for chat/model_step/compiled.py: it runs the same plain step."""

    enabled, steps = True, 0

    def __init__(self, model):
        self.model = model

    def bucket(self, rows: int) -> int | None:
        return 1 if rows == 1 else None

    def takes(self, rows, logits_of) -> bool:
        return len(rows) == 1 and len(rows[0][1]) == 1 and list(logits_of) == [0]

    def step(self, rows):
        from chat.model_step.plain_step import run_plain

        self.steps += 1
        return run_plain(self.model, rows, [0])


def test_a_retry_guesses_where_a_compiled_graph_served_from_the_first_step(make_engine, models, tokenizers):
    """With a graph taking every one-row step from the first (loaded from disk at start), "auto"
    never timed an eager step, so it never fed a guess: a greedy Retry at Qwen3-0.6B's shape, int8,
    decoded at the graph's speed (35 tokens a second against 130-160 where the graph came later).
    Now one step runs eagerly, is timed, and the Retry takes the guesses from the version it
    replaces; the reply is the same, and exact."""
    engine = make_engine("full", draft="auto")
    graph = ReadyGraph(models["full"])
    engine.runtime.scheduler.runner.compiled = graph
    conversation = engine.conversation("You are terse.")
    options = dict(max_new_tokens=24, do_sample=False)
    list(conversation.send("Tell me a story about guesses.", **options))
    first, graph_steps = list(conversation.reply_ids), graph.steps
    assert graph_steps > 0 and guess_counts(engine) == (0, 0)  # a first reply: nothing to guess from
    list(conversation.regenerate(**options))
    guessed, taken = guess_counts(engine)
    assert conversation.reply_ids == first and taken == guessed > 0
    check_exact(conversation, models["full"], tokenizers[THINKING_TEMPLATE], max_new_tokens=24)


@pytest.mark.parametrize("arch", ["full", "sliding"])
def test_with_int8_weights_a_greedy_reply_with_guesses_is_the_reply_without(tokenizers, arch):
    """Int8 products round to bf16, so a step that verified guesses in one attention call could move
    a near-tie that decoding one token a step would not; guesses attend one by one instead, with
    the bits of decode steps (tests/test_plain_step.py holds the step to that). Through the engine:
    a reply and its greedy Retry are, token for token, what the same model with drafting off
    gives, the Retry takes every guess from the version it replaces, and each token is within the
    int8 model's bound of a from-scratch forward."""
    from reference import int8_logit_tolerance
    from tiny_models import wide_heads_model

    tokenizer = tokenizers[THINKING_TEMPLATE]
    replies = {}
    for draft in ("off", "ngram"):
        model = wide_heads_model(arch, len(tokenizer), tokenizer.convert_tokens_to_ids("<|im_end|>"))
        engine = ChatEngine(model, tokenizer, draft=draft, weights="int8")
        conversation = engine.conversation()
        list(conversation.send("int8 guesses", **GREEDY))
        first, (guessed_before, taken_before) = list(conversation.reply_ids), guess_counts(engine)
        list(conversation.regenerate(**GREEDY))
        replies[draft] = [first, list(conversation.reply_ids)]
    guessed, taken = guess_counts(engine)
    assert replies["ngram"] == replies["off"] and replies["ngram"][1] == replies["ngram"][0]
    assert taken - taken_before == guessed - guessed_before > 0
    check_exact(conversation, model, tokenizer, max_new_tokens=GREEDY["max_new_tokens"], near_greedy=True,
                logit_tolerance=int8_logit_tolerance(model))


PROMPTS = ["Tell me about caches.", "What rolls back?", "A branch, then another.", "Edit the second turn.",
           "Undo twice, then retry.", "Why does the window slide?", "Count to twelve slowly.", "Stop here and go on."]


@pytest.mark.parametrize("dtype,kv_cache", [(torch.float32, "dynamic"), (torch.bfloat16, "dynamic"),
                                            (torch.float32, "quantized")])
def test_guesses_never_change_a_greedy_reply_at_real_head_width(tokenizers, dtype, kv_cache):
    """A two-layer Qwen3 with heads 128 wide: a greedy Retry with guesses ("auto", and "ngram",
    which guesses whenever it can) is the reply without them, for eight prompts, with full-precision
    states and with the quantized cache. In bf16 a row of several guessed tokens sums its products
    in another order than a token alone (2-3 of 8 Retries went another way), so there no guess is
    fed and /status says why; in fp32 guesses are fed and taken."""
    from tiny_models import wide_heads_model

    tokenizer = tokenizers[THINKING_TEMPLATE]
    model = wide_heads_model("full", len(tokenizer), tokenizer.convert_tokens_to_ids("<|im_end|>"), layers=2)
    model = model.to(dtype)
    replies: dict[str, list[list[int]]] = {}
    for draft in ("off", "auto", "ngram"):
        engine = ChatEngine(model, tokenizer, draft=draft, compile="off", kv_cache=kv_cache)
        replies[draft] = []
        for prompt in PROMPTS:
            conversation = engine.conversation()
            list(conversation.send(prompt, **GREEDY))
            list(conversation.regenerate(**GREEDY))
            replies[draft].append(list(conversation.reply_ids))
        guessed, taken = guess_counts(engine)
        off_because = engine.status()["guessing"]["off_because"]
        if dtype == torch.bfloat16:
            assert guessed == 0 and "bfloat16 products" in off_because
        elif draft == "ngram":
            assert off_because is None and taken > 0
    assert replies["auto"] == replies["off"] and replies["ngram"] == replies["off"]
