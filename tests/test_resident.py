"""Packed steps (chat/model_step/resident.py): decode rows and prefill pieces of several sessions in
one forward, each on its own cache, give every row what it gives alone.

The reference is a from-scratch forward over each row's whole sequence (no cache at all), and
greedy `generate` from scratch on each prompt."""

import weakref

import pytest
import torch

from cache_sessions import CacheSession
from cache_sessions.kv_cache import KVCacheKind
from chat.model_step import resident
from chat.model_step.plain_step import run_plain, takes_states
from chat.model_step.resident import forward_rows, packs, recurrent_mixers
from cache_sessions.rollback import RecurrentState
from chat.model_step.runner import ModelRunner
from chat.model_step.feeding import feed, rewind_and_prefill
from reference import (LOGIT_TOLERANCE, QUANTIZED_LOGIT_TOLERANCE, cached_vs_scratch_logit_error, fresh,
                       scratch_greedy_reply)

PROMPTS = [list(range(30, 42)), list(range(50, 75)), list(range(90, 130))]  # 12, 25 and 40 tokens
STEPS, CHUNK = 6, 7


def ready(model, prompt: list[int], kv_cache: KVCacheKind) -> CacheSession:
    session = CacheSession(model, kv_cache=kv_cache)
    rewind_and_prefill(model, session, prompt)
    feed(model, session, prompt[len(session.token_ids):-1])
    return session


@torch.no_grad()
def scratch_logits(model, token_ids: list[int], kv_cache: KVCacheKind) -> torch.Tensor:
    """One forward over the whole sequence; into an empty cache of the kind for a quantized one
    (what its states are quantized from), with no cache at all otherwise."""
    quantized = kv_cache.name == "quantized"
    return model(input_ids=torch.tensor([token_ids]), past_key_values=fresh(kv_cache if quantized else None, model),
                 use_cache=quantized).logits[0, -1]


@pytest.mark.parametrize("arch,kv_cache", [("full", KVCacheKind()), ("sliding", KVCacheKind()), ("mixed", KVCacheKind()),
                                           ("hybrid", KVCacheKind()), ("full", KVCacheKind("quantized", 8))])
def test_decode_rows_and_prefill_chunks_in_one_forward_give_each_row_its_own_result(models, arch, kv_cache):
    """Two sessions decode while a third is prefilled 7 tokens a step beside them in the same
    forwards, then decodes with them: every chosen token and logit is the scratch forward's, and
    every cache ends exact (and rolls back exactly)."""
    check_rows_against_scratch(models[arch], arch, kv_cache)


def test_a_recurrent_mixer_the_stacked_states_do_not_serve_runs_its_rows_one_by_one(models, monkeypatch):
    """Decoding rows' recurrent states are stacked for one call of a mixer; a mixer that asks
    them for anything else (another model's decode path) runs each row alone, still exact, and
    is not tried stacked again."""
    calls = []
    monkeypatch.setattr(resident, "_UNSTACKABLE", weakref.WeakSet())  # (the models are shared by the tests)
    monkeypatch.setattr(resident._StackedStates, "is_recording_past",
                        lambda self, layer_idx: calls.append(layer_idx) or self.anything_else)
    check_rows_against_scratch(models["hybrid"], "hybrid", KVCacheKind())
    mixers = recurrent_mixers(models["hybrid"])
    assert sorted(calls) == sorted(mixer.layer_idx for mixer in mixers)  # each tried once, and refused
    assert set(resident._UNSTACKABLE) == set(mixers)


@pytest.mark.parametrize("arch", ["full", "mixed", "hybrid"])
def test_the_runner_row_by_row_gives_each_row_its_own_result(models, arch):
    """A model whose layers cannot run packed (recurrent mixers it cannot find) gets the model's
    own forward on each row's cache in turn (chat/model_step/runner.py): the same checks against scratch."""
    runner = ModelRunner(models[arch])
    runner.packs = False  # as for such a model
    check_rows_against_scratch(models[arch], arch, KVCacheKind(), step=runner.run)


def check_rows_against_scratch(model, arch: str, kv_cache: KVCacheKind, step=None) -> None:
    step = step or (lambda rows, logits_of: forward_rows(model, rows, logits_of))
    tolerance = QUANTIZED_LOGIT_TOLERANCE[kv_cache.bits] if kv_cache.name == "quantized" else LOGIT_TOLERANCE
    sessions = [ready(model, prompt, kv_cache) for prompt in PROMPTS[:2]] + [CacheSession(model, kv_cache=kv_cache)]
    sessions[2].rewind_to(PROMPTS[2])
    assert packs(model, sessions)
    sequences = [list(prompt) for prompt in PROMPTS]  # what each row has fed or will feed next
    decoding, worst, mixed_steps = [0, 1], 0.0, 0
    while any(len(sequences[row]) - len(PROMPTS[row]) < STEPS for row in decoding) or len(decoding) < 3:
        rows = [(sessions[row], [sequences[row][-1]]) for row in decoding]
        if 2 not in decoding:
            held = len(sessions[2].token_ids)
            rows.append((sessions[2], PROMPTS[2][held:min(held + CHUNK, len(PROMPTS[2]) - 1)]))
            mixed_steps += 1
        logits = step(rows, list(range(len(decoding))))
        for session, fed in rows:
            session.note_extended(fed)
        for index, row in enumerate(decoding):
            worst = max(worst, float((logits[index] - scratch_logits(model, sequences[row], kv_cache)).abs().max()))
            sequences[row].append(int(logits[index].argmax()))
        if 2 not in decoding and len(sessions[2].token_ids) == len(PROMPTS[2]) - 1:
            decoding.append(2)  # prefilled: its last prompt token is fed by the next step
    assert mixed_steps == -(-(len(PROMPTS[2]) - 1) // CHUNK) >= 5
    assert worst < tolerance
    for session, prompt, sequence in zip(sessions, PROMPTS, sequences):
        reply = sequence[len(prompt):]
        assert reply == scratch_greedy_reply(model, prompt, len(reply), eos_ids=set())
        assert session.token_ids == sequence[:-1]  # the last chosen token is not fed yet
        assert cached_vs_scratch_logit_error(model, session.cache, session.token_ids, 7, kv_cache) < tolerance
    back = sessions[2]  # rolls back into the packed reply exactly
    rolled = rewind_and_prefill(model, back, back.token_ids[:-3] + [5])
    # A recurrent state goes back only to a checkpoint, which the scheduler takes (none here).
    assert rolled.reused_tokens > 0 or (arch == "hybrid" and rolled.rebuilt)
    assert cached_vs_scratch_logit_error(model, back.cache, back.token_ids, 7, kv_cache) < tolerance


def test_linear_attention_packs_with_its_mixers_run_per_row_and_put_back(models):
    """A recurrent state folds one sequence in order, so its mixer runs once per row in a packed
    step (the test above checks the rows against scratch); after the step the mixers are the
    model's own again, also when the step raises."""
    model = models["hybrid"]
    mixers = recurrent_mixers(model)
    recurrent = sum(isinstance(kind, RecurrentState) for kind in CacheSession(model).kinds)
    assert recurrent > 0 and len(mixers) == recurrent
    assert packs(model, [CacheSession(model)]) and packs(models["full"], [CacheSession(models["full"])])
    with pytest.raises(IndexError):  # a token past the vocabulary: the embedding raises mid-forward
        forward_rows(model, [(ready(model, PROMPTS[0], KVCacheKind()), [model.config.vocab_size])], [0])
    assert all("forward" not in vars(mixer) for mixer in mixers)
    forward_rows(model, [(ready(model, PROMPTS[1], KVCacheKind()), [PROMPTS[1][-1]])], [0])
    assert all("forward" not in vars(mixer) for mixer in mixers)


def test_a_packed_forward_leaves_the_model_as_it_was(models):
    """The attention implementation is switched for the packed forward only, also when it raises."""
    model = models["full"]
    before = model.config._attn_implementation
    session = ready(model, PROMPTS[0], KVCacheKind())
    with pytest.raises(ValueError, match="at least one token"):
        forward_rows(model, [(session, [])], [])
    forward_rows(model, [(session, [PROMPTS[0][-1]])], [0])
    assert model.config._attn_implementation == before


def test_stacked_query_heads_attend_as_keys_repeated_per_head():
    """A prompt chunk attends with the query heads that share a key/value head stacked (no copy
    of the history); the reference repeats the keys and values for every head, as transformers'
    SDPA path does, and masks each query's future by hand."""
    torch.manual_seed(0)
    kv_heads, groups, dim, chunk, history = 2, 3, 16, 5, 40
    query = torch.randn(1, kv_heads * groups, chunk, dim)
    keys, values = torch.randn(1, kv_heads, history, dim), torch.randn(1, kv_heads, history, dim)
    mask = torch.ones(1, 1, chunk, history, dtype=torch.bool).tril(history - chunk)
    module = torch.nn.Module()
    module.num_key_value_groups = groups
    output = resident._grouped_sdpa(module, query, keys, values, mask, 0.25)
    repeated_keys, repeated_values = (states.repeat_interleave(groups, dim=1) for states in (keys, values))
    scores = (query @ repeated_keys.transpose(-1, -2) * 0.25).masked_fill(~mask, float("-inf"))
    expected = (torch.softmax(scores, dim=-1) @ repeated_values).transpose(1, 2)
    assert output.shape == (1, chunk, kv_heads * groups, dim)
    assert torch.allclose(output, expected, atol=1e-5)


@pytest.mark.parametrize("path", ["packed", "plain", "row by row"])
def test_logits_are_made_only_after_the_tokens_asked(models, path):
    """A row that feeds the rest of its prompt with its first decode input wants the logits after
    its last token only, a row verifying two guesses after its last three (`tails`): each step
    path returns just those rows, each the scratch forward's at its length (the head's product
    over the vocabulary is not spent on the rest)."""
    model = models["full"]
    runner = ModelRunner(model)
    runner.packs = path != "row by row"
    step = {"packed": lambda rows, logits_of, tails: forward_rows(model, rows, logits_of, tails),
            "plain": lambda rows, logits_of, tails: run_plain(model, rows, logits_of, tails),
            "row by row": runner.run}[path]
    rest = CacheSession(model)  # nothing held: its whole prompt with its first decode input
    verifying = ready(model, PROMPTS[1], KVCacheKind())
    fed = [PROMPTS[1][-1], 7, 8]
    assert takes_states([rest, verifying])  # (the plain step takes them: a growing buffer each)
    logits = step([(verifying, fed), (rest, PROMPTS[2])], [1, 0], [1, 3])
    assert logits.shape == (4, model.config.vocab_size)
    expected = [scratch_logits(model, PROMPTS[2], KVCacheKind())] + [
        scratch_logits(model, PROMPTS[1][:-1] + fed[:place + 1], KVCacheKind()) for place in range(3)]
    for got, want in zip(logits, expected):
        assert float((got - want).abs().max()) < LOGIT_TOLERANCE

