"""Replies of several conversations decode together, each exactly as it would alone.

References are independent of the scheduler: greedy `generate` from scratch on the re-rendered
prompt and a from-scratch forward over each ledger (`check_exact`), and for sampling a plain
loop over from-scratch forwards with hand-built transformers warpers and a seeded generator.
Timing is controlled, never slept on: a job on the compute thread holds the scheduler between
steps, and a logits processor can hold it inside a chosen step of a chosen reply.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from conftest import THINKING_TEMPLATE, on_model_input
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reference import check_exact, int8_logit_tolerance, render_ids
from tiny_models import ARCHS, build_model
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

import chat.model_step.runner
import chat.scheduling.scheduler
import chat.scheduling.request_stages
from chat import ChatEngine, ConversationBusyError, ConversationError
from chat.model_step.runner import ModelRunner
from chat.scheduling.sampling import TokenChooser
from chat.scheduling.step_budget import StepBudget

MAX_NEW = 10
GREEDY = dict(max_new_tokens=MAX_NEW, do_sample=False)
FAILS_AT_THIRD_TOKEN = 9  # max_new_tokens values that mark a reply for a hook (see `hooks`)
PAUSES_AT_THIRD_TOKEN = 23


def wait_until(condition, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.001)


class HeldScheduler:
    """Occupy the compute thread, so requests queue up and start at the same step."""

    def __init__(self, engine: ChatEngine):
        self.engine, self.gate = engine, threading.Event()

    def __enter__(self) -> "HeldScheduler":
        started = threading.Event()
        self.engine.worker.submit(lambda: (started.set(), self.gate.wait(60)))
        started.wait(60)
        return self

    def __exit__(self, *exc) -> None:
        self.gate.set()


class Consumer(threading.Thread):
    """Drains one stream on its own thread, as a browser's request would."""

    def __init__(self, conv, stream, stop_after: int | None = None):
        super().__init__(daemon=True)
        self.conv, self.stream, self.stop_after = conv, stream, stop_after
        self.deltas: list = []
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            for delta in self.stream:
                self.deltas.append(delta)
                if self.stop_after is not None and len(self.deltas) >= self.stop_after:
                    self.conv.stop()
        except BaseException as error:
            self.error = error


class _Raises(LogitsProcessor):
    def __init__(self):
        self.calls = 0

    def __call__(self, input_ids, scores):
        self.calls += 1
        if self.calls == 3:
            raise RuntimeError("processor failed")
        return scores


class _Pauses(LogitsProcessor):
    """At its reply's third token: say so, then hold the compute thread until released."""

    def __init__(self, reached: threading.Event, release: threading.Event):
        self.calls, self.reached, self.release = 0, reached, release

    def __call__(self, input_ids, scores):
        self.calls += 1
        if self.calls == 3:
            self.reached.set()
            self.release.wait(60)
        return scores


@pytest.fixture
def hooks(monkeypatch):
    """Replies with a marked max_new_tokens get a failing or a pausing processor appended."""
    pause = dict(reached=threading.Event(), release=threading.Event())

    class HookedChooser(TokenChooser):
        def __init__(self, model, options, prompt_length):
            super().__init__(model, options, prompt_length)
            if options.max_new_tokens == FAILS_AT_THIRD_TOKEN:
                self.processors.append(_Raises())
            elif options.max_new_tokens == PAUSES_AT_THIRD_TOKEN:
                self.processors.append(_Pauses(**pause))

    monkeypatch.setattr(chat.scheduling.request_stages, "TokenChooser", HookedChooser)
    yield pause
    pause["release"].set()


@pytest.fixture
def batches(monkeypatch):
    """Every batch composition the scheduler decodes, as tuples of session ids: the decode rows
    of each step the runner runs, each composition once while it lasts."""
    built: list[tuple[int, ...]] = []
    run = ModelRunner.run

    def recording(runner, rows, logits_of, tails=None, eager=False):
        rows, logits_of = list(rows), list(logits_of)
        decoded = tuple(id(rows[i][0]) for i in logits_of)
        if decoded and (not built or built[-1] != decoded):
            built.append(decoded)
        return run(runner, rows, logits_of, tails, eager)

    monkeypatch.setattr(ModelRunner, "run", recording)
    return built


def conversations_with_histories(engine: ChatEngine, count: int) -> list:
    """`count` conversations; the i-th has i earlier turns, so their prompts differ in length."""
    convs = []
    for index in range(count):
        conv = engine.conversation("You are terse.")
        for turn in range(index):
            list(conv.send(f"Earlier question {turn} of chat {index}: what is {turn} plus {index}?", **GREEDY))
        convs.append(conv)
    return convs


@pytest.mark.parametrize("arch", ARCHS)
def test_conversations_sending_at_once_decode_in_one_batch_each_as_alone(make_engine, models, tokenizers, arch,
                                                                         batches):
    # prompt pieces of a fixed size, not timed: on a busy machine a timed budget falls to a token a
    # step, and a reply could end before the last prompt is in, which is not what this checks
    engine = make_engine(arch, step_gap_factor=None)
    convs = conversations_with_histories(engine, 4)
    with HeldScheduler(engine):
        consumers = [Consumer(conv, conv.send(f"Now, chat {i}: tell me about the cache.", **GREEDY))
                     for i, conv in enumerate(convs)]
        wait_until(lambda: engine.batch_stats().waiting == 4)
    for consumer in consumers:
        consumer.join(60)
        assert consumer.error is None
    assert engine.batch_stats().largest_batch == 4
    # all four in one forward (in the order their threads happened to submit)
    assert {id(conv.session) for conv in convs} in [set(batch) for batch in batches if len(batch) == 4]
    model, tokenizer = models[arch], tokenizers[THINKING_TEMPLATE]
    for conv in convs:
        check_exact(conv, model, tokenizer, max_new_tokens=MAX_NEW)
        assert conv.stats.generated_tokens >= 1 and conv.stats.waited_s >= 0
    # and every operation works as before on a cache that was decoded in a batch
    last = convs[3]
    list(last.regenerate(**GREEDY))
    check_exact(last, model, tokenizer, max_new_tokens=MAX_NEW)
    assert last.stats.prefilled_tokens == (0 if last.session.crops_anywhere() else 1)
    last.select_version(0)
    check_exact(last, model, tokenizer, max_new_tokens=MAX_NEW)
    list(last.send("One more, cut short.", max_new_tokens=3, do_sample=False))
    assert last.stats.generated_tokens == len(last.reply_ids)  # cut by the limit, not ended: continue it
    before = len(last.reply_ids)
    list(last.continue_reply(**GREEDY))
    check_exact(last, model, tokenizer, max_new_tokens=None, stopped=True, continued_from=before)
    list(last.edit(1, "An edited first question.", **GREEDY))
    check_exact(last, model, tokenizer, max_new_tokens=MAX_NEW)


@pytest.mark.parametrize("arch", ARCHS)
def test_arrival_stop_and_failure_leave_the_others_exact(make_engine, models, tokenizers, arch, hooks, batches):
    """A and B decode; C is stopped after its first delta; D's logits processor raises at its third
    token; E arrives while A is mid-reply. A, B and E equal their replies alone, C a prefix of its
    own, D fails alone with its history untouched; every cache equals the scratch reference."""
    model, tokenizer = models[arch], tokenizers[THINKING_TEMPLATE]
    engine = make_engine(arch, step_gap_factor=None)  # E's prompt in before A ends, however busy the machine
    a, b, c, d, e = conversations_with_histories(engine, 5)
    d_messages = d.messages
    with HeldScheduler(engine):
        long_reply = dict(max_new_tokens=PAUSES_AT_THIRD_TOKEN, do_sample=False)
        consumer_a = Consumer(a, a.send("A long answer, please.", **long_reply))
        consumer_b = Consumer(b, b.send("Hello from B.", **GREEDY))
        consumer_c = Consumer(c, c.send("Hello from C.", **GREEDY), stop_after=1)
        consumer_d = Consumer(d, d.send("Hello from D.", max_new_tokens=FAILS_AT_THIRD_TOKEN, do_sample=False))
        wait_until(lambda: engine.batch_stats().waiting == 4)
    assert hooks["reached"].wait(60)  # A is inside its third decode step: E arrives now
    consumer_e = Consumer(e, e.send("E arrives late.", **GREEDY))
    wait_until(lambda: engine.batch_stats().waiting == 1)
    hooks["release"].set()
    for consumer in (consumer_a, consumer_b, consumer_c, consumer_d, consumer_e):
        consumer.join(60)
    assert consumer_a.error is consumer_b.error is consumer_c.error is consumer_e.error is None
    assert isinstance(consumer_d.error, RuntimeError) and "processor failed" in str(consumer_d.error)
    assert d.messages == d_messages and not d.is_busy
    assert any(id(a.session) in rows and id(e.session) in rows for rows in batches)  # E joined A's batch
    check_exact(a, model, tokenizer, max_new_tokens=PAUSES_AT_THIRD_TOKEN)
    for conv in (b, e):
        check_exact(conv, model, tokenizer, max_new_tokens=MAX_NEW)
    check_exact(c, model, tokenizer, max_new_tokens=MAX_NEW, stopped=True)
    assert c.stats.stopped
    check_exact(d, model, tokenizer, max_new_tokens=None, generated=False)
    list(d.send("D again.", **GREEDY))  # D recovers: its cache was released and is rebuilt
    check_exact(d, model, tokenizer, max_new_tokens=MAX_NEW)


def sampled_reference(model, prompt_ids: list[int], eos: int, *, seed: int, max_new_tokens: int) -> list[int]:
    """Sampling from scratch: full forwards, the warpers built by hand, a generator seeded alone."""
    processors = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.3), TemperatureLogitsWarper(0.9),
                                      TopKLogitsWarper(20), TopPLogitsWarper(0.9)])
    generator = torch.Generator().manual_seed(seed)
    ids, reply = list(prompt_ids), []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(torch.tensor([ids])).logits[:, -1].float()
            scores = processors(torch.tensor([ids]), logits)
            token = int(torch.multinomial(torch.softmax(scores, dim=-1), 1, generator=generator))
            if token == eos:
                break
            ids.append(token)
            reply.append(token)
    return reply


@pytest.mark.parametrize("arch", ["full", "hybrid"])
def test_seeded_sampling_is_the_same_batched_or_alone_and_follows_the_warpers(make_engine, models, tokenizers,
                                                                              arch):
    model, tokenizer = models[arch], tokenizers[THINKING_TEMPLATE]
    sampled = dict(max_new_tokens=12, do_sample=True, temperature=0.9, top_k=20, top_p=0.9,
                   repetition_penalty=1.3, seed=7)
    engine = make_engine(arch)
    alone = engine.conversation("You are terse.")
    list(alone.send("Pick some words at random.", **sampled))
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    prompt = render_ids(tokenizer, alone.messages[:-1])
    assert alone.reply_ids == sampled_reference(model, prompt, eos, seed=7, max_new_tokens=12)

    batched, greedy_one, greedy_two = (engine.conversation("You are terse.") for _ in range(3))
    with HeldScheduler(engine):
        consumers = [Consumer(greedy_one, greedy_one.send("A greedy neighbour.", **GREEDY)),
                     Consumer(batched, batched.send("Pick some words at random.", **sampled)),
                     Consumer(greedy_two, greedy_two.send("Another greedy one, longer prompt here.", **GREEDY))]
        wait_until(lambda: engine.batch_stats().waiting == 3)
    for consumer in consumers:
        consumer.join(60)
        assert consumer.error is None
    assert batched.reply_ids == alone.reply_ids
    for conv in (greedy_one, greedy_two):
        check_exact(conv, model, tokenizer, max_new_tokens=MAX_NEW)


def test_a_long_prompt_is_prefilled_in_chunks_between_decode_steps(make_engine, models, tokenizers, hooks,
                                                                   monkeypatch):
    """Each step is one forward: the running reply's next token and at most one chunk."""
    model = models["full"]
    engine = make_engine("full", prefill_chunk=16, step_gap_factor=None)  # chunks of 16 however busy the machine
    runner, newcomer = engine.conversation("You are terse."), engine.conversation("You are terse.")
    # per forward: (decode rows, tokens of each prefill piece, tokens of each decode row)
    forwards: list[tuple[int, list[int], list[int]]] = []
    packed = chat.model_step.runner.packed_step

    def logged(model, rows, logits_of, plain, tails=None, alone=()):
        forwards.append((len(logits_of), [len(fed) for _, fed in rows[len(logits_of):]],
                         [len(fed) for _, fed in rows[:len(logits_of)]]))
        return packed(model, rows, logits_of, plain, tails, alone)

    monkeypatch.setattr(chat.model_step.runner, "packed_step", logged)
    consumer = Consumer(runner, runner.send("Talk for a while.", max_new_tokens=PAUSES_AT_THIRD_TOKEN,
                                            do_sample=False))
    assert hooks["reached"].wait(60)
    long_text = " ".join(f"word{i}" for i in range(60))
    late = Consumer(newcomer, newcomer.send(long_text, **GREEDY))
    wait_until(lambda: engine.batch_stats().waiting == 1)
    arrived = len(forwards)
    hooks["release"].set()
    consumer.join(60), late.join(60)
    assert consumer.error is None and late.error is None
    after = forwards[arrived:]
    prompt_length = newcomer.stats.prompt_tokens
    first_joint = next(i for i, (decoding, _, _) in enumerate(after) if decoding == 2)
    prefill_phase = after[:first_joint]
    pieces = [tokens for _, step, _ in prefill_phase for tokens in step]
    assert len(pieces) >= (prompt_length - 1) // 16 - 1 >= 4  # the prompt really needed several chunks
    assert all(tokens <= 16 for tokens in pieces)
    # its last piece (a chunk at most) goes with its last prompt token in its first decode row,
    # its first token chosen in that step (a full-attention cache keeps nothing at that point)
    rest = prompt_length - newcomer.stats.reused_tokens - sum(pieces)
    assert 1 < rest <= 17 and after[first_joint][1:] == ([], [1, rest])
    # the runner's token rides in every forward that prefills: it never waits for a chunk
    assert all(decoding == 1 and len(step) <= 1 for decoding, step, _ in prefill_phase)
    check_exact(runner, model, tokenizers[THINKING_TEMPLATE], max_new_tokens=PAUSES_AT_THIRD_TOKEN)
    check_exact(newcomer, model, tokenizers[THINKING_TEMPLATE], max_new_tokens=MAX_NEW)


@pytest.mark.parametrize("arch,weights", [(arch, "full") for arch in ARCHS] + [("full", "int8")])
def test_a_first_token_comes_from_the_step_that_feeds_the_prompts_end(make_engine, models, tokenizers, monkeypatch,
                                                                      arch, weights):
    """Every reply's first token took two steps on an idle engine: its prompt up to the last
    token, then a decode step of that one token. Where the cache keeps nothing at the generation
    start (every layer full attention: a Regenerate crops back to it), the last piece now goes
    with that token in the first decode row, whose first token is chosen after it: one step.
    Where a checkpoint is kept there (sliding windows, recurrent states), the piece still ends
    there and the token follows; and with int8 weights where the two would pass the rows their
    products keep apart (16), so that the token gets the bits a Regenerate's step of that token
    alone gives (a greedy Retry is the reply it replaces); a short follow-up's still go
    together there. The reply, and a Regenerate, are exact either way."""
    tokenizer = tokenizers[THINKING_TEMPLATE]
    if weights == "int8":  # converted in place: a model of its own, not the suite's
        model = build_model(arch, len(tokenizer), tokenizer.convert_tokens_to_ids("<|im_end|>"))
        engine = ChatEngine(model, tokenizer, draft="off", weights="int8")
        bound = dict(near_greedy=True, logit_tolerance=int8_logit_tolerance(model))
    else:
        model, engine, bound = models[arch], make_engine(arch, draft="off"), {}
    conv = engine.conversation()
    steps: list[tuple[list[int], list[int]]] = []  # per step: tokens of each decode row, of each piece
    first_token_after: list[int] = []  # steps run when the reply's first token came
    run, emit = ModelRunner.run, chat.scheduling.scheduler.GenerationRequest._emit

    def recorded(runner, rows, logits_of, tails=None, eager=False):
        rows, logits_of = list(rows), list(logits_of)
        steps.append(([len(rows[i][1]) for i in logits_of], [len(fed) for i, (_, fed) in enumerate(rows)
                                                             if i not in logits_of]))
        return run(runner, rows, logits_of, tails, eager)

    def noted(request, token_id):
        if request.token_count == 0:
            first_token_after.append(len(steps))
        emit(request, token_id)

    monkeypatch.setattr(ModelRunner, "run", recorded)
    monkeypatch.setattr(chat.scheduling.scheduler.GenerationRequest, "_emit", noted)
    list(conv.send("Tell me about the cache, please.", **GREEDY))
    prompt = conv.stats.prompt_tokens
    assert conv.stats.reused_tokens == 0 and prompt > 8
    if arch == "full" and weights == "full":
        assert steps[0] == ([prompt], []) and first_token_after == [1]
    else:
        assert steps[:2] == [([], [prompt - 1]), ([1], [])] and first_token_after == [2]
    check_exact(conv, model, tokenizer, max_new_tokens=MAX_NEW, **bound)
    steps.clear()
    first_token_after.clear()
    first = list(conv.reply_ids)
    list(conv.regenerate(**GREEDY))
    if arch == "full":  # the whole prompt kept, its first token from the logits kept after it: no step
        assert first_token_after == [0] and conv.stats.prefilled_tokens == 0
    else:  # back to the generation start: its last token fed again, alone
        assert first_token_after == [1] and conv.stats.prefilled_tokens == 1
    assert steps[0] == ([1], []) and conv.reply_ids == first
    check_exact(conv, model, tokenizer, max_new_tokens=MAX_NEW, **bound)
    if weights == "int8":  # the first prompt passed 16 tokens; a follow-up of a word does not
        assert prompt > 16
        steps.clear()
        list(conv.send("ok", **GREEDY))
        fed = conv.stats.prefilled_tokens
        assert fed <= 16 and steps[0] == ([fed], [])
        first = list(conv.reply_ids)
        list(conv.regenerate(**GREEDY))
        assert conv.reply_ids == first
        check_exact(conv, model, tokenizer, max_new_tokens=MAX_NEW, **bound)


def test_batch_size_is_bounded_and_the_rest_wait_their_turn(make_engine, models, tokenizers):
    engine = make_engine("mixed", max_batch_size=2)
    convs = [engine.conversation("Be brief.") for _ in range(3)]
    with HeldScheduler(engine):
        consumers = [Consumer(conv, conv.send(f"Question number {i}?", **GREEDY)) for i, conv in enumerate(convs)]
        wait_until(lambda: engine.batch_stats().waiting == 3)
    for consumer in consumers:
        consumer.join(60)
        assert consumer.error is None
    stats = engine.batch_stats()
    assert stats.largest_batch == 2 and stats.joined == 3 and stats.decoding == stats.waiting == 0
    for conv in convs:
        check_exact(conv, models["mixed"], tokenizers[THINKING_TEMPLATE], max_new_tokens=MAX_NEW)


# ---- a property: any interleaving of several conversations' operations stays exact --------------
PROPERTY_MAX_NEW = 6
steps = st.lists(
    st.tuples(st.integers(0, 2), st.sampled_from(["send", "regenerate", "advance", "stop", "drain", "undo"])),
    min_size=1, max_size=14)


@pytest.mark.parametrize("arch", ARCHS)
@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(program=steps)
def test_interleaved_operations_of_several_conversations_stay_exact(models, tokenizers, arch, program):
    """One thread drives three conversations' streams in any interleaving; the scheduler batches
    whatever is open at each step. Afterwards every conversation is exact."""
    model, tokenizer = models[arch], tokenizers[THINKING_TEMPLATE]
    engine = ChatEngine(model, tokenizer, max_batch_size=2)
    convs = [engine.conversation("Be brief.") for _ in range(3)]
    options = dict(max_new_tokens=PROPERTY_MAX_NEW, do_sample=False)
    open_streams: dict[int, object] = {}
    complete: dict[int, bool | None] = {0: None, 1: None, 2: None}  # last reply fresh and not stopped

    def advance(index: int) -> None:
        try:
            next(open_streams[index])
        except StopIteration:
            del open_streams[index]
            complete[index] = not convs[index].stats.stopped

    for index, action in program:
        conv = convs[index]
        if action in ("send", "regenerate"):
            try:
                stream = conv.send("Hi there, cache?", **options) if action == "send" else conv.regenerate(**options)
            except ConversationBusyError:
                assert index in open_streams
                continue
            except ConversationError:
                continue
            open_streams[index] = stream
            advance(index)  # submitted: it now holds the conversation
        elif action == "advance" and index in open_streams:
            advance(index)
        elif action == "stop":
            conv.stop()
        elif action == "drain" and index in open_streams:
            while index in open_streams:
                advance(index)
        elif action == "undo":
            try:
                conv.undo()
                complete[index] = None
            except ConversationBusyError:
                assert index in open_streams
            except ConversationError:
                pass
    for index in list(open_streams):
        while index in open_streams:
            advance(index)
    for index, conv in enumerate(convs):
        fresh = complete[index]
        check_exact(conv, model, tokenizer, max_new_tokens=PROPERTY_MAX_NEW if fresh else None,
                    stopped=not fresh, generated=bool(fresh) or fresh is False)


@pytest.mark.parametrize("order", ["shortest", "arrival"])
def test_a_short_message_behind_a_long_one_is_prefilled_first(make_engine, models, tokenizers, monkeypatch, order):
    """A one-line message sent just after a long one waited for the long one's whole
    prefill. Now prefill is chunked even when nobody decodes, and the step's budget goes to the
    shortest remaining prefill first: the short reply's first token comes before the long one's,
    which needed several chunks. ("arrival", oldest first, is the order measured against.) Both
    replies are exact."""
    engine = make_engine("full", prefill_chunk=8, prefill_chunk_alone=32, prefill_order=order)
    long_conv, short_conv = engine.conversation("You are terse."), engine.conversation("You are terse.")
    first_tokens: list = []
    emit = chat.scheduling.scheduler.GenerationRequest._emit

    def noted(request, token_id):
        if request.token_count == 0:
            first_tokens.append(request.session)
        emit(request, token_id)

    monkeypatch.setattr(chat.scheduling.scheduler.GenerationRequest, "_emit", noted)
    widths: list[int] = []  # tokens per row of every forward pass
    on_model_input(models["full"], monkeypatch, lambda input_ids: widths.append(input_ids.numel()))
    long_text = " ".join(f"word{i}" for i in range(80))
    with HeldScheduler(engine):  # both are admitted at the same step, the long one first
        late = Consumer(long_conv, long_conv.send(long_text, **GREEDY))
        wait_until(lambda: engine.batch_stats().waiting == 1)
        short = Consumer(short_conv, short_conv.send("Hi?", **GREEDY))
        wait_until(lambda: engine.batch_stats().waiting == 2)
    late.join(60), short.join(60)
    assert late.error is None and short.error is None
    assert long_conv.stats.prefilled_tokens > 3 * 32 > short_conv.stats.prefilled_tokens
    expected = [short_conv.session, long_conv.session] if order == "shortest" else [long_conv.session,
                                                                                   short_conv.session]
    assert first_tokens == expected
    # chunked while nobody decoded too (a last piece goes with the prompt's last token: one more)
    assert max(widths) <= 32 + 1
    monkeypatch.undo()
    for conv in (long_conv, short_conv):
        check_exact(conv, models["full"], tokenizers[THINKING_TEMPLATE], max_new_tokens=MAX_NEW)


def costed_steps(engine, monkeypatch, *, beside_decode_rows: bool) -> list[int]:
    """The engine's steps on a made-up clock: a forward costs 10 units, each prompt token in it 2
    more. Returns the list the prompt tokens of each step with prefill go to (only the steps
    that also carry decode rows, with `beside_decode_rows`)."""
    now, pieces, packed = [0.0], [], chat.model_step.runner.packed_step
    engine.scheduler.clock = lambda: now[0]

    def costed(model, rows, logits_of, plain, tails=None, alone=()):
        prompt_tokens = sum(len(fed) for _, fed in rows[len(logits_of):])
        now[0] += 10 + 2 * prompt_tokens
        if prompt_tokens and (logits_of or not beside_decode_rows):
            pieces.append(prompt_tokens)
        return packed(model, rows, logits_of, plain, tails, alone)

    monkeypatch.setattr(chat.model_step.runner, "packed_step", costed)
    return pieces


def test_the_prompt_budget_beside_decode_rows_is_sized_by_timed_steps(make_engine, models, tokenizers, hooks,
                                                                      monkeypatch):
    """Steps are timed (here on a made-up clock: a forward costs 10 units, each prompt token in it
    2 more). Beside a decode row, a newcomer's pieces are 10 tokens, the most that keep a step
    within 3 decode steps (10 + 2 x 10 = 30), not the cap's 64; the first is guessed from the
    runner's own prefill alone (dearer per token: fewer)."""
    monkeypatch.setattr(models["full"].generation_config, "eos_token_id", None)
    engine = make_engine("full", prefill_chunk=64)
    pieces = costed_steps(engine, monkeypatch, beside_decode_rows=True)
    runner, newcomer = engine.conversation("You are terse."), engine.conversation("You are terse.")
    consumer = Consumer(runner, runner.send("Talk for a while.", max_new_tokens=PAUSES_AT_THIRD_TOKEN,
                                            do_sample=False))
    assert hooks["reached"].wait(60)  # three decode steps alone were timed
    late = Consumer(newcomer, newcomer.send(" ".join(f"word{i}" for i in range(50)), **GREEDY))
    wait_until(lambda: engine.batch_stats().waiting == 1)
    hooks["release"].set()
    consumer.join(60), late.join(60)
    assert consumer.error is None and late.error is None
    assert len(pieces) >= 4 and all(0 < tokens <= 10 for tokens in pieces)
    assert all(tokens == 10 for tokens in pieces[1:-1])
    check_exact(newcomer, models["full"], tokenizers[THINKING_TEMPLATE], max_new_tokens=MAX_NEW)


def test_a_long_prompt_alone_is_fed_in_steps_of_the_time_a_newcomer_may_wait(make_engine, models, tokenizers,
                                                                              monkeypatch):
    """With no row decoding, a step carries what fits in `alone_step_s` (here on a made-up clock:
    a forward costs 10 units, each prompt token 2 more, and 110 units are allowed): a first small
    step is timed, then steps of at most (110 / 2.2...) < 50 tokens, not the cap's 512."""
    engine = make_engine("full", prefill_chunk_alone=512, alone_step_s=110.0)
    pieces = costed_steps(engine, monkeypatch, beside_decode_rows=False)
    conv = engine.conversation("You are terse.")
    list(conv.send(" ".join(f"word{i}" for i in range(150)), **GREEDY))
    assert len(pieces) >= 4 and pieces[0] <= 32 and sum(pieces) > 300  # (the first: the shared system prompt)
    assert all(32 <= tokens <= 50 for tokens in pieces[1:-1]), pieces
    check_exact(conv, models["full"], tokenizers[THINKING_TEMPLATE], max_new_tokens=MAX_NEW)


def test_a_step_budget_stays_between_one_token_and_its_cap():
    budget = StepBudget(3.0)
    assert budget.tokens(64) == 64  # nothing timed yet
    budget.record(0.010, decode_rows=2, prompt_tokens=0)
    budget.record(0.510, decode_rows=2, prompt_tokens=10)  # a token adds 50 ms, five decode steps
    assert budget.tokens(64) == 1
    budget.record(0.050, decode_rows=0, prompt_tokens=500)  # alone: only a guess while nothing better is known
    assert budget.tokens(64) == 1
    guessed = StepBudget(3.0)
    guessed.record(0.100, decode_rows=0, prompt_tokens=50)  # 2 ms a token, alone
    guessed.record(0.010, decode_rows=1, prompt_tokens=0)
    assert guessed.tokens(64) == 10
    assert StepBudget(None).tokens(64) == 64
    with pytest.raises(ValueError):
        StepBudget(1.0)
    alone = StepBudget(3.0, 0.5)  # with no row decoding: within a time, between 32 tokens and the cap
    assert alone.alone_tokens(512) == 32 and alone.alone_tokens(16) == 16  # nothing timed: a small step
    assert StepBudget(3.0, None).alone_tokens(512) == 512 and StepBudget(None, 0.5).alone_tokens(512) == 512
    alone.record(0.100, decode_rows=0, prompt_tokens=100)  # 1 ms a token, alone
    assert alone.alone_tokens(512) == 500 and alone.alone_tokens(256) == 256
    alone.record(0.010, decode_rows=1, prompt_tokens=0)
    alone.record(0.030, decode_rows=1, prompt_tokens=10)  # 2 ms a token beside a 10 ms step
    assert alone.alone_tokens(512) == 245
    alone.alone_step_s = 0.001
    assert alone.alone_tokens(512) == 32
    with pytest.raises(ValueError):
        StepBudget(3.0, 0.0)


def test_a_reply_stopped_while_it_waits_for_prompt_budget_leaves_before_the_next_forward(make_engine, models,
                                                                                        monkeypatch):
    """A request given no prompt budget was passed over before its Stop was read:
    it stayed (its conversation busy, its Stop doing nothing) until the budget reached it, after
    another user's prompt. Two prompts start at one step; the shorter takes the whole budget of
    each step; the longer is stopped during the first forward and has left before the second."""
    engine = make_engine("full", prefill_chunk_alone=8, alone_step_s=None)
    first, second = engine.conversation(), engine.conversation()  # no shared system prompt: one piece each
    forwards, reached, release, ended_after = [0], threading.Event(), threading.Event(), []
    packed = chat.model_step.runner.packed_step

    def held(model, rows, logits_of, plain, tails=None, alone=()):
        forwards[0] += 1
        if forwards[0] == 1:
            reached.set()
            release.wait(60)
        return packed(model, rows, logits_of, plain, tails, alone)

    end = chat.scheduling.scheduler.GenerationRequest._end

    def noted(request, error=None):
        if request.session is second.session:
            ended_after.append(forwards[0])
        end(request, error)

    monkeypatch.setattr(chat.model_step.runner, "packed_step", held)
    monkeypatch.setattr(chat.scheduling.scheduler.GenerationRequest, "_end", noted)
    with HeldScheduler(engine):
        shorter = Consumer(first, first.send(" ".join(f"word{i}" for i in range(60)), **GREEDY))
        wait_until(lambda: engine.batch_stats().waiting == 1)
        longer = Consumer(second, second.send(" ".join(f"word{i}" for i in range(90)), **GREEDY))
        wait_until(lambda: engine.batch_stats().waiting == 2)
    assert reached.wait(60)  # the first step's forward: the shorter prompt's piece alone
    second.stop()
    release.set()
    longer.join(60), shorter.join(60)
    assert longer.error is None and shorter.error is None
    assert ended_after == [1], ended_after  # no forward ran between its Stop and its end
    assert not second.is_busy


def test_a_client_holding_every_row_gives_one_to_another_client_at_once(make_engine, models, tokenizers,
                                                                       monkeypatch):
    """Rows went first come first served, and one address may hold as many
    conversations as there are rows: its long replies kept every row and another client's message
    waited for one of them to end. Now that client is below its share (4 rows over 2 clients):
    one of the first client's rows is paused, the newcomer's reply starts while all four long
    replies still run, and the paused one goes on later, exact."""
    monkeypatch.setattr(models["full"].generation_config, "eos_token_id", None)
    engine = make_engine("full", max_batch_size=4)
    hog = [engine.conversation("You are terse.", client="198.51.100.1") for _ in range(4)]
    streams = [Consumer(conv, conv.send(f"Talk about {i} for a while.", max_new_tokens=80, do_sample=False))
               for i, conv in enumerate(hog)]
    wait_until(lambda: engine.batch_stats().decoding == 4)
    other = engine.conversation("You are terse.", client="203.0.113.9")
    seen: dict = {}
    emit = chat.scheduling.scheduler.GenerationRequest._emit

    def noted(request, token_id):
        if request.session is other.session and not seen:
            seen.update(step=engine.scheduler.planner.counters.steps, paused=len(engine.scheduler.planner.requests.paused),
                        hog_running=[stream.is_alive() for stream in streams])
        emit(request, token_id)

    monkeypatch.setattr(chat.scheduling.scheduler.GenerationRequest, "_emit", noted)
    submitted = engine.batch_stats().steps
    newcomer = Consumer(other, other.send("Hi?", **GREEDY))
    newcomer.join(120)
    for stream in streams:
        stream.join(120)
    assert newcomer.error is None and all(stream.error is None for stream in streams)
    assert seen["hog_running"] == [True] * 4 and seen["paused"] == 1, seen
    assert seen["step"] - submitted <= 10, (seen, submitted)  # its prompt's few pieces, not 80 steps
    assert engine.batch_stats().paused == 0
    monkeypatch.undo()
    for conv in hog:
        check_exact(conv, models["full"], tokenizers[THINKING_TEMPLATE], max_new_tokens=80)
    check_exact(other, models["full"], tokenizers[THINKING_TEMPLATE], max_new_tokens=MAX_NEW)


def test_a_step_budget_does_not_starve_prompts_when_a_step_with_prefill_has_a_fixed_cost():
    """A step with prefill runs eagerly where decode rows alone run a compiled graph: it costs a
    fixed part more, whatever its tokens. Charged to the tokens, that part shrank each piece
    until prompts were fed a token a step (measured at Qwen3-0.6B's shape, int8: 12, 8, 6, 4, 3,
    2, 1). On a made-up clock with that shape of cost (one decode row alone 14.5 ms, four 35 ms;
    four rows with a piece 62 ms and 3 ms a prompt token), the budget settles where a step adds
    its fixed part twice, and four 45-token prompts are fed in a few steps, not
    one token a step (101 steps before)."""
    budget = StepBudget(3.0)
    budget.record(0.0145, decode_rows=1, prompt_tokens=0)
    step_s = lambda tokens: 0.062 + 0.003 * tokens  # noqa: E731  (four decode rows beside `tokens`)
    pieces, owed = [], 4 * 45
    while owed > 0 and len(pieces) < 200:
        piece = min(owed, budget.tokens(64, decode_rows=4))
        budget.record(step_s(piece), decode_rows=4, prompt_tokens=piece)
        pieces.append(piece)
        owed -= piece
    assert owed <= 0 and len(pieces) <= 16, pieces
    small = next(index for index, piece in enumerate(pieces) if piece <= 2)  # found out by a small piece
    assert small <= 8 and min(pieces[small + 1:-1]) >= 12, pieces  # then never a token at a time
    fixed, token_s = budget.mixed.fit()
    assert abs(token_s - 0.003) < 1e-4 and abs(fixed - (0.062 - 0.0145)) < 2e-3  # the clock's own line


@pytest.mark.parametrize("hiccup_tokens", [2, 40])
def test_one_slow_step_moves_the_budget_for_a_few_steps_at_most(hiccup_tokens):
    """On a made-up clock (a decode row 10 ms; a piece adds 2 ms and 0.5 ms a token), one step
    timed at 200 ms (the machine busy elsewhere) among the others: within 20 steps the budget is
    back within 20 % of its steady value, and no step with prefill breaks the gap target (4
    decode steps). A 2-token piece timed so once locked the budget at its cap for good (every
    later step 7.6 decode steps)."""
    budget = StepBudget(3.0)
    step_s = lambda tokens: 0.010 + (0.002 + 0.0005 * tokens if tokens else 0)  # noqa: E731

    def steps(count: int) -> list[int]:
        pieces = []
        for _ in range(count):
            budget.record(step_s(0), decode_rows=1, prompt_tokens=0)
            pieces.append(budget.tokens(128, decode_rows=1))
            budget.record(step_s(pieces[-1]), decode_rows=1, prompt_tokens=pieces[-1])
        return pieces

    steady = steps(200)[-1]
    budget.record(0.200, decode_rows=1, prompt_tokens=hiccup_tokens)
    after = steps(200)
    assert all(abs(piece - steady) <= 0.2 * steady for piece in after[20:]), (steady, after)
    assert max(step_s(piece) for piece in after) <= 4 * step_s(0), after


@pytest.mark.parametrize("apart", [True, False])
def test_a_newcomers_prompt_end_runs_apart_from_the_rows_where_their_gap_allows(make_engine, models, tokenizers,
                                                                               hooks, batches, monkeypatch, apart):
    """A newcomer's short message beside busy rows took 1.6-1.8x its first token on an idle
    engine: the step that fed its prompt's end carried every decode row too. On a made-up clock
    (a forward 10 units, 5 a decode row, 1 every other token fed), three rows decoding (25 a
    step) and a newcomer's prompt end of fewer than 35 tokens (a one-row step of 15 plus those,
    within two of their steps): that step runs the newcomer alone, the next every row, and
    every reply is exact. Switched off (as before), the newcomer's step carries the rows."""
    monkeypatch.setattr(models["full"].generation_config, "eos_token_id", None)
    now, packed = [0.0], chat.model_step.runner.packed_step

    def costed(model, rows, logits_of, plain, tails=None, alone=()):
        fed = sum(len(tokens) for _, tokens in rows)
        now[0] += 10 + 5 * len(logits_of) + (fed - len(logits_of))
        return packed(model, rows, logits_of, plain, tails, alone)

    monkeypatch.setattr(chat.model_step.runner, "packed_step", costed)
    engine = make_engine("full", prefill_chunk=64, draft="off")
    engine.scheduler.clock = lambda: now[0]
    engine.scheduler.planner.newcomers_apart = apart
    streams = [engine.conversation("You are terse.") for _ in range(3)]
    lengths = [120, 120, PAUSES_AT_THIRD_TOKEN]
    consumers = []
    for index, conv in enumerate(streams):  # one alone for a few steps, then two, then three
        steps = engine.batch_stats().steps
        consumers.append(Consumer(conv, conv.send(f"Talk about {index}.", max_new_tokens=lengths[index],
                                                  do_sample=False)))
        if index < 2:
            wait_until(lambda: engine.batch_stats().steps >= steps + 4)
    assert hooks["reached"].wait(60)  # the third's third token: three rows decoding, their steps timed
    newcomer = engine.conversation("You are terse.")
    late = Consumer(newcomer, newcomer.send("Hi?", **GREEDY))
    wait_until(lambda: engine.batch_stats().waiting == 1)
    batches.clear()
    apart_before = engine.status()["batch"]["newcomers_apart"]
    hooks["release"].set()
    late.join(60)
    for consumer in consumers:
        consumer.join(60)
    assert late.error is None and all(consumer.error is None for consumer in consumers)
    alone, rows = (id(newcomer.session),), {id(conv.session) for conv in (*streams, newcomer)}
    assert engine.status()["batch"]["newcomers_apart"] - apart_before == (1 if apart else 0)  # what /status says
    if apart:
        assert batches[0] == alone and set(batches[1]) == rows, batches  # the steps after the one the pause held
    else:
        assert alone not in batches and set(batches[0]) == rows, batches
    monkeypatch.undo()
    for conv, length in zip((*streams, newcomer), (*lengths, MAX_NEW)):
        check_exact(conv, models["full"], tokenizers[THINKING_TEMPLATE], max_new_tokens=length)


def message_of_prompt_length(tokenizer, system: str, low: int, high: int) -> str:
    """A message whose rendered prompt (with `system`) is `low` to `high` tokens long."""
    for words in range(1, 400):
        text = " ".join(f"word{i}" for i in range(words))
        length = len(render_ids(tokenizer, [{"role": "system", "content": system}, {"role": "user", "content": text}]))
        if low <= length <= high:
            return text
    raise AssertionError(f"no message renders to {low}-{high} tokens")


@pytest.mark.parametrize("whole", [True, False], ids=["whole", "cut"])
def test_a_message_a_little_over_the_step_budget_goes_whole_where_one_step_can_carry_it(make_engine, models,
                                                                                        tokenizers, monkeypatch,
                                                                                        whole):
    """A message a little longer than the step budget beside decode rows was cut to it: its
    first token came a step later, and each of the two steps carried a step with prefill's fixed
    part (at Qwen3-0.6B's shape, int8, eight rows decoding: 1.7-2.0x an idle engine's first
    token). On a made-up clock (a forward 10 units, 5 a decode row, a quarter every other token
    fed), one row decoding (15 a step): the budget is 120 prompt tokens (a step within 3 decode
    steps), a message given whole may take 3.5 (150 tokens). A message of about 140 tokens is fed
    in one step and its reply is exact; cut to the budget (as before), in two."""
    monkeypatch.setattr(models["full"].generation_config, "eos_token_id", None)
    now, fed, packed = [0.0], [], chat.model_step.runner.packed_step

    def costed(model, rows, logits_of, plain, tails=None, alone=()):
        tokens = sum(len(tokens) for _, tokens in rows)
        now[0] += 10 + 5 * len(logits_of) + 0.25 * (tokens - len(logits_of))
        fed.append([(id(session), len(tokens)) for session, tokens in rows])
        return packed(model, rows, logits_of, plain, tails, alone)

    monkeypatch.setattr(chat.model_step.runner, "packed_step", costed)
    engine = make_engine("full", prefill_chunk=256, draft="off")
    engine.scheduler.clock = lambda: now[0]
    engine.scheduler.planner.whole_messages = whole
    tokenizer = tokenizers[THINKING_TEMPLATE]
    streamer = engine.conversation("You are terse.")
    stream = Consumer(streamer, streamer.send("Talk on.", max_new_tokens=400, do_sample=False))
    wait_until(lambda: engine.batch_stats().steps >= 3)  # its decode steps timed
    warm = engine.conversation("You are terse.")  # a long message beside it: steps with prefill timed
    list(warm.send(" ".join(f"word{i}" for i in range(200)), **GREEDY))
    budget = engine.scheduler.step_budget
    cut, room = budget.tokens(256, 1), budget.whole_tokens(256, 1)  # about 120 and 150 (averaged timings)
    assert room - cut >= 28, (cut, room)
    newcomer = engine.conversation("You are terse.")
    fed.clear()  # a prompt whose tokens before its last lie between the two, less the shared system prompt's
    list(newcomer.send(message_of_prompt_length(tokenizer, "You are terse.", cut + 24, room + 1), **GREEDY))
    feeding = [tokens for step in fed for session, tokens in step if session == id(newcomer.session) and tokens > 1]
    assert sum(feeding) > cut and len(feeding) == (1 if whole else 2), (feeding, cut, room)
    streamer.stop()
    stream.join(60)
    assert stream.error is None
    monkeypatch.undo()
    check_exact(newcomer, models["full"], tokenizer, max_new_tokens=MAX_NEW)


def test_whole_messages_are_sized_to_three_and_a_half_decode_steps():
    """`whole_tokens`: nothing before a step of the rows and a prompt token were timed; then the
    tokens whose step beside the rows (the fitted fixed part and cost a token) stays within 3.5 of
    their decode steps, at most the cap: made-up seconds, three rows 25, a token 1."""
    budget = StepBudget(3.0)
    assert budget.whole_tokens(128, 3) == 0
    budget.record(25.0, decode_rows=3, prompt_tokens=0)
    assert budget.whole_tokens(128, 3) == 0  # no prompt token timed yet
    for tokens in (4, 12, 20, 8, 16):
        budget.record(25.0 + tokens, decode_rows=3, prompt_tokens=tokens)
    assert budget.tokens(128, 3) == 50 and budget.whole_tokens(128, 3) == 62  # 2.5 x 25 = 62.5
    assert budget.whole_tokens(40, 3) == 40
    fixed = StepBudget(3.0)  # a step with prompt tokens costs 10 more whatever their number: less room
    fixed.record(25.0, decode_rows=3, prompt_tokens=0)
    for tokens in (4, 12, 20, 8, 16):
        fixed.record(25.0 + 10 + tokens, decode_rows=3, prompt_tokens=tokens)
    assert fixed.whole_tokens(128, 3) == 52  # 10 + 52 = 62.5
    assert StepBudget(None).whole_tokens(128, 3) == 0


def test_a_step_apart_for_newcomers_is_sized_to_keep_the_other_rows_gap():
    """`apart_tokens`: nothing before a one-row step and a step of the rows were timed; then the
    tokens whose one-row step (the fitted fixed part and cost a token of steps with prefill) stays
    within two of the rows' steps (gap factor 3): made-up seconds, one row 15, three 25, a token 1."""
    budget = StepBudget(3.0)
    assert budget.apart_tokens(3) == 0
    budget.record(15.0, decode_rows=1, prompt_tokens=0)
    budget.record(25.0, decode_rows=3, prompt_tokens=0)
    assert budget.apart_tokens(3) == 0  # no prompt token timed yet
    for tokens in (4, 12, 20, 8, 16):
        budget.record(25.0 + tokens, decode_rows=3, prompt_tokens=tokens)
    assert budget.apart_tokens(3) == 35  # 15 + 35 = 2 x 25
    fixed = StepBudget(3.0)  # a step with prompt tokens costs 10 more whatever their number: less room
    fixed.record(15.0, decode_rows=1, prompt_tokens=0)
    fixed.record(25.0, decode_rows=3, prompt_tokens=0)
    for tokens in (4, 12, 20, 8, 16):
        fixed.record(25.0 + 10 + tokens, decode_rows=3, prompt_tokens=tokens)
    assert fixed.apart_tokens(3) == 25  # 15 + 10 + 25 = 2 x 25
    assert StepBudget(None).apart_tokens(3) == 0
