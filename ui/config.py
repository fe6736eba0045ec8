"""The app's settings: each flag's default, environment variable and help, written once."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field, fields
from typing import Any, Sequence

from chat.config import EngineConfig
from chat.storage.store import Quotas


def _setting(default: Any, env: str | tuple[str, ...], help: str = "") -> Any:
    names = (env,) if isinstance(env, str) else env
    return field(default=default, metadata={"env": names, "help": help})


def _yes_no(value: str | bool) -> bool:
    if isinstance(value, bool):
        return value
    if value.strip().lower() in ("1", "true", "yes", "on"):
        return True
    if value.strip().lower() in ("0", "false", "no", "off", ""):
        return False
    raise argparse.ArgumentTypeError(f"expected yes or no, got {value!r}")


# Hugging Face does not publish its Spaces proxy's addresses; a Space's container is reached only
# through it, from the private networks, where no visitor's connection comes from.
SPACE_PROXY_NETWORKS = "10.0.0.0/8,172.16.0.0/12,192.168.0.0/16,fc00::/7"


@dataclass(frozen=True)
class AppConfig:
    model: str = _setting("demo", "MODEL_ID", 'hub id, local folder, or "demo" (a toy model trained here); with '
                          '--backend openai, the served model\'s name')
    backend: str = _setting("local", "BACKEND", "local (this process runs the model) or openai (an OpenAI-compatible "
                            "server: vLLM, SGLang, transformers serve)")
    base_url: str | None = _setting(None, "BASE_URL", "with --backend openai: the server, e.g. http://host:8000/v1")
    api_key: str | None = _setting(None, "API_KEY", "with --backend openai: its key, if it wants one")
    prompt_format: str = _setting("messages", "PROMPT_FORMAT", "with --backend openai: messages (chat completions), "
                                  "or text / token-ids (completions with the prompt rendered here; Continue works; "
                                  "vLLM takes token-ids)")
    tokenizer: str | None = _setting(None, "TOKENIZER", "with --backend openai: where to load the tokenizer "
                                     "(and chat template) from; default: --model")
    warm_served: bool = _setting(True, "WARM_SERVED", "with --backend openai: while a message is typed, send the "
                                 "request its Send will make for one token, so a prefix-caching server (vLLM, "
                                 "SGLang) has the prompt ready; off for a server without a prefix cache")
    serve_api: bool = _setting(True, "SERVE_API", "serve the OpenAI API (/v1/chat/completions, /v1/completions, "
                               "/v1/models) beside the page, from the same engine and its caches (local backend; "
                               "not on ZeroGPU)")
    serve_api_key: str | None = _setting(None, "SERVE_API_KEY", "a key every /v1 request must send as Authorization: "
                                         "Bearer; default none: open to whoever reaches the page")
    host: str = _setting("127.0.0.1", ("HOST", "GRADIO_SERVER_NAME"))
    port: int = _setting(7860, ("PORT", "GRADIO_SERVER_PORT"))
    device: str | None = _setting(None, "DEVICE", "cuda, mps or cpu; automatic by default")
    dtype: str | None = _setting(None, "DTYPE", "bfloat16, float16, float32; automatic by default")
    cache_budget_mb: float = _setting(2048.0, "CACHE_BUDGET_MB", "all KV caches together; over it, idle "
                                      "sessions go to --cache-dir, or are evicted without one")
    cache_dir: str | None = _setting(None, "CACHE_DIR", "a folder for idle sessions' caches over the budget "
                                     "(their next turn reads them back instead of recomputing); emptied at start "
                                     "and exit; default none: evicted")
    cache_dir_mb: float = _setting(EngineConfig.cache_dir_bytes / 2**20, "CACHE_DIR_MB",
                                   "the most --cache-dir holds; over it the oldest go")
    kv_cache: str = _setting(EngineConfig.kv_cache, "KV_CACHE", "dynamic (exact) or quantized (full-attention "
                             "states in --kv-bits bits: 3.6x / 6.4x fewer bytes a token, slower decode)")
    kv_bits: int = _setting(EngineConfig.kv_bits, "KV_BITS", "with --kv-cache quantized: 8 or 4")
    weights: str = _setting("auto", "WEIGHTS", "auto (full or packed, whichever this CPU multiplies faster, timed "
                            "at start on the model's own layer; shown in /status), full (as loaded), packed (fp32 "
                            "weights in oneDNN's layout, CPU only: several conversations decode together far faster; a head "
                            "tied to the embedding is then held twice, which auto does not do) "
                            "or int8 (linear weights in int8, CPU only: a quarter of fp32's bytes, faster decode)")
    compile: str = _setting(EngineConfig.compile, "COMPILE", "auto, on or off: decode steps as compiled graphs "
                            "(built beside the running app; auto: from 200 M parameters, on the CPU)")
    draft: str = _setting(EngineConfig.draft, "DRAFT", "auto, ngram or off: decode steps verify tokens guessed "
                          "from the conversation and the reply's earlier versions, several a step (replies are "
                          "as without; auto: only where they pay for themselves on this machine)")
    max_sessions: int = _setting(64, "MAX_SESSIONS")
    idle_timeout_min: float = _setting(30.0, "IDLE_TIMEOUT_MIN", "free a session idle this long")
    max_batch: int = _setting(EngineConfig.max_batch_size, "MAX_BATCH",
                              "replies decoded together, one batched forward per step")
    prefill_chunk: int = _setting(EngineConfig.prefill_chunk, "PREFILL_CHUNK",
                                  "the most prompt tokens a step carries while others decode (fewer when timed steps say so)")
    prefill_chunk_alone: int = _setting(EngineConfig.prefill_chunk_alone, "PREFILL_CHUNK_ALONE",
                                        "the most prompt tokens a step carries while none decodes (fewer when a "
                                        "step would pass 2 s)")
    concurrency: int = _setting(0, "CONCURRENCY", "replies streaming at once (Gradio queue); 0: as many "
                                "as --max-batch")
    max_new_tokens: int = _setting(512, "MAX_NEW_TOKENS", "the largest reply a user may ask for")
    max_message_chars: int = _setting(20_000, "MAX_MESSAGE_CHARS", "longer messages are refused before any work")
    max_system_chars: int = _setting(4_000, "MAX_SYSTEM_CHARS", "longer system prompts are refused")
    max_request_mb: float = _setting(32.0, "MAX_REQUEST_MB", "the largest request body (an event with the "
                                     "browser's list, an upload); larger ones are refused with 413")
    max_waiting_mb: float = _setting(96.0, "MAX_WAITING_MB", "large request bodies (1 MB or more) all clients "
                                     "together may have waiting to be handled (one client: two of the largest); "
                                     "more are refused at once")
    max_waiting_events: int = _setting(64, "MAX_WAITING_EVENTS", "queued events one address may have waiting "
                                       "(Gradio's queue holds 256 for everyone); more are refused at once")
    max_per_client: int = _setting(8, "MAX_PER_CLIENT", "conversations one address may hold (0: no limit); "
                                   "at the limit its own oldest idle one is closed")
    monitoring: bool = _setting(False, "MONITORING", "Gradio's /monitoring page (per-endpoint timings, "
                                "visible to anyone)")
    storage_secret: str | None = _setting(None, "STORAGE_SECRET", "no longer used: the copy each browser keeps is "
                                          "not sealed (a key the page carries is no secret); every copy is checked "
                                          "as an Import")
    trusted_proxies: str | None = _setting(None, "TRUSTED_PROXIES", "addresses or networks, comma-separated, whose "
                                           "X-Forwarded-For names the client; default none (on a Hugging Face Space: "
                                           "the private networks its proxy connects from)")
    page_states: int = _setting(1000, "PAGE_STATES", "closed pages whose Gradio state is kept (for an hour at most, "
                                "about 200 KB each); a page past it gets its conversation back from its browser")
    store_url: str | None = _setting(None, ("STORE_URL", "DATABASE_URL"), "the store of shared links and "
                                     "signed-in people's conversations: an SQLAlchemy URL (postgresql+psycopg://... "
                                     "when several replicas serve one address); default SQLite in /data on a Space "
                                     "with persistent storage, else in ~/.local/share/rewind-chat")
    anonymous_share_days: float = _setting(Quotas.anonymous_share_days, "ANONYMOUS_SHARE_DAYS",
                                           "how long a link shared without signing in lasts, in days")
    max_checkpoints: int = _setting(EngineConfig.max_checkpoints, "MAX_CHECKPOINTS",
                                    "snapshots per conversation for layers that cannot be cropped")

    @classmethod
    def from_args(cls, argv: Sequence[str] | None = None, environ: dict[str, str] | None = None) -> "AppConfig":
        """Flags win over environment variables, which win over the defaults above."""
        environ = os.environ if environ is None else environ
        parser = argparse.ArgumentParser(
            description="rewind-chat: a chat UI whose KV cache rolls back instead of recomputing")
        for setting in fields(cls):
            names = setting.metadata["env"]
            default = next((environ[name] for name in names if name in environ), setting.default)
            kind = _yes_no if isinstance(setting.default, bool) else type(setting.default) \
                if setting.default is not None else str
            parser.add_argument("--" + setting.name.replace("_", "-"), type=kind, default=kind(default)
                                if default is not None else None,
                                help=f"{setting.metadata['help']} [env {' or '.join(names)}]".strip())
        return cls(**vars(parser.parse_args(argv)))

    @property
    def proxies(self) -> str:
        """What uvicorn trusts (its FORWARDED_ALLOW_IPS); "" trusts no one: the socket's peer counts."""
        if self.trusted_proxies is not None:
            return self.trusted_proxies
        return SPACE_PROXY_NETWORKS if os.environ.get("SPACE_ID") else ""

    @property
    def streams(self) -> int:
        """The Gradio queue's concurrency: by default every row of the batch can be streaming."""
        return self.concurrency or self.max_batch
