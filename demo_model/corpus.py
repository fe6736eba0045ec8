"""The demo model's synthetic dialogues: arithmetic with worked steps, follow-ups, a few phrases.

Every reply is written the way the model should answer, in the chat template's own format: the
steps inside `<think>…</think>` (each column, each carry or borrow, written out), then one short
answer line. Conversations of several turns end with a follow-up that needs the history ("and
plus 7?", "double it", "what was the first number?"). Questions whose number pair is *held out*
(`held_out`) never appear in training, so the evaluation asks questions the model never saw.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

PLACES = ("ones", "tens", "hundreds", "thousands")
SYSTEM_PROMPTS = (None, "You are a helpful assistant.", "You are a helpful assistant.", "You are terse.",
                  "You are a friendly math tutor.")


@dataclass(frozen=True)
class Problem:
    """One arithmetic operation and what answering it takes."""

    op: str  # "+", "-", "*"
    a: int
    b: int

    @property
    def result(self) -> int:
        return self.a + self.b if self.op == "+" else self.a - self.b if self.op == "-" else self.a * self.b

    @property
    def text(self) -> str:
        return f"{self.a} {self.op} {self.b}"

    def steps(self) -> list[str]:
        if self.op == "+":
            return add_steps(self.a, self.b)
        if self.op == "-":
            return subtract_steps(self.a, self.b)
        return multiply_steps(self.a, self.b)


def _columns(a: int, b: int) -> list[tuple[int, int]]:
    da, db = str(a)[::-1], str(b)[::-1]
    width = max(len(da), len(db))
    return [(int(da[i]) if i < len(da) else 0, int(db[i]) if i < len(db) else 0) for i in range(width)]


def add_steps(a: int, b: int) -> list[str]:
    lines, carry = [], 0
    columns = _columns(a, b)
    for index, (x, y) in enumerate(columns):
        total = x + y + carry
        term = f"{x} + {y}" + (f" + {carry}" if carry else "")
        line = f"Add the {PLACES[index]}: {term} = {total}."
        if index < len(columns) - 1:
            line += f" Write {total % 10}, carry {total // 10}." if total >= 10 else f" Write {total}."
        lines.append(line)
        carry = total // 10
    return lines


def subtract_steps(a: int, b: int) -> list[str]:
    assert a >= b
    lines, borrow = [], 0
    for index, (x, y) in enumerate(_columns(a, b)):
        term = f"{x} - {y}" + (" - 1" if borrow else "")
        if x - borrow < y:
            lines.append(f"Subtract the {PLACES[index]}: {term} is below zero, so borrow ten: "
                         f"1{term} = {10 + x - y - borrow}.")
            borrow = 1
        else:
            lines.append(f"Subtract the {PLACES[index]}: {term} = {x - y - borrow}.")
            borrow = 0
    return lines


def multiply_steps(a: int, b: int) -> list[str]:
    """One factor has one digit; the other is worked column by column."""
    digit, number = (a, b) if a < 10 else (b, a)
    lines, carry = [], 0
    places = str(number)[::-1]
    for index, character in enumerate(places):
        product = digit * int(character)
        line = f"Multiply the {PLACES[index]}: {digit} * {character} = {product}."
        total = product + carry
        if carry:
            line += f" {product} + {carry} = {total}."
        if index < len(places) - 1:
            line += f" Write {total % 10}, carry {total // 10}." if total >= 10 else f" Write {total}."
        lines.append(line)
        carry = total // 10
    return lines


def held_out(op: str, a: int, b: int) -> bool:
    """About one question in eight is kept for evaluation only (by its numbers, not by chance)."""
    return (a * 7919 + b * 104729 + "+-*".index(op) * 31) % 8 == 0


# ---- questions ----------------------------------------------------------------------------------
QUESTION_FORMS = {
    "+": ("What is {a} + {b}?", "{a} + {b} = ?", "How much is {a} plus {b}?", "What is {a} plus {b}?",
          "Add {a} and {b}.", "{a}+{b}?"),
    "-": ("What is {a} - {b}?", "{a} - {b} = ?", "What is {a} minus {b}?", "How much is {a} minus {b}?",
          "{a}-{b}?"),
    "*": ("What is {a} * {b}?", "{a} * {b} = ?", "What is {a} times {b}?", "Multiply {a} by {b}.", "{a}*{b}?",
          "What is {a} x {b}?"),
}
ANSWER_FORMS = ("{problem} = {result}.", "{problem} = {result}.", "The answer is {result}.")


def question_text(rng: random.Random, problem: Problem) -> str:
    return rng.choice(QUESTION_FORMS[problem.op]).format(a=problem.a, b=problem.b)


def answer_text(rng: random.Random, problem: Problem) -> str:
    return rng.choice(ANSWER_FORMS).format(problem=problem.text, result=problem.result)


def first_problem(rng: random.Random, *, evaluation: bool = False) -> Problem:
    """A two-digit question; held-out pairs only for evaluation, never for training."""
    while True:
        op = rng.choices("+-*", weights=(35, 30, 35))[0]
        if op == "*":
            a, b = rng.randint(2, 9), rng.randint(10, 99)
            if rng.random() < 0.4:
                a, b = b, a
        else:
            a, b = rng.randint(10, 99), rng.randint(10, 99)
            if op == "-" and a < b:
                a, b = b, a
        if held_out(op, a, b) == evaluation:
            return Problem(op, a, b)


@dataclass
class Turn:
    user: str
    reasoning: str
    answer: str
    value: int | None = None  # the number the answer gives, for follow-ups and evaluation


@dataclass
class Dialogue:
    system: str | None
    turns: list[Turn] = field(default_factory=list)
    thinking: bool = True
    kind: str = "arithmetic"  # arithmetic, follow-up, fact, chat

    def messages(self, upto: int | None = None) -> list[dict]:
        """The conversation before the last reply, as the app keeps it (reasoning stripped)."""
        turns = self.turns[:upto] if upto is not None else self.turns
        messages = [{"role": "system", "content": self.system}] if self.system else []
        for turn in turns[:-1]:
            messages += [{"role": "user", "content": turn.user}, {"role": "assistant", "content": turn.answer}]
        return messages + [{"role": "user", "content": turns[-1].user}]

    def target(self) -> str:
        """The last reply as the model must write it after the generation prompt."""
        last = self.turns[-1]
        if not self.thinking:  # the template already wrote an empty think block
            return last.answer
        return f"<think>\n{last.reasoning}\n</think>\n\n{last.answer}"


def arithmetic_turn(rng: random.Random, problem: Problem) -> Turn:
    return Turn(question_text(rng, problem), "\n".join(problem.steps() + [f"So {problem.text} = {problem.result}."]),
                answer_text(rng, problem), problem.result)


# ---- follow-ups: each needs the last answer or the first question ---------------------------------
def follow_up(rng: random.Random, first: Problem, last_value: int) -> Turn:
    while True:
        kind = rng.choices(("plus", "minus", "double", "times", "first", "second", "again"),
                           weights=(26, 20, 14, 14, 10, 8, 8))[0]
        if kind == "plus":
            n = rng.randint(1, 9) if rng.random() < 0.5 else rng.randint(10, 99)
            user = rng.choice(("And plus {n}?", "Plus {n}?", "Add {n} to that.", "And if we add {n}?")).format(n=n)
            return _derived(rng, user, last_value, Problem("+", last_value, n))
        if kind == "minus" and last_value >= 1:
            n = rng.randint(1, min(last_value, 9)) if rng.random() < 0.5 else rng.randint(1, min(last_value, 99))
            user = rng.choice(("And minus {n}?", "Minus {n}?", "Take away {n}.", "Subtract {n} from that.")).format(n=n)
            return _derived(rng, user, last_value, Problem("-", last_value, n))
        if kind == "double":
            user = rng.choice(("Double it.", "Double that.", "And twice that?", "What is double that?"))
            problem = Problem("+", last_value, last_value)
            steps = [f"The last answer was {last_value}. Doubling it means {problem.text}."] + problem.steps()
            return Turn(user, "\n".join(steps + [f"So {problem.text} = {problem.result}."]),
                        f"Double {last_value} is {problem.result}.", problem.result)
        if kind == "times" and last_value <= 99:
            d = rng.randint(2, 9)
            user = rng.choice(("Times {d}?", "And times {d}?", "Multiply that by {d}.")).format(d=d)
            return _derived(rng, user, last_value, Problem("*", last_value, d))
        if kind in ("first", "second"):
            value = first.a if kind == "first" else first.b
            user = rng.choice((f"What was the {kind} number?", f"Which was the {kind} number?",
                               f"What was the {kind} number in my first question?"))
            reasoning = f"The first question was {first.text}. Its {kind} number is {value}."
            return Turn(user, reasoning, f"The {kind} number was {value}.", value)
        if kind == "again":
            user = rng.choice(("What was the answer?", "What did you get?", "Say the answer again."))
            return Turn(user, f"The last answer was {last_value}.", f"The answer was {last_value}.", last_value)


def _derived(rng: random.Random, user: str, last_value: int, problem: Problem) -> Turn:
    steps = [f"The last answer was {last_value}. Now {problem.text}."] + problem.steps()
    return Turn(user, "\n".join(steps + [f"So {problem.text} = {problem.result}."]), answer_text(rng, problem),
                problem.result)


def arithmetic_dialogue(rng: random.Random, *, turns: int, evaluation: bool = False) -> Dialogue:
    first = first_problem(rng, evaluation=evaluation)
    dialogue = Dialogue(rng.choice(SYSTEM_PROMPTS), [arithmetic_turn(rng, first)],
                        kind="arithmetic" if turns == 1 else "follow-up")
    while len(dialogue.turns) < turns:
        last = dialogue.turns[-1].value
        assert last is not None
        dialogue.turns.append(follow_up(rng, first, last))
    return dialogue


def fact_dialogue(rng: random.Random) -> Dialogue:
    """Single-digit facts, drilled: the steps lean on them."""
    op = rng.choice("+-*")
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    if op == "-" and a < b:
        a, b = b, a
    problem = Problem(op, a, b)
    turn = Turn(question_text(rng, problem), f"{problem.text} = {problem.result}.", answer_text(rng, problem),
                problem.result)
    return Dialogue(rng.choice(SYSTEM_PROMPTS), [turn], kind="fact")


# ---- a few phrases, so the first screen explains itself ------------------------------------------
CHAT = [
    (("Hi", "Hello", "Hello!", "Hi there", "Hey", "Good morning", "Hi!", "hello"),
     "A greeting. I say hello and what I can do.",
     ("Hello! I am a tiny demo model. I add, subtract and multiply with worked steps. Try: what is 47 + 38?",
      "Hi! Ask me some arithmetic, like 23 + 58 or 7 * 46, and I will show my steps.",
      "Hello! I can do two-digit sums with my thinking shown. Try 64 - 27.")),
    (("Thanks", "Thank you!", "Thanks!", "thank you", "Great, thanks."),
     "Thanks. I reply politely.",
     ("You are welcome!", "Glad to help!", "Any time. Ask me another sum.")),
    (("What can you do?", "Who are you?", "What are you?", "Help"),
     "A question about me. I explain what I am.",
     ("I am a toy model trained in under an hour on two CPU cores. I do two-digit addition and subtraction and "
      "one-digit times two-digit multiplication, step by step, and I remember the numbers in this chat.",
      "A tiny chat model made for this demo: I do arithmetic with my steps in the thinking block, and "
      "follow-ups like: and plus 7? or: double it.")),
    (("What does regenerate do?", "What is regenerate?", "What does the retry button do?"),
     "A question about the app: regenerate.",
     ("Regenerate makes a new version of my last reply. The cache rolls back to where that reply began, so "
      "only one token is computed again.",
      "It asks me for another version of the last reply. Nothing before it is computed again: the cache is "
      "rolled back.")),
    (("What does undo do?", "What is undo?"),
     "A question about the app: undo.",
     ("Undo removes your last message and my reply. The cache is rolled back, not rebuilt.",)),
    (("What does edit do?", "What happens when I edit a message?"),
     "A question about the app: edit.",
     ("Editing a message replies again from there. The cache keeps everything before your edit.",)),
    (("What are versions?", "What do the arrows do?"),
     "A question about the app: versions.",
     ("Each regenerate makes a version. The arrows switch between them and put back their cache without "
      "computing anything.",)),
    (("What is the cache?", "What is the KV cache?", "Why are you fast?"),
     "A question about the app: the cache.",
     ("The cache keeps what the model computed for every token so far. Each turn only the new tokens are "
      "computed; the rest is rolled back or reused.",)),
    (("What does continue do?", "What does stop do?"),
     "A question about the app: stop and continue.",
     ("Stop ends my reply where it is; continue goes on from there, with one token of work.",)),
]
FALLBACK_WORDS = ("apple river blue quick song chair window story music green travel dream cloud paper "
                  "garden coffee moon mountain").split()


def chat_dialogue(rng: random.Random) -> Dialogue:
    if rng.random() < 0.15:  # anything else: say what works
        user = " ".join(rng.choice(FALLBACK_WORDS) for _ in range(rng.randint(1, 6))).capitalize() + rng.choice(
            ("?", ".", "!"))
        turn = Turn(user, "I do not know this. I say what I can do.",
                    rng.choice(("Sorry, I only know arithmetic and a few phrases. Try: what is 47 + 38?",
                                "I am a tiny model: I only do sums. Ask me something like 7 * 46.")))
    else:
        questions, reasoning, answers = rng.choice(CHAT)
        turn = Turn(rng.choice(questions), reasoning, rng.choice(answers))
    return Dialogue(rng.choice(SYSTEM_PROMPTS), [turn], kind="chat")


def sample_dialogue(rng: random.Random) -> Dialogue:
    """One training dialogue: the mix of the corpus."""
    roll = rng.random()
    if roll < 0.08:
        dialogue = chat_dialogue(rng)
    elif roll < 0.14:
        dialogue = fact_dialogue(rng)
    else:
        turns = rng.choices((1, 2, 3, 4), weights=(50, 28, 15, 7))[0]
        dialogue = arithmetic_dialogue(rng, turns=turns)
    dialogue.thinking = rng.random() < 0.75
    return dialogue
