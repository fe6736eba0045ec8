"""Train the offline demo model: a small Qwen3 on the synthetic dialogues of `corpus.py`.

    python -m demo_model.train                   # from scratch: 6,000 steps, writes chat/assets/demo
    python -m demo_model.train --init chat/assets/demo --minutes 65   # go on from a trained model
    python -m demo_model.train --steps 200 --out /tmp/demo   # a quick look

`--init` starts from a saved model and keeps its tokenizer (the weights know its ids); `--minutes`
fixes the number of steps from the pace of the first 20, so the cosine schedule ends on time (the
steps it chose are saved, and `--steps N` repeats them).

Seeded: the tokenizer (a byte-level BPE with one token per digit, trained here on the corpus),
the weights and the batches. The loss counts only the last reply of each dialogue, the one the
model has to write; earlier turns are context, rendered as the app renders history. Weights are
saved in half precision.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from chat.demo import ADDED_TOKENS, ASSETS, SPECIAL_TOKENS
from chat.models import MODELS
from demo_model.corpus import Dialogue, sample_dialogue

OUT = ASSETS / "demo"
SHAPE = MODELS["demo"].settings  # a Qwen3 of 3.2 M parameters (chat/models.py)
VOCAB = 640


def render(tokenizer: PreTrainedTokenizerFast, dialogue: Dialogue) -> tuple[str, str]:
    """(prompt, target): the prompt exactly as the app renders it, the reply to learn."""
    prompt = tokenizer.apply_chat_template(dialogue.messages(), tokenize=False, add_generation_prompt=True,
                                           enable_thinking=dialogue.thinking)
    return prompt, dialogue.target() + "<|im_end|>"


def train_tokenizer(seed: int) -> PreTrainedTokenizerFast:
    rng = random.Random(seed)
    template = (ASSETS / "qwen3.jinja").read_text()
    plain = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE()))
    plain.chat_template = template
    texts = []
    for _ in range(20000):
        dialogue = sample_dialogue(rng)
        messages = dialogue.messages() + [{"role": "assistant", "content": dialogue.target()}]
        texts.append("\n".join(m["content"] for m in messages))
    tokenizer = Tokenizer(models.BPE())
    # Digits one by one (as Qwen's own tokenizer does): column arithmetic sees each digit.
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                       pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - len(ADDED_TOKENS), special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    wrapped.add_tokens(ADDED_TOKENS)
    wrapped.chat_template = template
    return wrapped


def encode(tokenizer: PreTrainedTokenizerFast, dialogue: Dialogue) -> tuple[list[int], int]:
    """Token ids and where the reply starts (loss from there on)."""
    prompt, target = render(tokenizer, dialogue)
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    return prompt_ids + tokenizer(target, add_special_tokens=False)["input_ids"], len(prompt_ids)


def batches(tokenizer: PreTrainedTokenizerFast, rng: random.Random, batch_size: int):
    """Endless batches of dialogues of similar length (little padding)."""
    pad = tokenizer.pad_token_id
    while True:
        pool = sorted((encode(tokenizer, sample_dialogue(rng)) for _ in range(batch_size * 32)),
                      key=lambda item: len(item[0]))
        groups = [pool[i : i + batch_size] for i in range(0, len(pool), batch_size)]
        rng.shuffle(groups)
        for group in groups:
            width = max(len(ids) for ids, _ in group)
            input_ids = torch.full((len(group), width), pad, dtype=torch.long)
            labels = torch.full((len(group), width), -100, dtype=torch.long)
            mask = torch.zeros((len(group), width), dtype=torch.long)
            for row, (ids, start) in enumerate(group):
                input_ids[row, : len(ids)] = torch.tensor(ids)
                labels[row, start : len(ids)] = torch.tensor(ids[start:])
                mask[row, : len(ids)] = 1
            yield input_ids, mask, labels


def learning_rate(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress)))


def starting_point(init: str | None, seed: int) -> tuple[PreTrainedTokenizerFast, Qwen3ForCausalLM, dict | None]:
    """(tokenizer, model, the summary of the training it went through): a saved model and its
    tokenizer (`init`), or a new tokenizer trained on the corpus and random weights."""
    if init:
        summary = Path(init) / "training.json"
        base = json.loads(summary.read_text()) if summary.exists() else {"init": init}
        base.pop("log", None)
        return (PreTrainedTokenizerFast.from_pretrained(init),
                Qwen3ForCausalLM.from_pretrained(init, dtype=torch.float32), base)
    tokenizer = train_tokenizer(seed)
    config = Qwen3Config(vocab_size=len(tokenizer), eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=None, **SHAPE)
    return tokenizer, Qwen3ForCausalLM(config), None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6000)
    parser.add_argument("--batch-size", type=int, default=24)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(OUT))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--init", default=None, help="a saved model folder to go on from (its tokenizer too)")
    parser.add_argument("--minutes", type=float, default=None, help="choose --steps to take about this long")
    parser.add_argument("--warmup", type=int, default=200)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    tokenizer, model, base = starting_point(args.init, args.seed)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    parameters = sum(p.numel() for p in model.parameters())
    print(f"{parameters / 1e6:.2f} M parameters, vocabulary {len(tokenizer)}", flush=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.05)
    started, seen, log = time.perf_counter(), 0, []
    model.train()
    stream = batches(tokenizer, rng, args.batch_size)
    step = 0
    while step < args.steps:
        if args.minutes and step == 20:  # the pace so far sets the length of the schedule
            pace = (time.perf_counter() - started) / step
            args.steps = max(21, int(args.minutes * 60 / pace))
            print(f"{pace:.2f} s a step: {args.steps} steps in {args.minutes} minutes", flush=True)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, args.steps, args.lr, warmup=args.warmup)
        input_ids, mask, labels = next(stream)
        loss = model(input_ids=input_ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        seen += int(mask.sum())
        if step % 50 == 0 or step == args.steps - 1:
            elapsed = time.perf_counter() - started
            log.append({"step": step, "loss": round(loss.item(), 4), "elapsed_s": round(elapsed, 1),
                        "tokens": seen})
            print(f"step {step:5d}  loss {loss.item():.4f}  {seen / elapsed:,.0f} tokens/s  {elapsed / 60:.1f} min",
                  flush=True)
        step += 1
    model.eval()
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    # Sample by default, as chat models ship: regenerate then gives another well-formed reply.
    model.generation_config.do_sample = True
    model.generation_config.temperature = 1.0  # digits stay right (evaluate.py), phrasing varies
    model.generation_config.top_k = 20
    out = Path(args.out)
    model.to(torch.float16).save_pretrained(out)
    tokenizer.save_pretrained(out)
    summary = {"parameters": parameters, "steps": args.steps, "batch_size": args.batch_size, "lr": args.lr,
               "seed": args.seed, "threads": args.threads, "warmup": args.warmup, "init": base,
               "train_minutes": round((time.perf_counter() - started) / 60, 1),
               "tokens": seen, "final_loss": log[-1]["loss"], "log": log}
    (out / "training.json").write_text(json.dumps(summary, indent=1))
    print(f"saved to {out}", flush=True)


if __name__ == "__main__":
    main()
