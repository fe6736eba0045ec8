"""The offline `demo` model, and the tokenizer the tests and benchmarks train in code.

`demo` is a 3.2 M-parameter Qwen3 trained here on synthetic dialogues (`demo_model/`): it does
arithmetic with its steps in `<think>`, follow-ups and a few phrases, and nothing else. Its
weights are committed under chat/assets/demo, so it loads at once with no network.
`build_tokenizer` makes the byte-level BPE the tests' random models use (fixed corpus: the same
tokenizer every time).
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Added (not special) tokens, as in Qwen3: they decode as text so reasoning can be split.
ADDED_TOKENS = ["<think>", "</think>"]
ASSETS = Path(__file__).parent / "assets"

_WORDS = (
    "the a an and or but if then when while because so that this these those it its is are was were be "
    "been being have has had do does did can could will would should may might must shall not no yes "
    "hello hi thanks thank you please sorry okay sure maybe what why how who where which whose whom "
    "cache token tokens model models chat reply message messages user assistant system prompt think "
    "answer question reason reasoning step steps first second third next last more less many few one "
    "two three four five six seven eight nine ten zero number numbers add plus minus times equal sum "
    "time day week year today tomorrow yesterday morning evening night good bad better best new old "
    "small large tiny big fast slow quick memory layer layers window sliding linear attention state "
    "roll back rollback undo edit regenerate stop continue version versions history turn turns text "
    "word words write read code python data file list string value key keys values prefix suffix "
    "i me my we us our he she they them their his her your yours mine ours in on at to from by with "
    "about into over under after before between through during without within again once here there "
    "all any both each other some such only own same than too very just now also well even still"
)


def _corpus() -> list[str]:
    """A fixed synthetic corpus: words, numbers, punctuation and chat-like lines."""
    words = _WORDS.split()
    generator = torch.Generator().manual_seed(1234)
    lines = []
    for line_index in range(3000):
        count = 4 + line_index % 12
        picks = torch.randint(len(words), (count,), generator=generator).tolist()
        sentence = " ".join(words[i] for i in picks)
        number = int(torch.randint(10_000, (1,), generator=generator))
        lines.append(f"{sentence.capitalize()}, {number}? {sentence[::-1][:12]}!\n")
    lines.append("".join(chr(c) for c in range(32, 127)))
    lines.append("Ünïcödé ✓ — 漢字 😀 <script>alert(1)</script> \t tabs\nnew lines\n\n")
    return lines


def build_tokenizer(vocab_size: int = 2048, corpus: list[str] | None = None) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on a fixed corpus (the demo's by default) and wrap it for transformers."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus if corpus is not None else _corpus(), trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
    wrapped.add_tokens(ADDED_TOKENS)
    wrapped.chat_template = (ASSETS / "qwen3.jinja").read_text()
    return wrapped


DEMO_FOLDER = ASSETS / "demo"


def demo_folder() -> Path:
    """The trained demo model, committed with the code (rebuilt by `python -m demo_model.train`)."""
    if not (DEMO_FOLDER / "config.json").exists():
        raise FileNotFoundError(f"the demo model is missing from {DEMO_FOLDER}; run `python -m demo_model.train`")
    return DEMO_FOLDER
