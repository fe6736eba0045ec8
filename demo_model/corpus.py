"""The demo model's synthetic dialogues: arithmetic with worked steps, follow-ups, a few phrases.

Every reply is written the way the model should answer, in the chat template's own format: the
steps inside `<think>…</think>` (each column, each carry or borrow, written out), then one short
answer line. Conversations of several turns end with a follow-up that needs the history ("and
plus 7?", "double it", "what was the first number?"). Questions whose number pair is *held out*
(`held_out`) never appear in training, so the evaluation asks questions the model never saw.
"""

from __future__ import annotations

import random
import zlib
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

    def worked(self) -> str:
        """The answer with its working in one line, for a reply with thinking off: the same column
        steps the thinking writes, short ("47 + 38: 8 + 7 = 15, 4 + 3 + 1 = 8, so 47 + 38 = 85.").
        A model this small cannot carry in its head; with the columns written it gets sums right."""
        columns = add_columns(self.a, self.b) if self.op == "+" else \
            subtract_columns(self.a, self.b) if self.op == "-" else multiply_columns(self.a, self.b)
        return f"{self.text}: {', '.join(columns)}, so {self.text} = {self.result}."


def add_columns(a: int, b: int) -> list[str]:
    terms, carry = [], 0
    for x, y in _columns(a, b):
        total = x + y + carry
        terms.append(f"{x} + {y}" + (f" + {carry}" if carry else "") + f" = {total}")
        carry = total // 10
    return terms


def subtract_columns(a: int, b: int) -> list[str]:
    terms, borrow = [], 0
    for x, y in _columns(a, b):
        lend = 10 if x - borrow < y else 0
        terms.append(f"{x + lend} - {y}" + (" - 1" if borrow else "") + f" = {x + lend - y - borrow}")
        borrow = 1 if lend else 0
    return terms


def multiply_columns(a: int, b: int) -> list[str]:
    digit, number = (a, b) if a < 10 else (b, a)
    terms, carry = [], 0
    for character in str(number)[::-1]:
        product = digit * int(character)
        # the carry added apart, as the thinking does: one operation a term
        terms.append(f"{digit} * {character} = {product}" + (f", {product} + {carry} = {product + carry}" if carry else ""))
        carry = (product + carry) // 10
    return terms


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


# ---- how people ask: a prefix, a core that names the operation, a suffix, a case -----------------
# A question is one of these cores after one of its prefixes. About one (prefix, core) pair in four
# is *held out* (`held_out_phrasing`): the corpus never asks that way, in any case or punctuation,
# so demo_model/held_out.py asks in combinations the model never saw. Cores and prefixes each
# occur in the corpus with other partners. Each core's operands come in the order written; the
# reasoning starts by writing the question the one way the steps use ("The question is 47 - 38.").
NOUN_PREFIXES = ("What is ", "What is ", "what is ", "What's ", "How much is ", "Compute ", "Calculate ",
                 "Tell me ", "", "", "And what is ", "Now what is ", "Work out ", "Quick: ", "Find ",
                 "So what is ", "Next: ", "Can you tell me ")
NOUN_CORES = {
    "+": ("{a} + {b}", "{a} plus {b}", "{a}+{b}", "the sum of {a} and {b}", "{a} added to {b}",
          "{a} and {b} added together", "{a} + {b} = "),
    "-": ("{a} - {b}", "{a} minus {b}", "{a}-{b}", "the difference of {a} and {b}", "{a} less {b}",
          "{b} taken from {a}", "{b} subtracted from {a}", "{a} - {b} = "),
    "*": ("{a} * {b}", "{a} times {b}", "{a} x {b}", "{a} × {b}", "{a}*{b}", "{a} multiplied by {b}",
          "the product of {a} and {b}", "{a} * {b} = "),
}
VERB_PREFIXES = ("", "", "Please ", "Now ", "Can you ", "And ", "OK, ", "Next, ")
VERB_CORES = {
    "+": ("add {a} and {b}", "add {b} to {a}", "sum {a} and {b}"),
    "-": ("subtract {b} from {a}", "take {b} from {a}", "take away {b} from {a}"),
    "*": ("multiply {a} by {b}", "multiply {a} and {b}"),
}
SUFFIXES = ("?", "?", "?", "", "", ".", " please?", " please", "??")
# prefixes the corpus never uses at all: evaluation only
NEW_NOUN_PREFIXES = ("Could you work out ", "I want to know ", "Hey, what is ")
NEW_VERB_PREFIXES = ("Could you ", "Kindly ", "Hey, ")


def held_out_phrasing(prefix: str, core: str, salt: str = "") -> bool:
    """About one pair in four is kept for evaluation only (by its words, not by chance)."""
    return zlib.crc32(f"{salt}{prefix.strip().lower()}|{core}".encode()) % 4 == 0


def _pairs(prefixes: tuple[str, ...], cores: tuple[str, ...]) -> list[tuple[str, str]]:
    return [(prefix, core) for prefix in prefixes for core in cores]


def _split(pairs: list[tuple[str, str]], new: list[tuple[str, str]], evaluation: bool,
           salt: str = "") -> list[tuple[str, str]]:
    """The pairs the corpus uses, or, for evaluation, those it never does and those with new prefixes."""
    kept = [pair for pair in pairs if held_out_phrasing(*pair, salt=salt) == evaluation]
    return kept + new if evaluation else kept


def phrasings(op: str, *, evaluation: bool = False) -> list[tuple[str, str]]:
    """The (prefix, core) pairs the corpus asks `op` with, or, for evaluation, those it never does."""
    return _split(_pairs(NOUN_PREFIXES, NOUN_CORES[op]) + _pairs(VERB_PREFIXES, VERB_CORES[op]),
                  _pairs(NEW_NOUN_PREFIXES, NOUN_CORES[op]) + _pairs(NEW_VERB_PREFIXES, VERB_CORES[op]), evaluation)


def cased(rng: random.Random, text: str) -> str:
    """Mostly as written, else all lower case, sometimes all capitals."""
    roll = rng.random()
    return text if roll < 0.7 else text.lower() if roll < 0.9 else text.upper()


def phrase(rng: random.Random, prefix: str, core: str, **values: int | str) -> str:
    text = prefix + core.format(**values)
    if prefix == "" and rng.random() < 0.5:
        text = text[0].upper() + text[1:]
    return cased(rng, text + "?" if core.endswith("= ") else text + rng.choice(SUFFIXES))


def question_text(rng: random.Random, problem: Problem, *, evaluation: bool = False) -> str:
    prefix, core = rng.choice(phrasings(problem.op, evaluation=evaluation))
    return phrase(rng, prefix, core, a=problem.a, b=problem.b)


ANSWER_FORMS = ("{problem} = {result}.", "{problem} = {result}.", "The answer is {result}.")


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
    problem: Problem | None = None  # the question it answered, when it was a standalone one
    worked: str | None = None  # the answer with thinking off, when it has working to show
    thinking: bool = True  # how this turn was answered: what the history shows of it

    @property
    def shown(self) -> str:
        """The reply as the history keeps it (reasoning stripped)."""
        return self.answer if self.thinking or self.worked is None else self.worked


@dataclass
class Dialogue:
    system: str | None
    turns: list[Turn] = field(default_factory=list)
    thinking: bool = True
    kind: str = "arithmetic"  # what the last turn is: arithmetic, follow-up, fact, chat, off-topic

    def messages(self, upto: int | None = None) -> list[dict]:
        """The conversation before the last reply, as the app keeps it (reasoning stripped)."""
        turns = self.turns[:upto] if upto is not None else self.turns
        messages = [{"role": "system", "content": self.system}] if self.system else []
        for turn in turns[:-1]:
            messages += [{"role": "user", "content": turn.user}, {"role": "assistant", "content": turn.shown}]
        return messages + [{"role": "user", "content": turns[-1].user}]

    def target(self) -> str:
        """The last reply as the model must write it after the generation prompt."""
        last = self.turns[-1]
        if not self.thinking:  # the template already wrote an empty think block
            return last.worked or last.answer
        return f"<think>\n{last.reasoning}\n</think>\n\n{last.answer}"

    def values(self) -> list[int]:
        return [turn.value for turn in self.turns if turn.value is not None]

    def first_question(self) -> Problem | None:
        return next((turn.problem for turn in self.turns if turn.problem is not None), None)


def arithmetic_turn(rng: random.Random, problem: Problem, *, evaluation: bool = False) -> Turn:
    steps = [f"The question is {problem.text}."] + problem.steps() + [f"So {problem.text} = {problem.result}."]
    return Turn(question_text(rng, problem, evaluation=evaluation), "\n".join(steps), answer_text(rng, problem),
                problem.result, problem, problem.worked())


# ---- follow-ups: each needs an earlier answer or the first question --------------------------------
# kind -> cores; "{ref}" is what the follow-up refers to ("that", "it", "the first answer").
FOLLOW_UP_CORES = {
    "plus": ("plus {n}", "add {n}", "add {n} to {ref}", "{n} more", "{ref} plus {n}", "+ {n}", "plus {n} more",
             "what is {ref} plus {n}"),
    "minus": ("minus {n}", "take away {n}", "subtract {n}", "subtract {n} from {ref}", "take {n} from {ref}",
              "- {n}", "{ref} minus {n}", "what is {ref} minus {n}"),
    "times": ("times {n}", "multiply {ref} by {n}", "x {n}", "× {n}", "{ref} times {n}", "what is {ref} times {n}"),
    "double": ("double {ref}", "twice {ref}", "what is double {ref}", "what is twice {ref}"),
    "again": ("what was the answer", "what did you get", "say the answer again", "what was that again",
              "repeat the answer", "what was {ref} again"),
    "number": ("what was the {which} number", "which was the {which} number",
               "what was the {which} number in my first question", "the {which} number of my first question"),
}
FOLLOW_UP_PREFIXES = ("", "", "And ", "Now ", "Then ", "OK, ", "and then ", "So ", "Next, ")
NEW_FOLLOW_UP_PREFIXES = ("Alright, ", "Right, ")  # evaluation only
LAST_REFERENCES = ("that", "it", "that", "the answer", "the result")


def follow_up_phrasings(kind: str, *, evaluation: bool = False) -> list[tuple[str, str]]:
    """As `phrasings`, for a follow-up of `kind` (its own draw of held-out pairs)."""
    return _split(_pairs(FOLLOW_UP_PREFIXES, FOLLOW_UP_CORES[kind]), _pairs(NEW_FOLLOW_UP_PREFIXES,
                  FOLLOW_UP_CORES[kind]), evaluation, salt="follow-up|")


def follow_up(rng: random.Random, first: Problem, last_value: int, first_value: int | None = None, *,
              evaluation: bool = False) -> Turn:
    """A question on the last answer (or, when `first_value` differs from it, sometimes on the
    first answer), or on the first question's numbers; `evaluation` asks in held-out words."""
    while True:
        kind = rng.choices(("plus", "minus", "double", "times", "number", "again"),
                           weights=(26, 20, 14, 14, 14, 8))[0]
        prefix, core = rng.choice(follow_up_phrasings(kind, evaluation=evaluation))
        on_first = first_value is not None and first_value != last_value and "{ref}" in core and rng.random() < 0.3
        value, name = (first_value, "first") if on_first else (last_value, "last")
        reference = "the first answer" if on_first else rng.choice(LAST_REFERENCES)
        said = f"The {name} answer was {value}."
        if kind == "plus":
            n = rng.randint(1, 9) if rng.random() < 0.5 else rng.randint(10, 99)
            problem = Problem("+", value, n)
        elif kind == "minus" and value >= 1:
            n = rng.randint(1, min(value, 9)) if rng.random() < 0.5 else rng.randint(1, min(value, 99))
            problem = Problem("-", value, n)
        elif kind == "times" and value <= 99:
            n = rng.randint(2, 9)
            problem = Problem("*", value, n)
        elif kind == "double" and value <= 999:
            n, problem = 0, Problem("+", value, value)
            steps = [f"{said} Doubling it means {problem.text}."] + problem.steps()
            return Turn(phrase(rng, prefix, core, ref=reference), "\n".join(steps + [f"So {problem.text} = "
                        f"{problem.result}."]), f"Double {value} is {problem.result}.", problem.result,
                        worked=f"{said} Doubling it: {problem.worked()}")
        elif kind == "number":
            which = rng.choice(("first", "second"))
            number = first.a if which == "first" else first.b
            return Turn(phrase(rng, prefix, core, which=which),
                        f"The first question was {first.text}. Its {which} number is {number}.",
                        f"The {which} number was {number}.", number)
        elif kind == "again":
            return Turn(phrase(rng, prefix, core, ref=reference), said, f"The {name} answer was {value}.", value)
        else:
            continue
        steps = [f"{said} Now {problem.text}."] + problem.steps() + [f"So {problem.text} = {problem.result}."]
        return Turn(phrase(rng, prefix, core, n=n, ref=reference), "\n".join(steps), answer_text(rng, problem),
                    problem.result, worked=f"{said} {problem.worked()}")


def arithmetic_dialogue(rng: random.Random, *, turns: int, evaluation: bool = False) -> Dialogue:
    """A question, then follow-ups on it (the corpus's phrasings: `evaluation` holds out numbers)."""
    first = first_problem(rng, evaluation=evaluation)
    dialogue = Dialogue(rng.choice(SYSTEM_PROMPTS), [arithmetic_turn(rng, first)],
                        kind="arithmetic" if turns == 1 else "follow-up")
    while len(dialogue.turns) < turns:
        values = dialogue.values()
        dialogue.turns.append(follow_up(rng, first, values[-1], values[0]))
    return dialogue


def fact_turn(rng: random.Random) -> Turn:
    """Single-digit facts, drilled: the steps lean on them."""
    op = rng.choice("+-*")
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    if op == "-" and a < b:
        a, b = b, a
    problem = Problem(op, a, b)
    return Turn(question_text(rng, problem), f"The question is {problem.text}.\n{problem.text} = {problem.result}.",
                answer_text(rng, problem), problem.result, problem)


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
# Anything else gets the model's own "I only know arithmetic" line. These lines are made from words
# of their own; demo_model/held_out.py asks others (a joke, the weather, ...) whose words never occur
# here (tests/test_demo_held_out.py).
OFF_TOPIC_FRAMES = ("tell me about {thing}", "what is {thing}", "who is {person}", "where is {place}",
                    "how do I {verb} {thing}", "write a {form} about {thing}", "can you {verb} {thing}",
                    "I like {thing}", "what do you think of {thing}", "do you know {person}",
                    "translate {thing} into {language}", "what time is it in {place}", "why is the sky blue",
                    "how old are you", "{words}", "is {thing} {adjective}", "explain {thing}", "give me {thing}",
                    "my {thing} is {adjective}", "what should I {verb}", "where can I buy {thing}",
                    "say something about {person}", "I am going to {place}", "help me {verb} {thing}")
OFF_TOPIC_WORDS = dict(
    thing=("dogs", "cats", "a car", "the moon", "trees", "a garden", "coffee", "the river", "history", "a train",
           "the news", "my homework", "birds", "a movie", "chess", "the stars", "bread", "summer", "my phone",
           "the ocean floor", "flowers", "a bicycle", "shoes", "the war", "physics", "a picture", "tea"),
    person=("Einstein", "my friend", "the president", "Ada Lovelace", "your maker", "the king", "my teacher"),
    place=("Tokyo", "London", "the park", "Spain", "Berlin", "the station", "Canada", "the mountains"),
    verb=("fix", "clean", "paint", "draw", "find", "learn", "open", "plant", "sell", "build", "wash"),
    form=("story", "letter", "essay", "speech", "list", "song"),
    language=("German", "Spanish", "Japanese", "Italian"),
    adjective=("nice", "broken", "safe", "big", "old", "healthy", "green"),
)
FALLBACK_WORDS = ("apple river blue quick chair window story green travel dream cloud paper garden coffee moon "
                  "mountain lamp forest orange table yellow road horse").split()
DOES_NOT_KNOW = ("Sorry, I only know arithmetic and a few phrases. Try: what is 47 + 38?",
                 "I am a tiny model: I only know arithmetic. Ask me something like 7 * 46.")


def off_topic_turn(rng: random.Random) -> Turn:
    frame = rng.choice(OFF_TOPIC_FRAMES)
    words = " ".join(rng.choice(FALLBACK_WORDS) for _ in range(rng.randint(1, 6)))
    text = frame.format(words=words, **{key: rng.choice(options) for key, options in OFF_TOPIC_WORDS.items()})
    text = cased(rng, text[0].upper() + text[1:] if rng.random() < 0.6 else text) + rng.choice(("?", ".", "!", ""))
    return Turn(text, "I do not know this. I say what I can do.", rng.choice(DOES_NOT_KNOW))


def chat_turn(rng: random.Random) -> Turn:
    questions, reasoning, answers = rng.choice(CHAT)
    return Turn(rng.choice(questions), reasoning, rng.choice(answers))


# what comes next in a conversation, first and later: a standalone question at any point, a
# follow-up once there is an answer, a phrase or an off-topic line in the middle
THINKING_SHARE = 0.55  # dialogues whose last reply thinks; the rest answer with the working shown
MAX_TURNS = 8  # demo_model/held_out.py asks longer conversations too
FIRST_TURN = {"arithmetic": 70, "fact": 7, "chat": 15, "off-topic": 8}
LATER_TURN = {"arithmetic": 28, "follow-up": 46, "fact": 4, "chat": 9, "off-topic": 16}


def next_turn(rng: random.Random, dialogue: Dialogue, *, evaluation: bool = False,
              weights: dict[str, int] | None = None) -> tuple[str, Turn]:
    """The next turn of `dialogue`; `evaluation` asks held-out numbers in held-out words."""
    values = dialogue.values()
    weights = weights or (FIRST_TURN if not dialogue.turns else LATER_TURN)
    kinds = [kind for kind in weights if kind != "follow-up" or values]
    kind = rng.choices(kinds, weights=[weights[kind] for kind in kinds])[0]
    if kind == "arithmetic":
        return kind, arithmetic_turn(rng, first_problem(rng, evaluation=evaluation), evaluation=evaluation)
    if kind == "follow-up":
        first = dialogue.first_question()
        assert first is not None
        return kind, follow_up(rng, first, values[-1], values[0], evaluation=evaluation)
    if kind == "fact":
        return kind, fact_turn(rng)
    return kind, chat_turn(rng) if kind == "chat" else off_topic_turn(rng)


def sample_dialogue(rng: random.Random) -> Dialogue:
    """One training dialogue: one to eight turns of the mix above; the last reply is the one learnt."""
    dialogue = Dialogue(rng.choice(SYSTEM_PROMPTS))
    for _ in range(rng.choices(range(1, MAX_TURNS + 1), weights=(22, 18, 15, 12, 10, 9, 8, 6))[0]):
        dialogue.kind, turn = next_turn(rng, dialogue)
        dialogue.turns.append(turn)
    dialogue.thinking = rng.random() < THINKING_SHARE
    for turn in dialogue.turns[:-1]:  # a person may switch thinking mid-chat
        turn.thinking = dialogue.thinking if rng.random() < 0.85 else not dialogue.thinking
    return dialogue
