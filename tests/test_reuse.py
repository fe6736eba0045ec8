"""Issue check 4: reuse is real. Turn N prefills the new message and glue, never the history."""

import pytest

from cache_sessions import common_prefix_length
from conftest import PLAIN_TEMPLATE
from tiny_models import ARCHS

# ChatML glue around a new user message (Qwen2.5 template).
GLUE_TEXT = ["<|im_end|>\n<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n"]
QUESTIONS = [
    "What is the capital of the tiny cache kingdom?",
    "Why does the window slide?",
    "How many tokens are in this sentence, roughly?",
    "Please undo that and tell me something new.",
    "Last question: what happens at turn five?",
]


def reply_tokens_to_refeed(tokenizer, reply_ids: list[int], content: str, rollback: str) -> int:
    """The re-rendered reply's tokens past what the cache can hold for it.

    Decode-then-encode can give other ids (byte-level BPE): from the first difference on, the
    re-rendered reply must be prefilled. Without a difference it is the last token alone, which
    generate sampled but never fed. Recurrent layers cannot stop mid-reply: they go back to the
    checkpoint at the generation start, one token before the reply.
    """
    reencoded = tokenizer(content, add_special_tokens=False)["input_ids"]
    if rollback == "checkpoint":
        return len(reencoded) + 1
    return max(1, len(reencoded) - common_prefix_length(reply_ids, reencoded))


@pytest.mark.parametrize("arch", ARCHS)
def test_turn_n_prefills_only_the_new_message(make_engine, tokenizers, arch):
    tokenizer = tokenizers[PLAIN_TEMPLATE]
    conv = make_engine(arch, PLAIN_TEMPLATE).conversation()
    history_tokens = []
    for turn, question in enumerate(QUESTIONS):
        previous = (conv.reply_ids, conv.messages[-1]["content"]) if turn else None
        list(conv.send(question, max_new_tokens=16, do_sample=False))
        stats = conv.stats
        history_tokens.append(stats.prompt_tokens)
        if previous is None:
            assert stats.reused_tokens == 0
            continue
        message_tokens = len(tokenizer(question, add_special_tokens=False)["input_ids"])
        refeed = reply_tokens_to_refeed(tokenizer, *previous, stats.rollback)
        glue = sum(len(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in GLUE_TEXT)
        assert stats.prefilled_tokens <= message_tokens + glue + refeed, (turn, stats, refeed)
        # the whole previous prompt, at least (less its last token when restored from a checkpoint)
        assert stats.reused_tokens >= history_tokens[turn - 1] - (stats.rollback == "checkpoint")
        assert not stats.rebuilt

    list(conv.regenerate(max_new_tokens=16, do_sample=False))
    held = 0 if conv.session.crops_anywhere() else 1  # the whole prompt where the logits after it were kept
    assert conv.stats.prefilled_tokens == held
    assert conv.stats.reused_tokens == conv.stats.prompt_tokens - held
