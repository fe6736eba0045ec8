"""Independent references: what recomputing everything from scratch gives.

Nothing here goes through the project's cache, rollback or template code: prompts are rendered
with `tokenizer.apply_chat_template` on the stored messages, and every forward starts empty.
"""

from __future__ import annotations

import copy

import torch

LOGIT_TOLERANCE = 1e-4  # fp32
# A quantized cache (quantized once per token) equals an empty cache of its kind fed the same
# tokens, except where float noise (differently shaped matmuls) puts a value on the other side of
# a rounding boundary: one code one step off. Seen: 1 code in 2,600 at 8 bits, moving a logit by
# 2.8e-4; a step at 4 bits is 17x larger. A stale state puts many codes many steps off.
QUANTIZED_LOGIT_TOLERANCE = {8: 1e-3, 4: 1e-2}
MAX_FLIPPED_CODES = 1 / 200
# int8 weights (chat/model_step/weights.py): float noise between the cached path and the scratch forward
# (different shapes and kernels; linear attention's recurrence against its chunked prefill) can
# put a product on the other side of a bf16 rounding boundary, one step off, and a top logit
# within a hair of the next then loses its place. States of other tokens (stale) differed by 5.2
# or more. On these random models ~1.3 tokens of 2,050 lie within 0.1 of the top on average.
INT8_LOGIT_TOLERANCE = 0.1
# With the "bf16" prompt product (chat/model_step/weights.py, where the CPU multiplies bf16 natively) a
# prompt's products may round partial sums to bf16: cached and scratch logits of the tiny
# attention models then differ by up to ~0.12 (measured), still far below a stale state's 5.2.
INT8_BF16_PROMPT_LOGIT_TOLERANCE = 0.25


def int8_logit_tolerance(model) -> float:
    """What an int8 model's logits may differ by between cached and scratch, by its prompt product."""
    from chat.model_step.weights import Int8Linear
    kernels = {module.prompt_kernel for module in model.modules() if isinstance(module, Int8Linear)}
    return INT8_BF16_PROMPT_LOGIT_TOLERANCE if "bf16" in kernels else INT8_LOGIT_TOLERANCE


def render_ids(tokenizer, messages, *, enable_thinking=None) -> list[int]:
    extra = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **extra)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def fresh(kv_cache, model):
    """An empty cache of the kind under test (None: the model's own default, no cache given)."""
    return None if kv_cache is None else kv_cache.new_cache(model)


@torch.no_grad()
def cached_vs_scratch_logit_error(model, cache, token_ids: list[int], probe_id: int, kv_cache=None) -> float:
    """Feed one probe token on a copy of `cache`; compare with a from-scratch forward (into an
    empty cache of `kv_cache`'s kind, when the kind itself is lossy: what exact means for it)."""
    assert cache.get_seq_length() == len(token_ids), "cache length differs from its ledger"
    probe = torch.tensor([[probe_id]])
    cached_logits = model(input_ids=probe, past_key_values=copy.deepcopy(cache), use_cache=True).logits[0, -1]
    scratch_logits = model(input_ids=torch.tensor([token_ids + [probe_id]]), past_key_values=fresh(kv_cache, model),
                           use_cache=kv_cache is not None).logits[0, -1]
    return (cached_logits - scratch_logits).abs().max().item()


@torch.no_grad()
def flipped_codes(model, cache, token_ids: list[int], kv_cache) -> tuple[int, int, int]:
    """The quantized codes of `cache` against those of an empty cache of `kv_cache`'s kind fed
    `token_ids` in one forward: (how many differ, the largest difference in steps, how many in all)."""
    scratch = kv_cache.new_cache(model)
    model(input_ids=torch.tensor([token_ids]), past_key_values=scratch, use_cache=True)
    differ = largest = total = 0
    for held, expected in zip(cache.layers, scratch.layers):
        if not hasattr(held, "bits"):  # not a quantized layer
            continue
        for name in ("keys", "values"):
            for a, b in zip(_levels(getattr(held, name), held.bits), _levels(getattr(expected, name), held.bits)):
                steps = (a - b).abs()
                differ += int((steps > 0).sum())
                largest, total = max(largest, int(steps.max())), total + a.numel()
    return differ, largest, total


def _levels(codes, bits: int):
    """A layer's codes as whole levels (two 4-bit codes share a byte)."""
    codes = codes.to(torch.int16)
    return (codes,) if bits == 8 else (codes & 15, codes >> 4)


def check_states(model, cache, token_ids: list[int], kv_cache=None, logit_tolerance: float = LOGIT_TOLERANCE) -> None:
    """(a) of `check_exact`: the cache holds what a from-scratch forward over `token_ids` gives."""
    error = cached_vs_scratch_logit_error(model, cache, token_ids, probe_id=7, kv_cache=kv_cache)
    if kv_cache is None or kv_cache.name == "dynamic":
        assert error < logit_tolerance, f"cached logits differ from scratch by {error:.2e}"
        return
    differ, largest, total = flipped_codes(model, cache, token_ids, kv_cache)
    assert largest <= 1 and differ <= max(2, total * MAX_FLIPPED_CODES), (differ, largest, total)
    assert error < QUANTIZED_LOGIT_TOLERANCE[kv_cache.bits], f"cached logits differ from scratch by {error:.2e}"


@torch.no_grad()
def scratch_greedy_reply(model, prompt_ids: list[int], max_new_tokens: int, eos_ids: set[int],
                         kv_cache=None) -> list[int]:
    output = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                            max_new_tokens=max_new_tokens, do_sample=False, past_key_values=fresh(kv_cache, model))
    reply = output[0, len(prompt_ids):].tolist()
    if reply and reply[-1] in eos_ids:
        reply = reply[:-1]
    return reply


@torch.no_grad()
def check_near_greedy(model, prompt_ids: list[int], reply: list[int], tolerance: float,
                      end_id: int | None = None) -> None:
    """Each token of `reply` is the top one of a from-scratch forward over all before it, or
    within `tolerance` of it (a near-tie float noise may turn either way); with `end_id`, the
    reply's end is too. What greedy means for a lossy model: a reply that went another way at a
    near-tie cannot be compared with `generate`'s token for token after it, but each of its own
    tokens can be checked, and a stale state makes far worse choices."""
    ids = prompt_ids + reply + ([] if end_id is None else [end_id])
    logits = model(input_ids=torch.tensor([ids])).logits[0, len(prompt_ids) - 1: len(ids) - 1].float()
    chosen = logits.gather(1, torch.tensor(ids[len(prompt_ids):])[:, None]).squeeze(1)
    shortfall = logits.max(dim=1).values - chosen
    assert shortfall.numel() == 0 or shortfall.max() <= tolerance, f"a reply token {shortfall.max():.3f} below the top"


def without_oldest_turns(messages: list[dict], turns: int) -> list[dict]:
    """`messages` less their `turns` oldest user turns (a user message and what answered it);
    what comes before the first user message (a system prompt) stays."""
    if not turns:
        return messages
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    return messages[:users[0]] + messages[users[turns]:]


def check_exact(conv, model, tokenizer, *, max_new_tokens: int | None, enable_thinking=None, stopped: bool = False,
                generated: bool = True, continued_from: int = 0, kv_cache=None,
                logit_tolerance: float = LOGIT_TOLERANCE, near_greedy: bool = False, dropped_turns: int = 0) -> None:
    """The three checks of the issue after an operation: (a) states, (b) greedy reply, (c) stats.
    `kv_cache`: a lossy kind (quantized): the references start from an empty cache of that kind.
    `near_greedy`: lossy weights: (b) holds each reply token within `logit_tolerance` of the
    scratch forward's top (`check_near_greedy`) instead of equal to `generate`'s reply.

    `stopped`: the reply is a prefix of the greedy one (cut short, or continued: then
    `max_new_tokens=None` compares with as many greedy tokens as the reply has).
    `continued_from`: reply tokens the last operation continued (its prompt ended with them).
    `dropped_turns`: the oldest user turns the reply's prompt left out to fit the context (they
    stay in the conversation; the prompt is the system prompt and the turns after them)."""
    session = conv.session
    # (a) the cached states are those of a from-scratch forward over the ledger
    if session.token_ids:
        check_states(model, session.cache, session.token_ids, kv_cache, logit_tolerance)
    messages = conv.messages
    if not messages or messages[-1]["role"] != "assistant":
        return
    # (b) the reply is what greedy generate gives from scratch on the re-rendered prompt
    prompt_ids = render_ids(tokenizer, without_oldest_turns(messages[:-1], dropped_turns), enable_thinking=enable_thinking)
    length = max_new_tokens if max_new_tokens is not None else len(conv.reply_ids)
    if near_greedy:
        ended = not stopped and max_new_tokens is not None and len(conv.reply_ids) < max_new_tokens
        check_near_greedy(model, prompt_ids, conv.reply_ids, logit_tolerance,
                          tokenizer.convert_tokens_to_ids("<|im_end|>") if ended else None)
    else:
        expected = scratch_greedy_reply(model, prompt_ids, max(length, 1), {tokenizer.convert_tokens_to_ids("<|im_end|>")},
                                        kv_cache=kv_cache)
        if stopped:
            assert conv.reply_ids == expected[: len(conv.reply_ids)]
        else:
            assert conv.reply_ids == expected, (conv.reply_ids, expected, conv.stats, messages)
    if not generated:  # undo: the stats describe an earlier operation
        return
    # (c) nothing reused was prefilled again, nothing prefilled was counted as reused
    assert conv.stats.prompt_tokens == len(prompt_ids) + continued_from
    assert conv.stats.prefilled_tokens == conv.stats.prompt_tokens - conv.stats.reused_tokens


@torch.no_grad()
def decode_together(model, sessions, last_tokens, steps):
    """Greedy rows decoded together by the engine's runner, one step for all (chat/model_step/runner.py):
    each session prefilled to all but its last prompt token, which is fed first."""
    from chat.model_step.runner import ModelRunner

    runner, tokens, replies = ModelRunner(model), list(last_tokens), [[] for _ in sessions]
    for _ in range(steps):
        rows = [(session, [token]) for session, token in zip(sessions, tokens)]
        logits = runner.run(rows, range(len(rows)))
        for session, fed in rows:
            session.note_extended(fed)
        tokens = logits.argmax(-1).tolist()
        for reply, token in zip(replies, tokens):
            reply.append(token)
    return replies
