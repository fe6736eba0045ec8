"""Turn by turn against an OpenAI-compatible server: this app's prompts against naive ones.

  session  one conversation: every turn sends the same canonical history as the last one plus the
           new message, with the conversation's own `cache_salt`, so the server's prefix cache
           can hit
  naive    the same messages, but each turn as a new conversation (a fresh `cache_salt`): what a
           server gives when nothing of the last turn can be reused

Reported per turn: prompt tokens, what the server said of its cached tokens (or "unknown"), and
time to first token. `python -m benchmarks.served --base-url http://127.0.0.1:8000/v1 --model NAME`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from benchmarks.report import publish
from chat.backends.served import ServedEngine

QUESTIONS = ["What is 47 + 38?", "and plus 7?", "double it", "What is 7 * 46?", "and minus 9?", "What is 12 + 30?"]


def turn_row(conv) -> dict:
    stats = conv.stats
    return {"prompt_tokens": stats.prompt_tokens, "ttft_s": stats.ttft_s,
            "cached_tokens": stats.reused_tokens if stats.cache_reuse_known else None}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--model", required=True, help="the served model's name (and tokenizer, unless --tokenizer)")
    parser.add_argument("--tokenizer")
    parser.add_argument("--api-key")
    parser.add_argument("--prompt-format", default="messages", choices=["messages", "text", "token-ids"])
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    engine = ServedEngine(args.base_url, args.model, api_key=args.api_key, tokenizer=args.tokenizer,
                          prompt_format=args.prompt_format)
    options = dict(max_new_tokens=args.max_new_tokens, do_sample=False)
    session = engine.conversation("You are a helpful assistant.")
    rows = []
    for turn in range(args.turns):
        question = QUESTIONS[turn % len(QUESTIONS)]
        naive = engine.restore(session.to_dict())  # the same history, a new conversation: a fresh salt
        list(naive.send(question, **options))
        list(session.send(question, **options))
        rows.append({"turn": turn + 1, "session": turn_row(session), "naive": turn_row(naive)})
    result = {"config": vars(args), "turns": rows,
              "server_reports_cached_tokens": any(r["session"]["cached_tokens"] is not None for r in rows),
              "server_refused_fields": sorted(engine.runtime.refused_fields)}
    return publish(result, started, targets=lambda r: [], markdown=markdown, plot=lambda r, p: None,
                   json_path=args.json, plot_path=None)


def markdown(result: dict) -> str:
    shown = lambda value: "unknown" if value is None else str(value)  # noqa: E731
    lines = [f"# Against {result['config']['base_url']} ({result['config']['model']}, "
             f"{result['config']['prompt_format']})", "",
             "| turn | prompt tokens | session: cached | naive: cached | session TTFT | naive TTFT |",
             "|---:|---:|---:|---:|---:|---:|"]
    for row in result["turns"]:
        session, naive = row["session"], row["naive"]
        lines.append(f"| {row['turn']} | {session['prompt_tokens']} | {shown(session['cached_tokens'])} | "
                     f"{shown(naive['cached_tokens'])} | {session['ttft_s'] * 1000:.0f} ms | "
                     f"{naive['ttft_s'] * 1000:.0f} ms |")
    ratio = statistics.median(r["naive"]["ttft_s"] / r["session"]["ttft_s"] for r in result["turns"])
    lines += ["", f"Median naive/session time to first token: {ratio:.2f}x. The server "
              + ("reports" if result["server_reports_cached_tokens"] else "does not report")
              + " cached tokens; fields it refused: " + (", ".join(result["server_refused_fields"]) or "none") + "."]
    return "\n".join(lines)


if __name__ == "__main__":
    main(sys.argv[1:])
