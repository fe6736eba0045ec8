"""The engine's settings, each default written once (the app's flags read theirs from here)."""

from __future__ import annotations

from dataclasses import dataclass

from chat.model_step.compiled import check_compile_mode
from cache_sessions.kv_cache import KVCacheKind
from cache_sessions.prefixes import DEFAULT_MAX_ENTRIES
from cache_sessions.states import DEFAULT_MAX_CHECKPOINTS
from chat.scheduling.drafting import check_draft_mode
from chat.scheduling.step_budget import DEFAULT_ALONE_STEP_S, DEFAULT_GAP_FACTOR
from chat.model_step.weights import check_weight_format

DEFAULT_MAX_BATCH_SIZE = 8
# A cap under the timed step budget (chat/scheduling/step_budget.py), which decides on a real model's shape; on
# the 33.6 M benchmark model the cap decides, and 128 took a newcomer's message beside 8 streams
# from 2.0-2.4x an idle engine's first token to 1.6-1.8x with the streams' worst gap unchanged
# (docs/performance.md, "Fairness"; 64 before).
DEFAULT_PREFILL_CHUNK = 128
DEFAULT_PREFILL_CHUNK_ALONE = 512
DEFAULT_CACHE_DIR_BYTES = 4 * 2**30


@dataclass(frozen=True)
class EngineConfig:
    """`max_checkpoints`: snapshots kept per conversation for layers that cannot be cropped.
    `context_limit`: prompt + reply tokens allowed (None: the model's max_position_embeddings).
    `shared_prefixes`: distinct system-prompt prefixes kept prefilled for new conversations.
    `offload_sessions`: keep caches on the CPU between operations (ZeroGPU, where GPU memory
    does not survive between calls). `max_batch_size`: replies decoded together in one forward
    per step; more wait for a free row. `prefill_chunk`: prompt tokens prefilled per step while
    others decode (what a long prompt can delay them by, per step); `prefill_chunk_alone`: per
    step while none decodes (what a newcomer can wait behind; chat/scheduling/scheduler.py says why both);
    `prefill_order`: who gets a step's prefill budget first, "shortest" remaining or "arrival".
    `step_gap_factor`: while others decode, a step carries at most `prefill_chunk` prompt tokens
    and no more than keep it within this many decode steps, as timed on this machine
    (chat/scheduling/step_budget.py); None: always `prefill_chunk`. `alone_step_s`: while none decodes, a
    step carries at most `prefill_chunk_alone` prompt tokens and no more than fit in this many
    seconds, timed the same way (None, or `step_gap_factor` None: always `prefill_chunk_alone`).
    `cache_budget_bytes`: every cache together (None: no limit); over it, kept branches of idle
    conversations go first, then idle conversations' caches (cache_sessions/owner.py).
    `cache_dir`: where idle conversations' caches go over the budget instead of being dropped
    (None: dropped, their next turn rebuilds), at most `cache_dir_bytes` there; emptied on exit.
    `kv_cache`: "dynamic" (exact) or "quantized" (full-attention states in `kv_bits` bits, 8 or 4;
    cache_sessions/kv_cache.py says what exact means for it and which kinds are refused).
    `weights`: "full" (as loaded), "packed" (the fp32 weights in oneDNN's layout, CPU), "auto"
    (full or packed, whichever this host multiplies faster, timed on the model's own widest layer
    when the engine is made; the app's default) or "int8" (linear weights in int8 with a scale per
    channel, on the CPU; chat/model_step/weights.py), applied to the model when the engine is made (in
    place: a library caller's model as loaded stays so by default). `compile`: "on",
    "off" or "auto" (on from 200 M parameters, where it measured faster): decode steps take
    compiled graphs (chat/model_step/compiled.py; a graph per 1, 2, 4, 8 rows up to
    `max_batch_size`), compiled on a thread of their own while steps run eager, for the plain
    decoders on the CPU. `draft`: "auto", "ngram" or "off": decode steps verify tokens guessed
    from the conversation and the reply's earlier versions (chat/scheduling/drafting.py: replies as without;
    "auto" guesses only where its measured acceptance pays for what a token adds to a step)."""

    max_checkpoints: int = DEFAULT_MAX_CHECKPOINTS
    context_limit: int | None = None
    shared_prefixes: int = DEFAULT_MAX_ENTRIES
    offload_sessions: bool = False
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK
    prefill_chunk_alone: int = DEFAULT_PREFILL_CHUNK_ALONE
    prefill_order: str = "shortest"
    step_gap_factor: float | None = DEFAULT_GAP_FACTOR
    alone_step_s: float | None = DEFAULT_ALONE_STEP_S
    cache_budget_bytes: int | None = None
    cache_dir: str | None = None
    cache_dir_bytes: int = DEFAULT_CACHE_DIR_BYTES
    kv_cache: str = "dynamic"
    kv_bits: int = 8
    weights: str = "full"
    compile: str = "auto"
    draft: str = "auto"

    @property
    def kv_cache_kind(self) -> KVCacheKind:
        return KVCacheKind(self.kv_cache, self.kv_bits)

    def __post_init__(self) -> None:
        if self.max_checkpoints < 0:
            raise ValueError("max_checkpoints must be >= 0")
        if self.context_limit is not None and self.context_limit < 2:
            raise ValueError("context_limit must be at least 2 tokens")
        if self.shared_prefixes < 0:
            raise ValueError("shared_prefixes must be >= 0")
        if self.max_batch_size < 1:
            raise ValueError("max_batch_size must be at least 1")
        if self.prefill_chunk < 1 or self.prefill_chunk_alone < 1:
            raise ValueError("prefill_chunk and prefill_chunk_alone must be at least 1")
        if self.cache_budget_bytes is not None and self.cache_budget_bytes < 0:
            raise ValueError("cache_budget_bytes must be >= 0")
        if self.cache_dir_bytes < 0:
            raise ValueError("cache_dir_bytes must be >= 0")
        self.kv_cache_kind  # refuses an unknown or refused kind, or bits it does not hold
        check_weight_format(self.weights)
        check_compile_mode(self.compile)
        check_draft_mode(self.draft)
