"""What "exact" holds, per mode, measured on the trained demo model.

For each mode, one conversation runs send, send, regenerate, edit, send (arithmetic questions of
the demo's evaluation split, greedy, thinking on) with prefill in 7-token chunks (the worst case
seen), and four more run the same script at once (decoded in one batch). Against references
that never touch the engine's cache:

  replies = scratch   each reply against greedy `generate` from an empty cache (of the mode's
                      kind) on the re-rendered prompt, same model: the share identical
  max logit diff      after each operation of the single conversation, one probe token fed on a
                      copy of the cached states against a from-scratch forward: the largest
                      absolute difference of the next-token logits
  replies = fp32      scratch replies of this mode's model against the fp32 model's (the model's
                      own precision, not rollback)

"int8, outlier channels" is the demo model with the massive activations of real checkpoints put
in by hand: a few channels of each norm's output scaled up by `OUTLIER_SCALE`, and the same
channels of the weights reading them scaled down, so the fp32 model computes the same function;
int8's per-token input scale then spends its 127 levels on those channels.

    python -m benchmarks.exactness
"""

from __future__ import annotations

import copy
import json
import sys
import threading
from pathlib import Path

import torch

from cache_sessions.kv_cache import KVCacheKind
from chat import ChatEngine
from chat.config import EngineConfig
from chat.loading import load_model_and_tokenizer
from demo_model import corpus

RESULTS = Path(__file__).parent / "results" / "exactness.json"
OUTLIER_SCALE = 40.0
OUTLIER_CHANNELS = 4
MAX_NEW = 80
MODES = {  # name: (dtype, weights, kv cache kind, outlier channels)
    "float32": ("float32", "full", KVCacheKind(), False),
    "bfloat16": ("bfloat16", "full", KVCacheKind(), False),
    "int8": ("float32", "int8", KVCacheKind(), False),
    "float32, outlier channels": ("float32", "full", KVCacheKind(), True),
    "int8, outlier channels": ("float32", "int8", KVCacheKind(), True),
    "KV 8-bit": ("float32", "full", KVCacheKind("quantized", 8), False),
    "KV 4-bit": ("float32", "full", KVCacheKind("quantized", 4), False),
}


@torch.no_grad()
def add_outlier_channels(model: torch.nn.Module) -> None:
    """The same function with a few huge activation channels: each RMSNorm's gain times s on
    `OUTLIER_CHANNELS` channels, the columns of every linear layer reading that norm divided by s."""
    generator = torch.Generator().manual_seed(0)
    for layer in model.model.layers:
        for norm, readers in ((layer.input_layernorm, (layer.self_attn.q_proj, layer.self_attn.k_proj,
                                                        layer.self_attn.v_proj)),
                              (layer.post_attention_layernorm, (layer.mlp.gate_proj, layer.mlp.up_proj))):
            channels = torch.randperm(norm.weight.numel(), generator=generator)[:OUTLIER_CHANNELS]
            norm.weight[channels] *= OUTLIER_SCALE
            for linear in readers:
                linear.weight[:, channels] /= OUTLIER_SCALE


def questions(count: int, seed: int) -> list[str]:
    import random

    rng = random.Random(seed)
    return [corpus.question_text(rng, corpus.first_problem(rng, evaluation=True), evaluation=True)
            for _ in range(count)]


def script(conversation, asked: list[str], after=lambda: None) -> list[tuple[list[dict], list[int]]]:
    """send, send, regenerate, edit, send: each reply with the messages it answered."""
    options = dict(max_new_tokens=MAX_NEW, do_sample=False, enable_thinking=True)
    replies = []
    for operation in (lambda: conversation.send(asked[0], **options), lambda: conversation.send(asked[1], **options),
                      lambda: conversation.regenerate(**options), lambda: conversation.edit(0, asked[2], **options),
                      lambda: conversation.send(asked[3], **options)):
        for _ in operation():
            pass
        replies.append((copy.deepcopy(conversation.messages[:-1]), list(conversation.reply_ids)))
        after()
    return replies


def render(tokenizer, messages: list[dict]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@torch.no_grad()
def scratch_reply(model, prompt: list[int], kind: KVCacheKind, eos: set[int]) -> list[int]:
    cache = kind.new_cache(model) if kind.name != "dynamic" else None
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=MAX_NEW, do_sample=False, past_key_values=cache)[0, len(prompt):].tolist()
    return out[:-1] if out and out[-1] in eos else out


@torch.no_grad()
def logit_diff(model, session, kind: KVCacheKind, probe: int = 7) -> float:
    ids = list(session.token_ids)
    cached = model(input_ids=torch.tensor([[probe]]), past_key_values=copy.deepcopy(session.cache),
                   use_cache=True).logits[0, -1].float()
    scratch_cache = kind.new_cache(model) if kind.name != "dynamic" else None
    scratch = model(input_ids=torch.tensor([ids + [probe]]), past_key_values=scratch_cache,
                    use_cache=scratch_cache is not None).logits[0, -1].float()
    return (cached - scratch).abs().max().item()


def run_mode(name: str, fp32_replies: dict[tuple, list[int]] | None) -> dict:
    dtype, weights, kind, outliers = MODES[name]
    model, tokenizer = load_model_and_tokenizer("demo", dtype=dtype)
    if outliers:
        add_outlier_channels(model)
    engine = ChatEngine(model, tokenizer, EngineConfig(weights=weights, kv_cache=kind.name, kv_bits=kind.bits,
                                                       prefill_chunk=7, prefill_chunk_alone=7))
    eos = {tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id}
    single = engine.conversation()
    diffs: list[float] = []
    replies = script(single, questions(4, 0), after=lambda: diffs.append(logit_diff(model, single.session, kind)))
    together: list[list] = [[] for _ in range(4)]
    threads = [threading.Thread(target=lambda i=i: together[i].extend(script(engine.conversation(),
                                                                              questions(4, 1 + i))))
               for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    replies += [reply for row in together for reply in row]
    scratch = {}
    for messages, _ in replies:
        key = json.dumps(messages, sort_keys=True)
        scratch[key] = scratch_reply(model, render(tokenizer, messages), kind, eos)
    same = sum(scratch[json.dumps(m, sort_keys=True)] == ids for m, ids in replies)
    result = {"replies": len(replies), "equal_to_scratch": same, "max_logit_diff": max(diffs),
              "logit_diffs": diffs, "scratch": scratch}
    if fp32_replies is not None:
        both = [key for key in scratch if key in fp32_replies]  # the same messages (later turns hold each one's replies)
        result["equal_to_fp32"] = sum(fp32_replies[key] == scratch[key] for key in both)
        result["compared_to_fp32"] = len(both)
    return result


def main() -> None:
    results: dict[str, dict] = {}
    for name in MODES:
        reference = "float32, outlier channels" if "outlier" in name else "float32"
        fp32 = results[reference]["scratch"] if reference in results and name != reference else None
        results[name] = run_mode(name, fp32)
        shown = results[name]
        print(f"{name}: {shown['equal_to_scratch']}/{shown['replies']} replies = scratch, max logit diff "
              f"{shown['max_logit_diff']:.2g}" + (f", {shown['equal_to_fp32']}/{shown['compared_to_fp32']} scratch "
                                                 f"replies = the fp32 model's" if "equal_to_fp32" in shown else ""),
              flush=True)
    for shown in results.values():
        shown.pop("scratch")
    RESULTS.write_text(json.dumps({"modes": results, "command": "python -m benchmarks.exactness " +
                                   " ".join(sys.argv[1:]), "torch": torch.__version__}, indent=1))


if __name__ == "__main__":
    main()
