"""Batched decode across sessions: each row decodes as it would alone, each cache stays exact.

The decode loop here is the plainest one (forward, argmax); the reference is greedy `generate`
from scratch on each prompt, and a from-scratch forward over each session's ledger."""

import pytest
import torch

from cache_sessions import CacheSession
from cache_sessions.batch import BatchedCache
from reference import LOGIT_TOLERANCE, cached_vs_scratch_logit_error, scratch_greedy_reply
from tiny_models import ARCHS

PROMPTS = [list(range(30, 42)), list(range(50, 75)), list(range(90, 130))]  # 12, 25 and 40 tokens
STEPS = 10


def ready(model, prompt: list[int]) -> CacheSession:
    """A session as a request reaches the decode batch: prefilled to all but the last token."""
    session = CacheSession(model)
    session.prepare(prompt)
    session.extend(prompt[len(session.token_ids):-1])
    return session


@torch.no_grad()
def decode(model, sessions, last_tokens, steps):
    batch = BatchedCache(model, sessions)
    tokens, replies = list(last_tokens), [[] for _ in sessions]
    for _ in range(steps):
        logits = model(**batch.inputs(tokens)).logits[:, -1]
        batch.fed(tokens)
        tokens = logits.argmax(-1).tolist()
        for reply, token in zip(replies, tokens):
            reply.append(token)
    batch.scatter()
    return replies


def assert_alone_and_exact(model, session, prompt, reply):
    expected = scratch_greedy_reply(model, prompt, len(reply), eos_ids=set())
    assert reply[: len(expected)] == expected
    assert session.token_ids == prompt + reply[:-1]  # the last sampled token is not fed yet
    assert cached_vs_scratch_logit_error(model, session.cache, session.token_ids, 7) < LOGIT_TOLERANCE


@pytest.mark.parametrize("arch", ARCHS)
def test_rows_of_different_lengths_decode_as_alone(models, arch):
    model = models[arch]
    model.generation_config.eos_token_id = None  # a random model may say end-of-turn: keep going
    try:
        sessions = [ready(model, prompt) for prompt in PROMPTS]
        replies = decode(model, sessions, [p[-1] for p in PROMPTS], STEPS)
        for session, prompt, reply in zip(sessions, PROMPTS, replies):
            assert_alone_and_exact(model, session, prompt, reply)
        # and each session rolls back exactly afterwards, into the reply too
        back = sessions[2]
        result = back.prepare(back.token_ids[:-3] + [5])
        assert result.reused_tokens > 0
        assert cached_vs_scratch_logit_error(model, back.cache, back.token_ids, 7) < LOGIT_TOLERANCE
    finally:
        model.generation_config.eos_token_id = models["full"].generation_config.pad_token_id


@pytest.mark.parametrize("arch", ARCHS)
def test_a_row_joins_and_another_leaves_between_batches(models, arch):
    model = models[arch]
    model.generation_config.eos_token_id = None
    try:
        first, second, third = (ready(model, prompt) for prompt in PROMPTS)
        replies = decode(model, [first, second], [PROMPTS[0][-1], PROMPTS[1][-1]], 4)
        # the third arrives; the first leaves after 3 more steps, the others go on
        more = decode(model, [first, second, third], [replies[0][-1], replies[1][-1], PROMPTS[2][-1]], 3)
        rest = decode(model, [second, third], [more[1][-1], more[2][-1]], 5)
        assert_alone_and_exact(model, first, PROMPTS[0], replies[0] + more[0])
        assert_alone_and_exact(model, second, PROMPTS[1], replies[1] + more[1] + rest[0])
        assert_alone_and_exact(model, third, PROMPTS[2], more[2] + rest[1])
    finally:
        model.generation_config.eos_token_id = models["full"].generation_config.pad_token_id
