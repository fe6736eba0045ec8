"""A terminal chat on the engine: `python -m chat [--model demo]`. Type /help for the commands.

Ctrl+C during a reply stops it (the partial reply is kept, as with the web page's Stop); Ctrl+C
at the prompt, /quit or end of input exits. Reasoning is shown dimmed, apart from the answer. In
a terminal, the message is prepared while it is typed, as on the page (chat/typing_ahead.py).
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Iterator

from chat import ChatEngine, ChatError, Conversation, Delta, GenerationOptions, ModelLoadError, TurnStats
from chat.config import EngineConfig
from chat.scheduling.drafting import DRAFT_MODES
from chat.typing_ahead import line_reader

COMMANDS = {
    "/help": "this list",
    "/regen": "a new version of the last reply",
    "/undo": "drop the last message and its reply",
    "/edit N text": "replace user message N (as numbered by /history) and reply again",
    "/continue": "go on with the last reply",
    "/version N": "show version N of the last reply (1, 2, ...)",
    "/history": "the conversation so far",
    "/new": "start a new conversation",
    "/quit": "exit (also Ctrl+C at the prompt, or end of input)",
}
DIM, RESET = ("\033[2m", "\033[0m") if sys.stdout.isatty() else ("", "")


def stats_line(stats: TurnStats | None) -> str:
    if stats is None:
        return ""
    line = (f"prompt: {stats.reused_tokens} of {stats.prompt_tokens} tokens from the cache, "
            f"{stats.prefilled_tokens} computed · first token after {stats.ttft_s * 1000:.0f} ms · "
            f"{stats.decode_tokens_per_s:.0f} tokens/s")
    return line + (" · stopped" if stats.stopped else "") + (" · rebuilt" if stats.rebuilt else "") + (
        f" · the model did not see the {stats.dropped_turns} oldest turn(s): past its context" if stats.dropped_turns
        else "")


def show(deltas: Iterator[Delta], write: Callable[[str], None]) -> None:
    kind = None
    for delta in deltas:
        if delta.kind != kind:
            write(RESET + ("\n" if kind else "") + (DIM if delta.kind == "reasoning" else ""))
            kind = delta.kind
        write(delta.text)
    write(RESET + "\n")


class TerminalChat:
    def __init__(self, engine: ChatEngine, system: str | None, options: GenerationOptions):
        self.engine, self.system, self.options = engine, system, options
        self.conv: Conversation = engine.conversation(system)

    def write(self, text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    def reply(self, start: Callable[[], Iterator[Delta]]) -> None:
        stream = start()
        try:
            show(stream, self.write)
        except KeyboardInterrupt:  # stop the reply, keep what was written
            self.conv.stop()
            for _ in stream:
                pass
            self.write(RESET + "\n")
        self.write(f"{DIM}[{stats_line(self.conv.stats)}]{RESET}\n")

    def handle(self, line: str) -> bool:
        """Run one input line; False to exit."""
        command, _, rest = line.strip().partition(" ")
        if command == "/quit":
            return False
        if command == "/help":
            self.write("".join(f"  {name:<14} {text}\n" for name, text in COMMANDS.items()))
        elif command == "/new":
            self.conv = self.engine.conversation(self.system)
            self.write("(a new conversation)\n")
        elif command == "/undo":
            self.conv.undo()
            self.write("(undone)\n")
        elif command == "/history":
            if not self.conv.messages:
                self.write("(nothing said yet)\n")
            for number, message in enumerate(self.conv.messages):
                self.write(f"{number:>3} {message['role']}: {message['content']}\n")
        elif command == "/version":
            if not rest.strip().isdigit() or int(rest) < 1:
                raise ValueError("/version takes a version number, from 1: /version 1")
            self.conv.select_version(int(rest) - 1)
            active, count = self.conv.versions
            self.write(f"(version {active + 1} of {count}): {self.conv.messages[-1]['content']}\n")
        elif command == "/regen":
            self.reply(lambda: self.conv.regenerate(fit_context=True, **self._options()))
        elif command == "/continue":
            self.reply(lambda: self.conv.continue_reply(**self._options()))
        elif command == "/edit":
            number, _, text = rest.partition(" ")
            if not number.isdigit() or not text.strip():
                raise ValueError("/edit takes the number /history shows for one of your messages, then the new "
                                 "text: /edit 0 What is 2 + 2?")
            self.reply(lambda: self.conv.edit(int(number), text, fit_context=True, **self._options()))
        elif command.startswith("/"):
            self.write(f"(!) unknown command {command}; /help lists them\n")
        else:
            self.reply(lambda: self.conv.send(line, fit_context=True, **self._options()))
        return True

    def _options(self) -> dict:
        return {name: value for name, value in self.options.__dict__.items() if value is not None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="demo",
                        help='hub id, local folder, or "demo" (a toy trained here: arithmetic)')
    parser.add_argument("--system", default=None, help="system prompt")
    parser.add_argument("--max-new-tokens", type=int, default=GenerationOptions.max_new_tokens)
    parser.add_argument("--temperature", type=float, default=None, help="0 for greedy; the model's default if unset")
    parser.add_argument("--no-thinking", action="store_true", help="ask the template to skip reasoning")
    parser.add_argument("--draft", choices=DRAFT_MODES, default=EngineConfig.draft,
                        help="decode steps verify tokens guessed from the conversation (replies are as without)")
    args = parser.parse_args(argv)
    try:
        engine = ChatEngine.load(args.model, draft=args.draft)
    except ModelLoadError as error:
        print(f"rewind-chat: {error}", file=sys.stderr)
        return 1
    sampling = {} if args.temperature is None else (
        dict(do_sample=False) if args.temperature <= 0 else dict(do_sample=True, temperature=args.temperature))
    options = GenerationOptions(max_new_tokens=args.max_new_tokens,
                                enable_thinking=False if args.no_thinking else None, **sampling)
    chat = TerminalChat(engine, args.system, options)
    print(f"rewind-chat · {args.model} on {engine.model.device} · /help for commands, Ctrl+C stops a reply")
    # the message is prepared while it is typed, where the terminal allows (chat/typing_ahead.py)
    read = line_reader("you> ", lambda text: chat.conv.prepare(text, fit_context=True, **chat._options()))
    while True:
        try:
            line = read()
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        try:
            if not chat.handle(line):
                return 0
        except (ChatError, ValueError) as error:
            print(f"(!) {error}")
        except KeyboardInterrupt:  # during a command's output (a long /history): exit, as at the prompt
            print()
            return 0


if __name__ == "__main__":
    from chat.host import end_process

    end_process(main())
