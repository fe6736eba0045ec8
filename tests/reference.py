"""Independent references: what recomputing everything from scratch gives.

Nothing here goes through the project's cache, rollback or template code: prompts are rendered
with `tokenizer.apply_chat_template` on the stored messages, and every forward starts empty.
"""

from __future__ import annotations

import copy

import torch

LOGIT_TOLERANCE = 1e-4  # fp32


def render_ids(tokenizer, messages, *, enable_thinking=None) -> list[int]:
    extra = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **extra)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@torch.no_grad()
def cached_vs_scratch_logit_error(model, cache, token_ids: list[int], probe_id: int) -> float:
    """Feed one probe token on a copy of `cache`; compare with a from-scratch forward."""
    assert cache.get_seq_length() == len(token_ids), "cache length differs from its ledger"
    probe = torch.tensor([[probe_id]])
    cached_logits = model(input_ids=probe, past_key_values=copy.deepcopy(cache), use_cache=True).logits[0, -1]
    scratch_logits = model(input_ids=torch.tensor([token_ids + [probe_id]])).logits[0, -1]
    return (cached_logits - scratch_logits).abs().max().item()


@torch.no_grad()
def scratch_greedy_reply(model, prompt_ids: list[int], max_new_tokens: int, eos_ids: set[int]) -> list[int]:
    output = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                            max_new_tokens=max_new_tokens, do_sample=False)
    reply = output[0, len(prompt_ids):].tolist()
    if reply and reply[-1] in eos_ids:
        reply = reply[:-1]
    return reply


def check_exact(conv, model, tokenizer, *, max_new_tokens: int | None, enable_thinking=None, stopped: bool = False,
                generated: bool = True, continued_from: int = 0) -> None:
    """The three checks of the issue after an operation: (a) states, (b) greedy reply, (c) stats.

    `stopped`: the reply is a prefix of the greedy one (cut short, or continued: then
    `max_new_tokens=None` compares with as many greedy tokens as the reply has).
    `continued_from`: reply tokens the last operation continued (its prompt ended with them)."""
    session = conv.session
    # (a) the cached states are those of a from-scratch forward over the ledger
    if session.token_ids:
        error = cached_vs_scratch_logit_error(model, session.cache, session.token_ids, probe_id=7)
        assert error < LOGIT_TOLERANCE, f"cached logits differ from scratch by {error:.2e}"
    messages = conv.messages
    if not messages or messages[-1]["role"] != "assistant":
        return
    # (b) the reply is what greedy generate gives from scratch on the re-rendered prompt
    prompt_ids = render_ids(tokenizer, messages[:-1], enable_thinking=enable_thinking)
    length = max_new_tokens if max_new_tokens is not None else len(conv.reply_ids)
    expected = scratch_greedy_reply(model, prompt_ids, max(length, 1), {tokenizer.convert_tokens_to_ids("<|im_end|>")})
    if stopped:
        assert conv.reply_ids == expected[: len(conv.reply_ids)]
    else:
        assert conv.reply_ids == expected, (conv.reply_ids, expected, conv.stats, messages)
    if not generated:  # undo: the stats describe an earlier operation
        return
    # (c) nothing reused was prefilled again, nothing prefilled was counted as reused
    assert conv.stats.prompt_tokens == len(prompt_ids) + continued_from
    assert conv.stats.prefilled_tokens == conv.stats.prompt_tokens - conv.stats.reused_tokens
