"""What one packed step costs, its kinds alternated in one process.

Three steps on one model, each over histories prefilled once (untimed), each run as the engine's
plain step (chat/model_step/plain_step.py) and as the model's own packed forward
(chat/model_step/resident.py, what runs the families the plain step does not know):

  one row      a decode step of one conversation (`--history` tokens)
  four rows    a decode step of four conversations of that length: per token against one row is
               the target "4 at once <= 1.6x one alone"
  mixed        one decode row beside `--chunk` prompt tokens of a conversation at
               `--prompt-history` tokens (the step a streaming user waits on while another prefills);
               the model's own forward with the query heads that share a key/value head stacked (the
               engine's way) and with the keys and values repeated per head (transformers' SDPA
               path whenever a mask is given)

Each kind runs `--steps` steps a round, the kinds in a rotating order, `--rounds` rounds; medians.

    python -m benchmarks.step_anatomy                              # bench-full, 1,000 / 3,000 tokens, 16 a chunk
    python -m benchmarks.step_anatomy --model real-qwen3-0.6b
    python -m benchmarks.step_anatomy --weights packed               # fp32 in oneDNN's layout (chat/model_step/weights.py)
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import statistics
import time
from typing import Callable, Iterator
from unittest import mock

import torch

from benchmarks.report import publish, target_table
from chat.model_step import resident
from chat.model_step.plain_step import run_plain
from cache_sessions.session import CacheSession
from chat.models import build_model
from chat.model_step.weights import WEIGHT_FORMATS, apply_weight_format
from chat.model_step.feeding import feed, rewind_and_prefill

VOCAB = 8192
PLAIN_KINDS = ("one row", "four rows", "mixed")
KINDS = PLAIN_KINDS + ("one row, own forward", "four rows, own forward", "mixed, own forward, heads stacked",
                       "mixed, own forward, keys repeated")


@contextlib.contextmanager
def keys_repeated() -> Iterator[None]:
    """transformers' own SDPA path for every row (the engine stacks heads only where the attention
    function is that one: any other object turns it off)."""
    own = resident.sdpa_attention_forward
    with mock.patch.object(resident, "sdpa_attention_forward", lambda *args, **kwargs: own(*args, **kwargs)):
        yield


def conversation(model, length: int, seed: int) -> tuple[CacheSession, int]:
    """A session holding `length - 1` tokens of a seeded history, and the token its next step feeds."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(100, VOCAB, (length,), generator=generator).tolist()
    session = CacheSession(model)
    rewind_and_prefill(model, session, tokens)
    feed(model, session, tokens[len(session.token_ids):-1])
    return session, tokens[-1]


def step_kinds(model, args: argparse.Namespace) -> dict[str, Callable[[], None]]:
    decoding = [conversation(model, args.history, seed) for seed in range(4)]
    prefilling, _ = conversation(model, args.prompt_history, 99)

    def run(step, rows: list[tuple[CacheSession, list[int]]], logits_of: list[int]) -> None:
        step(model, rows, logits_of)
        for session, fed in rows:  # back to where it was: every step of a kind sees the same lengths
            session.cache.crop(-len(fed))  # (the ledger was never told: it still says where it was)

    def decode(step, count: int) -> Callable[[], None]:
        return lambda: run(step, [(session, [token]) for session, token in decoding[:count]], list(range(count)))

    def mixed(step) -> Callable[[], None]:
        session, token = decoding[0]
        return lambda: run(step, [(session, [token]), (prefilling, [7] * args.chunk)], [0])

    def mixed_repeated() -> None:
        with keys_repeated():
            mixed(resident.forward_rows)()

    own = resident.forward_rows
    return dict(zip(KINDS, (decode(run_plain, 1), decode(run_plain, 4), mixed(run_plain),
                            decode(own, 1), decode(own, 4), mixed(own), mixed_repeated)))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="bench-full", help="a row of chat/models.py")
    parser.add_argument("--history", type=int, default=1000, help="tokens of each decoding row's history")
    parser.add_argument("--prompt-history", type=int, default=3000, help="tokens before the prompt chunk")
    parser.add_argument("--chunk", type=int, default=16, help="prompt tokens beside the decode row")
    parser.add_argument("--weights", default="full", choices=WEIGHT_FORMATS, help="how the weights are held (chat/model_step/weights.py)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    model = apply_weight_format(build_model(args.model, VOCAB, None), args.weights)
    kinds = step_kinds(model, args)
    times: dict[str, list[float]] = {kind: [] for kind in KINDS}
    with torch.no_grad():
        for round_ in range(args.rounds):
            for kind in KINDS[round_ % len(KINDS):] + KINDS[:round_ % len(KINDS)]:
                for _ in range(args.steps):
                    begun = time.perf_counter()
                    kinds[kind]()
                    times[kind].append(time.perf_counter() - begun)
    median_ms = {kind: statistics.median(values) * 1000 for kind, values in times.items()}
    result = {"args": vars(args), "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
              "torch": torch.__version__, "median_step_ms": median_ms,
              "four_rows_over_one": median_ms["four rows"] / median_ms["one row"],
              "own_forward_four_rows_over_one": median_ms["four rows, own forward"] / median_ms["one row, own forward"],
              "own_forward_over_plain": {kind: median_ms[f"{kind}, own forward" + (", heads stacked" if kind == "mixed"
                                                                                   else "")] / median_ms[kind]
                                         for kind in PLAIN_KINDS},
              "mixed_repeated_over_stacked": (median_ms["mixed, own forward, keys repeated"]
                                              / median_ms["mixed, own forward, heads stacked"]),
              "mixed_over_one_row": median_ms["mixed"] / median_ms["one row"]}
    return publish(result, started, targets=targets, markdown=markdown, plot=lambda *_: None,
                   json_path=args.json_path, plot_path=None)


def targets(result: dict) -> list[tuple[str, str, bool]]:
    ratio = result["four_rows_over_one"]
    return [("a step of 4 rows <= 1.6x a step of one (plain step)", f"{ratio:.2f}x", ratio <= 1.6)]


def markdown(result: dict) -> str:
    lines = ["| step | median |", "|---|---:|"]
    lines += [f"| {kind} | {ms:.1f} ms |" for kind, ms in result["median_step_ms"].items()]
    slower = ", ".join(f"{kind} {ratio:.2f}x" for kind, ratio in result["own_forward_over_plain"].items())
    lines += ["", f"the model's own forward / the plain step: {slower}; four rows / one with the own forward: "
              f"{result['own_forward_four_rows_over_one']:.2f}x; mixed step of the own forward, keys repeated / "
              f"heads stacked: {result['mixed_repeated_over_stacked']:.2f}x; mixed / one row (plain): "
              f"{result['mixed_over_one_row']:.2f}x", ""]
    return "\n".join(lines + target_table(result["targets"]))


if __name__ == "__main__":
    main()
