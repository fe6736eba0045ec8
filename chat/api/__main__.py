"""The OpenAI API alone, without the page: `python -m chat.api --model Qwen/Qwen3-0.6B --port 8000`,
then point any OpenAI client at http://127.0.0.1:8000/v1 (`python app.py` serves the same API
beside its page)."""

from __future__ import annotations

import argparse
import os
import sys

from chat.api.kept_states import DEFAULT_MAX_STATES, DEFAULT_STATES_PER_CLIENT, KeptStates
from chat.api.routes import DEFAULT_MAX_BODY_BYTES, api_routes
from chat.api.runs import DEFAULT_REQUESTS_PER_CLIENT, ApiRuns
from chat.config import EngineConfig
from chat.engine import ChatEngine
from chat.errors import ModelLoadError


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m chat.api", description=__doc__)
    parser.add_argument("--model", default="demo", help='hub id, local folder, or "demo" (a toy trained here)')
    parser.add_argument("--served-model-name", default=None,
                        help="the model's name in /v1/models and in requests (default: --model)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=os.environ.get("REWIND_API_KEY"),
                        help="a key every request must send as Authorization: Bearer (env REWIND_API_KEY); "
                             "default none: open to whoever reaches the port")
    parser.add_argument("--max-new-tokens", type=int, default=2048, help="the largest reply a request may ask for")
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--weights", default="auto", help="auto, full, packed or int8 (see app.py --help)")
    parser.add_argument("--compile", default=EngineConfig.compile)
    parser.add_argument("--draft", default=EngineConfig.draft)
    parser.add_argument("--max-batch", type=int, default=EngineConfig.max_batch_size)
    parser.add_argument("--cache-budget-mb", type=float, default=2048.0, help="all KV caches together")
    parser.add_argument("--cache-dir", default=None, help="a folder for idle caches over the budget")
    parser.add_argument("--max-states", type=int, default=DEFAULT_MAX_STATES,
                        help="conversations' states kept for every client together")
    parser.add_argument("--max-states-per-client", type=int, default=DEFAULT_STATES_PER_CLIENT)
    parser.add_argument("--max-requests-per-client", type=int, default=DEFAULT_REQUESTS_PER_CLIENT,
                        help="requests one client (an address) may have running or waiting; more get 429")
    parser.add_argument("--max-body-mb", type=float, default=DEFAULT_MAX_BODY_BYTES / 2**20)
    return parser


def main(argv: list[str] | None = None) -> int:
    import uvicorn
    from starlette.applications import Starlette

    args = parser().parse_args(argv)
    try:
        engine = ChatEngine.load(args.model, device=args.device, dtype=args.dtype, weights=args.weights,
                                 compile=args.compile, draft=args.draft, max_batch_size=args.max_batch,
                                 cache_budget_bytes=int(args.cache_budget_mb * 2**20), cache_dir=args.cache_dir)
    except (ModelLoadError, ValueError) as error:
        print(f"rewind-chat: {error}", file=sys.stderr)
        return 1
    states = KeptStates(engine.caches, engine.scheduler.call, max_states=args.max_states,
                        max_per_client=args.max_states_per_client)
    runs = ApiRuns(engine, max_new_tokens=args.max_new_tokens, states=states, model_name=args.served_model_name,
                   max_per_client=args.max_requests_per_client)
    app = Starlette(routes=api_routes(runs, api_key=args.api_key, max_body_bytes=int(args.max_body_mb * 2**20)))
    print(f"rewind-chat: the OpenAI API of {args.model} at http://{args.host}:{args.port}/v1", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    from chat.host import end_process

    end_process(main())
