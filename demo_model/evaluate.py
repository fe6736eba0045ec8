"""How well the demo model answers questions it never saw in training.

    python -m demo_model.evaluate                 # the committed model (chat/assets/demo)
    python -m demo_model.evaluate --model /tmp/demo --json result.json

Every question's number pair is held out of the training corpus (`corpus.held_out`). Each runs
as a real conversation through `ChatEngine` (greedy, the app's default system prompt or none):
addition, subtraction and multiplication, thinking on and off; follow-ups ("and plus 7?",
"double it", "what was the first number?") in live two- and three-turn conversations, judged
against the true chain of results; and sampled replies with a regeneration each (the model's own
sampling settings), which must stay well formed. Well formed: the thinking closed, an answer after it, and the end
token within the token limit. These use the corpus's own phrasings. Then phrasings and
conversation shapes the corpus never uses (demo_model/held_out.py): a standalone question at the
first turn and after one to four earlier turns of any kind, a follow-up, an off-topic line, and
the last turn of a conversation longer than any trained: greedy with thinking on and with it off
(the targets: 95 % standalone, 90 % follow-ups, both ways), and sampled with a Regenerate
(HELD_OUT_TARGETS). With thinking off the model answers with its columns written in the answer
(`Problem.worked`), so "right" is the answer's last number, as with thinking on.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from chat import ChatEngine
from demo_model import held_out
from demo_model.corpus import Problem, arithmetic_dialogue, first_problem, question_text

MAX_NEW_TOKENS = 200
TARGETS = {"addition and subtraction": 0.95, "multiplication": 0.95, "follow-ups": 0.90, "well formed": 0.98}
# on held-out phrasings and shapes: greedy with thinking on and off, and sampled at the
# model's own settings
HELD_OUT_TARGETS = {"standalone, first turn": 0.95, "standalone, after earlier turns": 0.95,
                    "follow-up, after earlier turns": 0.90, "off-topic, after earlier turns": 0.95, "well formed": 0.99}


@dataclass
class Reply:
    answer: str
    reasoning: str
    closed: bool  # thinking off, or `</think>` written
    ended: bool  # the end token came within the limit

    @property
    def well_formed(self) -> bool:
        return self.closed and self.ended and bool(self.answer.strip())

    @property
    def number(self) -> int | None:
        numbers = re.findall(r"-?\d+", self.answer)
        return int(numbers[-1]) if numbers else None


def reply_of(conv, tokenizer, thinking: bool) -> Reply:
    last = conv.history.entries[-1].reply
    raw = tokenizer.decode(last.reply_ids, skip_special_tokens=False)
    ended = conv.stats.generated_tokens == len(last.reply_ids) + 1  # the end token is not kept
    return Reply(last.content, last.reasoning_content, "</think>" in raw or not thinking, ended)


def ask(engine: ChatEngine, turns: list[str], system: str | None, thinking: bool, **options) -> list[Reply]:
    conv = engine.conversation(system)
    replies = []
    for text in turns:
        list(conv.send(text, max_new_tokens=MAX_NEW_TOKENS, enable_thinking=thinking, **options))
        replies.append(reply_of(conv, engine.tokenizer, thinking))
    return replies


def run(engine: ChatEngine, questions: int, seed: int, workers: int) -> dict:
    rng = random.Random(seed)
    jobs: list[tuple[str, list[str], list[int | None], str | None, bool]] = []
    by_op: dict[str, list[Problem]] = {"+": [], "-": [], "*": []}
    while min(len(problems) for problems in by_op.values()) < questions:
        problem = first_problem(rng, evaluation=True)
        if len(by_op[problem.op]) < questions:
            by_op[problem.op].append(problem)
    for problems in by_op.values():
        for problem in problems:
            for thinking in (True, False):
                category = "multiplication" if problem.op == "*" else "addition and subtraction"
                jobs.append((category, [question_text(rng, problem)], [problem.result],
                             rng.choice((None, "You are a helpful assistant.")), thinking))
    for index in range(questions * 2):
        dialogue = arithmetic_dialogue(rng, turns=2 + index % 2, evaluation=True)
        jobs.append(("follow-ups", [turn.user for turn in dialogue.turns], [turn.value for turn in dialogue.turns],
                     dialogue.system, index % 2 == 0))

    def one(job):
        category, turns, values, system, thinking = job
        return job, ask(engine, turns, system, thinking, do_sample=False)

    with ThreadPoolExecutor(workers) as pool:  # conversations at once: they decode in one batch
        results = list(pool.map(one, jobs))
    table: dict[str, dict[str, list[bool]]] = {}
    failures = []
    for (category, turns, values, system, thinking), replies in results:
        mode = "thinking" if thinking else "no thinking"
        right = replies[-1].number == values[-1]
        table.setdefault(category, {}).setdefault(mode, []).append(right)
        table.setdefault("well formed", {}).setdefault(mode, []).extend(r.well_formed for r in replies)
        if not right and len(failures) < 12:
            failures.append({"turns": turns, "expected": values[-1], "answer": replies[-1].answer,
                             "reasoning": replies[-1].reasoning[-200:], "thinking": thinking})
    # sampled regenerations: different, still well formed
    sampled_rng = random.Random(seed + 1)
    problems = [first_problem(sampled_rng, evaluation=True) for _ in range(questions)]
    samples = [question_text(sampled_rng, problem) for problem in problems]

    def sampled(text):  # a sampled reply, then Regenerate: two versions of the same reply
        conv = engine.conversation(None)
        list(conv.send(text, max_new_tokens=MAX_NEW_TOKENS))
        first = reply_of(conv, engine.tokenizer, True)
        list(conv.regenerate(max_new_tokens=MAX_NEW_TOKENS))
        return first, reply_of(conv, engine.tokenizer, True)

    with ThreadPoolExecutor(workers) as pool:
        sampled_results = list(pool.map(sampled, samples))
    sampled_replies = [reply for pair in sampled_results for reply in pair]
    table.setdefault("well formed", {})["sampled"] = [r.well_formed for r in sampled_replies]
    table["sampled answers right"] = {"sampled": [reply.number == problem.result
                                                  for pair, problem in zip(sampled_results, problems)
                                                  for reply in pair]}
    distinct = sum(1 for a, b in sampled_results if (a.reasoning, a.answer) != (b.reasoning, b.answer))
    return {"table": {category: {mode: {"right": sum(v), "of": len(v)} for mode, v in modes.items()}
                      for category, modes in table.items()},
            "sampled_pairs_that_differ": {"differ": distinct, "of": len(sampled_results)},
            "failures": failures}


# how each held-out conversation is run: (thinking, generation options)
SHAPE_MODES = {"greedy": (True, {"do_sample": False}), "greedy, thinking off": (False, {"do_sample": False}),
               "sampled": (True, {})}


def run_held_out_shapes(engine: ChatEngine, count: int, seed: int, workers: int) -> dict:
    """Phrasings and conversation shapes the corpus never uses (demo_model/held_out.py): greedy with
    thinking on and off, and thinking on at the model's own sampling settings with a Regenerate of
    the last reply."""
    made = held_out.conversations(random.Random(seed), count)

    def one(conversation: held_out.Conversation) -> dict[str, list[tuple[bool, bool, str]]]:
        results: dict[str, list[tuple[bool, bool, str]]] = {}
        for mode, (thinking, options) in SHAPE_MODES.items():
            conv = engine.conversation("You are a helpful assistant.")
            for text in conversation.turns:
                list(conv.send(text, max_new_tokens=MAX_NEW_TOKENS, enable_thinking=thinking, **options))
            replies = [reply_of(conv, engine.tokenizer, thinking)]
            if mode == "sampled":
                list(conv.regenerate(max_new_tokens=MAX_NEW_TOKENS, enable_thinking=thinking))
                replies.append(reply_of(conv, engine.tokenizer, thinking))
            results[mode] = [(held_out.judged(conversation, r.number, r.answer), r.well_formed, r.answer)
                             for r in replies]
        return results

    with ThreadPoolExecutor(workers) as pool:
        outcomes = list(pool.map(one, made))
    table: dict[str, dict[str, dict[str, int]]] = {}
    wrong = []
    for conversation, outcome in zip(made, outcomes):
        for mode, judged_replies in outcome.items():
            for right, well_formed, _ in judged_replies:
                for category, ok in ((conversation.category, right), ("well formed", well_formed)):
                    cell = table.setdefault(category, {}).setdefault(mode, {"right": 0, "of": 0})
                    cell["right"], cell["of"] = cell["right"] + ok, cell["of"] + 1
            if not judged_replies[0][0] and len(wrong) < 12:
                wrong.append({"turns": list(conversation.turns), "expected": conversation.value, "mode": mode,
                              "answer": judged_replies[0][2]})
    return {"table": table, "wrong": wrong}


def held_out_markdown(result: dict) -> str:
    lines = ["| held-out phrasings and shapes | greedy, thinking on | greedy, thinking off | sampled (thinking on), "
             "with a Regenerate | target |", "|---|---:|---:|---:|---:|"]
    order = [*held_out.CATEGORIES, "well formed"]
    for category in sorted(result["table"], key=lambda name: order.index(name) if name in order else len(order)):
        modes = result["table"][category]
        cells = [f"{share(modes[m]) * 100:.1f} % ({modes[m]['right']}/{modes[m]['of']})" for m in SHAPE_MODES]
        target = HELD_OUT_TARGETS.get(category)
        lines.append(f"| {category} | {' | '.join(cells)} | {f'{target * 100:.0f} %' if target else '–'} |")
    return "\n".join(lines)


def share(cell: dict) -> float:
    return cell["right"] / cell["of"] if cell["of"] else 0.0


def markdown(result: dict) -> str:
    lines = ["| held-out questions | thinking | no thinking | target |", "|---|---:|---:|---:|"]
    for category, target in TARGETS.items():
        modes = result["table"][category]
        cells = [f"{share(modes[m]) * 100:.1f} % ({modes[m]['right']}/{modes[m]['of']})" if m in modes else "–"
                 for m in ("thinking", "no thinking")]
        lines.append(f"| {category} | {cells[0]} | {cells[1]} | {target * 100:.0f} % |")
    sampled = result["table"]["well formed"]["sampled"]
    right = result["table"]["sampled answers right"]["sampled"]
    pairs = result["sampled_pairs_that_differ"]
    lines.append(f"\nSampled ({result['sampling']}, thinking on): {share(sampled) * 100:.1f} % "
                 f"well formed ({sampled['right']}/{sampled['of']}), {share(right) * 100:.1f} % right "
                 f"({right['right']}/{right['of']}); Regenerate gave a different reply in "
                 f"{pairs['differ']} of {pairs['of']} pairs.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="demo", help='"demo" (the committed model) or a folder')
    parser.add_argument("--questions", type=int, default=60, help="per operation; follow-ups get twice as many")
    parser.add_argument("--seed", type=int, default=12345)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--json", dest="json_path", default=None)
    parser.add_argument("--shapes", type=int, default=40, help="conversations of each held-out category")
    args = parser.parse_args(argv)
    engine = ChatEngine.load(args.model, device="cpu", dtype="float32", max_batch_size=args.workers)
    result = run(engine, args.questions, args.seed, args.workers)
    result["held_out_shapes"] = run_held_out_shapes(engine, args.shapes, args.seed + 2, args.workers)
    config = engine.model.generation_config
    result["sampling"] = f"the model's own: temperature {config.temperature}, top-k {config.top_k}"
    result["targets_met"] = {f"{category}, {mode}": share(cell) >= target
                             for category, target in TARGETS.items()
                             for mode, cell in result["table"][category].items()}
    shapes = result["held_out_shapes"]["table"]
    result["held_out_targets_met"] = {f"{category}, {mode}": share(shapes[category][mode]) >= target
                                      for category, target in HELD_OUT_TARGETS.items() for mode in SHAPE_MODES}
    result["command"] = "python -m demo_model.evaluate " + " ".join(argv if argv is not None else sys.argv[1:])
    print(markdown(result))
    print()
    print(held_out_markdown(result["held_out_shapes"]))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
