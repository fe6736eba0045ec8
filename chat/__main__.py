"""A terminal chat on the engine: `python -m chat [--model demo]`. Commands: /regen /undo /quit."""

from __future__ import annotations

import argparse
import sys

from chat import ChatEngine, ChatError, GenerationOptions, ModelLoadError


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="demo", help='hub id, local folder, or "demo" (a toy trained here: arithmetic)')
    parser.add_argument("--system", default=None, help="system prompt")
    parser.add_argument("--max-new-tokens", type=int, default=GenerationOptions.max_new_tokens)
    args = parser.parse_args()
    try:
        engine = ChatEngine.load(args.model)
    except ModelLoadError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    conv = engine.conversation(args.system)
    while True:
        try:
            line = input("you> ")
        except (EOFError, KeyboardInterrupt):
            return 0
        try:
            if line == "/quit":
                return 0
            if line == "/undo":
                conv.undo()
                continue
            stream = conv.regenerate if line == "/regen" else (lambda **o: conv.send(line, **o))
            print("bot> ", end="")
            for delta in stream(max_new_tokens=args.max_new_tokens):
                print(delta.text, end="", flush=True)
            stats = conv.stats
            print(f"\n     [reused {stats.reused_tokens}, prefilled {stats.prefilled_tokens}, "
                  f"ttft {stats.ttft_s * 1000:.0f} ms, {stats.decode_tokens_per_s:.0f} tok/s]")
        except ChatError as error:
            print(f"(!) {error}")


if __name__ == "__main__":
    raise SystemExit(main())
