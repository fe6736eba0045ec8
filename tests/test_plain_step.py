"""The plain step (chat/model_step/plain_step.py): the decoder of the families it knows written out
over a packed sequence, decode rows and prompt pieces in one call, each row on its own cache.

The reference is a from-scratch forward over each row's whole sequence (no cache at all) and
greedy `generate` from scratch, through the same checks as the model's own packed forward
(tests/test_resident.py): every family it takes, a session started by the step, a row whose
every position's logits are kept (guesses verified), and the runner choosing it."""

import pytest
import torch
from transformers import (Gemma2Config, Gemma2ForCausalLM, LlamaConfig, LlamaForCausalLM, MistralConfig,
                          MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM)

import chat.model_step.runner
from cache_sessions import CacheSession
from cache_sessions.kv_cache import KVCacheKind
from chat.model_step.plain_step import layer_windows, plain_refusal, run_plain, takes_states
from chat.models import TINY_SLIDING_WINDOW
from chat.model_step.runner import ModelRunner
from reference import LOGIT_TOLERANCE
from test_resident import PROMPTS, check_rows_against_scratch, ready, scratch_logits

TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            num_hidden_layers=2, max_position_embeddings=2048, initializer_range=0.2, vocab_size=300,
            eos_token_id=None, bos_token_id=None, pad_token_id=None)


def family(name: str):
    """A tiny seeded model of another family the step knows (Qwen3 is the suite's own "full")."""
    torch.manual_seed(3)
    config, model_class, extra = {
        "llama": (LlamaConfig, LlamaForCausalLM, dict(rope_scaling={"rope_type": "linear", "factor": 2.0})),
        "mistral": (MistralConfig, MistralForCausalLM, dict(sliding_window=None)),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM, dict(use_sliding_window=False)),  # q/k/v with biases
        # Qwen2's window on its upper layers only (max_window_layers), as its config allows
        "qwen2-window": (Qwen2Config, Qwen2ForCausalLM, dict(use_sliding_window=True, sliding_window=TINY_SLIDING_WINDOW,
                                                             max_window_layers=1)),
        # Gemma2 as shipped: logits soft-capped in attention and at the head, a query scale of its
        # own, sliding and full layers alternating (the suite's "mixed" has no caps)
        "gemma2": (Gemma2Config, Gemma2ForCausalLM, dict(
            layer_types=["sliding_attention", "full_attention"], sliding_window=TINY_SLIDING_WINDOW,
            attn_logit_softcapping=2.0, final_logit_softcapping=3.0, query_pre_attn_scalar=9,
            attn_implementation="eager")),
    }[name]
    implementation = extra.pop("attn_implementation", None)  # Gemma2's caps: SDPA has none
    model = model_class(config(**TINY, **extra)).eval()
    if implementation:
        model.set_attn_implementation(implementation)
    if name == "qwen2":
        with torch.no_grad():  # its biases start at zero: give them weight, so dropping one shows
            for layer in model.model.layers:
                for projection in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    projection.bias.normal_(0, 0.5)
    return model


@pytest.fixture(scope="module")
def families(models):
    return {"qwen3": models["full"], "mistral-window": models["sliding"], "gemma2-uncapped": models["mixed"],
            **{name: family(name) for name in ("llama", "mistral", "qwen2", "qwen2-window", "gemma2")}}


FAMILIES = ["qwen3", "llama", "mistral", "qwen2", "mistral-window", "qwen2-window", "gemma2", "gemma2-uncapped"]


@pytest.mark.parametrize("name", FAMILIES)
def test_the_plain_step_gives_every_row_what_a_forward_from_scratch_gives(families, name, monkeypatch):
    """Two rows decode while a third (its cache started by the step) is prefilled 7 tokens a step
    beside them, then decodes with them: every logit within 1e-4 of the scratch forward's, every
    greedy reply the scratch reply, every cache exact and rolled back exactly. Every step ran
    as the plain step."""
    model = families[name]
    assert plain_refusal(model) is None
    ran = []

    def plain(rows, logits_of):
        assert takes_states([session for session, _ in rows])
        ran.append(len(rows))
        return run_plain(model, rows, logits_of)

    check_rows_against_scratch(model, "full", KVCacheKind(), step=plain)
    assert ran and max(ran) == 3


@pytest.mark.parametrize("name", ["qwen3", "gemma2", "mistral-window", "qwen2-window"])
def test_every_position_of_a_row_is_kept_where_asked(families, name):
    """A decoding row fed its next input and four guesses (chat/scheduling/drafting.py) beside a decode row
    and a prompt piece: the logits after each of its tokens are the scratch forward's at that
    length, and the cache then holds all five (a sliding window's masks cover the guesses too)."""
    model = families[name]
    verifying, decoding = ready(model, PROMPTS[1], KVCacheKind()), ready(model, PROMPTS[0], KVCacheKind())
    piece = ready(model, PROMPTS[2][:20], KVCacheKind())
    fed = [PROMPTS[1][-1], 7, 8, 9, 10]
    logits = run_plain(model, [(decoding, [PROMPTS[0][-1]]), (verifying, fed), (piece, PROMPTS[2][19:30])], [1, 0])
    assert logits.shape == (6, model.config.vocab_size)
    for place in range(5):
        expected = scratch_logits(model, PROMPTS[1][:-1] + fed[:place + 1], KVCacheKind())
        assert float((logits[place] - expected).abs().max()) < LOGIT_TOLERANCE
    assert float((logits[5] - scratch_logits(model, PROMPTS[0], KVCacheKind())).abs().max()) < LOGIT_TOLERANCE
    assert all(layer.get_seq_length() == len(PROMPTS[1]) - 1 + 5 for layer in verifying.cache.layers)
    fresh = CacheSession(model)  # a prompt piece alone: no logits asked, none made; the cache holds it
    assert run_plain(model, [(fresh, PROMPTS[0])], []).shape == (0, model.config.vocab_size)
    assert all(layer.get_seq_length() == len(PROMPTS[0]) for layer in fresh.cache.layers)


@pytest.mark.parametrize("arch,held", [("full", 40), ("sliding", 3), ("sliding", 40)])
def test_with_int8_weights_guesses_verified_alone_get_the_bits_of_decoding_them_one_by_one(arch, held):
    """Int8 products give a row the same bits whatever rows are beside it, so a row verifying
    guesses (the rest of its prompt together, then its last input and its guesses attending one
    by one) must give exactly what feeding the rest, then each token as a decode step, gives,
    beside another row as well: same bits, so a greedy reply with guesses is the reply without,
    and a Retry's step of the prompt's last token alone gives what the first reply's step gave.
    Heads as wide as real models' (one call for the whole row rounds another way there); a
    sliding window filled and not yet filled."""
    from chat.model_step.weights import apply_weight_format, products_keep_rows_apart
    from tiny_models import wide_heads_model

    model = apply_weight_format(wide_heads_model(arch, 300, None), "int8")
    assert products_keep_rows_apart(model)
    history, other = list(range(60, 61 + held)), PROMPTS[0]  # (`ready` holds all but the last)
    for inputs in (1, 3, 9):  # its next input alone, or with the rest of its prompt
        fed = list(range(5, 5 + inputs)) + [31, 32, 33, 34, 35, 36]
        one_by_one, expected = ready(model, history, KVCacheKind()), []
        if inputs > 1:
            run_plain(model, [(one_by_one, fed[:inputs - 1])], [])
            one_by_one.note_extended(fed[:inputs - 1])
        for token in fed[inputs - 1:]:
            expected.append(run_plain(model, [(one_by_one, [token])], [0]))
            one_by_one.note_extended([token])
        verifying, beside = ready(model, history, KVCacheKind()), ready(model, other, KVCacheKind())
        logits = run_plain(model, [(beside, [other[-1]]), (verifying, fed)], [1], [len(fed) - inputs + 1],
                           alone=[0, len(fed) - inputs + 1])
        assert torch.equal(logits, torch.cat(expected)), (arch, held, inputs)


def test_what_the_plain_step_does_not_take(models, families):
    """Recurrent layers and other families refuse it (the model's own forward runs them); a
    quantized cache's states are not buffers it writes; a ledger out of step with the cache is
    not trusted. Sliding windows it takes: each layer's window as the model's own masks read it."""
    assert "not one of the plain decoders" in plain_refusal(models["hybrid"])
    assert layer_windows(models["sliding"]) == [TINY_SLIDING_WINDOW] * 2  # Mistral: every layer
    assert layer_windows(models["mixed"]) == [TINY_SLIDING_WINDOW, None] * 2  # Gemma2: its layer kinds
    assert layer_windows(families["qwen2-window"]) == [None, TINY_SLIDING_WINDOW]  # from max_window_layers up
    assert layer_windows(families["qwen2"]) == [None, None]
    model = models["full"]
    assert not takes_states([ready(model, PROMPTS[0], KVCacheKind("quantized", 8))])
    session = ready(model, PROMPTS[0], KVCacheKind())
    assert takes_states([session, CacheSession(model)])
    session.token_ids.append(5)  # the ledger says one more than the cache holds
    assert not takes_states([session])
    window = ready(models["mixed"], PROMPTS[0], KVCacheKind())
    assert takes_states([window])
    window.token_ids.append(5)
    assert not takes_states([window])
    assert not takes_states([ready(models["hybrid"], PROMPTS[0], KVCacheKind())])


@pytest.mark.parametrize("arch,plain", [("full", True), ("sliding", True), ("mixed", True), ("hybrid", False)])
def test_the_runner_runs_the_plain_step_where_it_takes(models, monkeypatch, arch, plain):
    """The runner's eager step is the plain step for a family it knows and the model's own packed
    forward otherwise: both give the scratch forward's logits."""
    model = models[arch]
    used = []
    own_plain, own_forward = chat.model_step.runner.run_plain, chat.model_step.runner.forward_rows
    monkeypatch.setattr(chat.model_step.runner, "run_plain", lambda *args: used.append("plain") or own_plain(*args))
    monkeypatch.setattr(chat.model_step.runner, "forward_rows", lambda *args: used.append("forward") or own_forward(*args))
    runner = ModelRunner(model)
    assert (runner.plain_refusal is None) == plain
    session = ready(model, PROMPTS[2], KVCacheKind())
    logits = runner.run([(session, [PROMPTS[2][-1]])], [0])
    assert used == ["plain" if plain else "forward"]
    assert float((logits[0] - scratch_logits(model, PROMPTS[2], KVCacheKind())).abs().max()) < LOGIT_TOLERANCE


def test_status_says_which_step_runs(make_engine):
    """`/status` names the eager step and why it is not the plain one."""
    assert make_engine("full").status()["model_step"] == {"eager": "plain", "not_plain_because": None,
                                                           "rows_kept_apart": None}
    assert make_engine("mixed").status()["model_step"] == {"eager": "plain", "not_plain_because": None,
                                                           "rows_kept_apart": None}
    hybrid = make_engine("hybrid").status()["model_step"]
    assert hybrid["eager"] == "the model's own forward, packed" and "Qwen3Next" in hybrid["not_plain_because"]
    quantized = make_engine("full", kv_cache="quantized").status()["model_step"]
    assert quantized["eager"] != "plain" and "quantized cache" in quantized["not_plain_because"]
