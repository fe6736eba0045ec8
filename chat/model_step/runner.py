"""The runner: the one place a reply's model step runs (vLLM v1's model runner, at this scale).

The scheduler (chat/scheduling/scheduler.py) decides a step; the cache owner (cache_sessions/owner.py)
applies it to the sessions (rollback, what each feeds, commit) and imports no model code; this
executes it: every row's tokens through one model step, each row on its own cache, and returns
the logits the step's sampling needs. One entry point for decode rows and prompt pieces alike:

- the plain step (chat/model_step/plain_step.py) of the families it knows (Llama, Mistral, Qwen2,
  Qwen3, Gemma2; sliding windows included), written out over a packed sequence: compiled
  (chat/model_step/compiled.py) when a graph takes the step (decode rows alone of a model with
  full attention only, once built), else run eagerly, decode rows and prompt pieces together;
- else one packed forward of the model's own layers, each row attending to its own cache
  (chat/model_step/resident.py): the weights read once for every row (recurrent layers, a
  quantized cache, other families);
- else, for a model whose layers cannot run packed (recurrent mixers it cannot find), the
  model's own forward on each row's cache in turn.

A fast step proves itself. The plain step serves only a model whose modules it knows, with no
hook it would run past, and whose logits it matched at load on a short probe (`probe_plain`:
within `PROBE_TOLERANCE` of the model's own forward). While a forward hook is registered on the
model, its decoder, a decoder layer or an attention block, or one of their forwards is replaced
(asked every step: hooks come and go), every row runs the model's own forward alone, as
`generate` would run it, and no guess is fed (`hooked`).
"""

from __future__ import annotations

from typing import Sequence

import torch
from transformers import PreTrainedModel

from chat.model_step.compiled import CompiledDecode
from cache_sessions.kv_cache import KVCacheKind
from chat.model_step.plain_step import bypassed_modules, hook_refusal, plain_refusal, run_plain, takes_states
from chat.model_step.resident import forward_rows, packs
from cache_sessions.session import CacheSession
from chat.model_step.weights import Int8Linear, products_keep_rows_apart

Row = tuple[CacheSession, list[int]]  # a session and the tokens it feeds this step
# How far the plain step's logits may be from the model's own forward on the load probe, as a
# share of the largest logit (at least 1): float noise in fp32; 16-bit products round either way.
PROBE_TOLERANCE = {torch.float32: 1e-4}
PROBE_TOLERANCE_16_BIT = 5e-2
PROBE_TOKENS = 12


def packed_step(model: PreTrainedModel, rows: Sequence[Row], logits_of: Sequence[int], plain: bool,
                tails: Sequence[int] | None = None, alone: Sequence[int] = ()) -> torch.Tensor:
    """One eager step of every row, packed: the plain step where the model is of its families
    (`plain`) and every row's states are buffers it writes (each row's last `alone[r]` tokens
    attending one by one), else the model's own forward."""
    if plain and takes_states([session for session, _ in rows]):
        return run_plain(model, rows, logits_of, tails, alone)
    return forward_rows(model, rows, logits_of, tails)


class ModelRunner:
    def __init__(self, model: PreTrainedModel, compiled: CompiledDecode | None = None,
                 kv_cache: KVCacheKind = KVCacheKind()):
        self.model, self.compiled = model, compiled
        # Whether steps run packed, each session on its own cache (a probe session of this kind).
        self.packs = packs(model, [CacheSession(model, kv_cache=kv_cache)])
        # Why steps do not run as the plain step (None: they do, where the states allow).
        self.plain_refusal = plain_refusal(model) or (
            None if kv_cache.name == "dynamic" else f"the {kv_cache.name} cache's states are not buffers it writes")
        # Up to how many rows every product gives a row the bits it gets alone (int8 weights;
        # None: no such bound). Then a decode row's last input and its guesses attend one by one,
        # so a greedy reply with guesses is the one without, and a prompt's last piece goes with
        # its last token only within that many rows (chat/scheduling/step_planner.py). Only where every
        # step is the plain one, eager: the model's own forward attends a row in one call, and a
        # compiled one-row step sums its products in a loop of its own (chat/model_step/compiled.py),
        # so there no other step gives their bits and keeping rows apart would buy nothing.
        plain_eager = self.plain_refusal is None and (compiled is None or not compiled.enabled)
        self.rows_apart = Int8Linear.KERNEL_ROWS if plain_eager and products_keep_rows_apart(model) else None
        self._watched = bypassed_modules(model)  # whose hooks the packed and plain steps would not fire as generate

    def hooked(self) -> str | None:
        """Why steps now run the model's own forward row by row, with no guesses: a forward hook
        is registered on a module a packed step calls with several rows or the plain step runs
        past, or its forward is replaced (None: neither)."""
        return hook_refusal(self._watched)

    def guess_refusal(self) -> str | None:
        """Why no row may feed guesses now (None: they may): a verifying row would not give each
        guessed token the logits a step of that token alone gives. Row by row (`hooked`), a hook
        would see several tokens where `generate` shows it one; 16-bit products sum a row of
        several tokens in another order than one token's, and a near-tie then goes the other way."""
        hooked = self.hooked()
        if hooked is not None:
            return f"{hooked} (steps run row by row, one token a call, as generate runs them)"
        if self.rows_apart is None and self.model.dtype in (torch.bfloat16, torch.float16):
            return (f"{str(self.model.dtype).removeprefix('torch.')} products sum a row of several tokens in "
                    "another order than a token alone, which can change a greedy reply")
        return None

    @torch.no_grad()
    def probe_plain(self) -> None:
        """Run the plain step and the model's own forward on a short probe (a prompt piece, then a
        decode row) and refuse the plain step where their logits differ by more than
        `PROBE_TOLERANCE` (on the compute thread, once, at start)."""
        if self.plain_refusal is not None:
            return
        model = self.model
        vocab = model.config.get_text_config().vocab_size
        tokens = [(7919 * index + 11) % vocab for index in range(PROBE_TOKENS + 1)]
        session = CacheSession(model)
        if not takes_states([session]):  # (states the plain step never reads: it never serves them)
            return
        piece = run_plain(model, [(session, tokens[:-1])], [0])
        session.note_extended(tokens[:-1])
        row = run_plain(model, [(session, tokens[-1:])], [0])
        own = model(input_ids=torch.tensor([tokens], device=model.device)).logits[0]
        plain = torch.cat([piece, row]).float()
        int8 = any(isinstance(module, Int8Linear) for module in model.modules())  # (int8 products: bf16 outputs)
        share = PROBE_TOLERANCE_16_BIT if int8 else PROBE_TOLERANCE.get(model.dtype, PROBE_TOLERANCE_16_BIT)
        tolerance = share * max(1.0, own.abs().max().item())
        error = (plain - own.float()).abs().max().item()
        if not error <= tolerance:
            self.plain_refusal = (f"on the load probe its logits were {error:.3g} from the model's own forward "
                                  f"(allowed {tolerance:.3g})")

    def graph_ready(self, rows: int) -> bool:
        """Whether a compiled graph would take a step of `rows` single tokens."""
        return self.compiled is not None and self.compiled.bucket(rows) is not None

    @property
    def graph_steps(self) -> int:
        """Steps the compiled graphs ran so far (a step that ran one is timed apart)."""
        return self.compiled.steps if self.compiled is not None else 0

    def stats(self) -> dict[str, str | int | None]:
        """For `/status`: which eager step runs, why not the plain one, and up to how many rows
        steps keep rows apart (None: they do not)."""
        hooked = self.hooked()
        step = ("the model's own forward, row by row" if hooked or not self.packs else
                "plain" if self.plain_refusal is None else "the model's own forward, packed")
        return {"eager": step, "not_plain_because": hooked or self.plain_refusal, "rows_kept_apart": self.rows_apart}

    @torch.no_grad()
    def run(self, rows: Sequence[Row], logits_of: Sequence[int], tails: Sequence[int] | None = None,
            eager: bool = False) -> torch.Tensor:
        """Feed every row its tokens on its own cache; the logits after every token of the rows
        `logits_of` (indices into `rows`), in that order, or with `tails` only after the last
        `tails[n]` tokens of the nth of them (a decode row's last input and its guesses). Where
        rows are kept apart, each token whose logits are read attends alone. The ledgers are the
        owner's: it notes what was fed, or, if this raises, every row's states may hold part of
        the step. `eager`: not through a compiled graph even where one would take the step."""
        rows, logits_of = list(rows), list(logits_of)
        if self.hooked() is not None:  # as `generate` runs it: the model's own forward, alone
            return self._one_by_one(rows, logits_of, tails)
        if not eager and self.plain_refusal is None and self.compiled is not None and self.compiled.takes(rows, logits_of):  # one token a row: tails are 1
            logits = self.compiled.step(rows)
            if logits is not None:
                return logits
        if self.packs:
            alone = [0] * len(rows)
            if self.rows_apart:
                for number, index in enumerate(logits_of):
                    alone[index] = len(rows[index][1]) if tails is None else min(tails[number], len(rows[index][1]))
            return packed_step(self.model, rows, logits_of, self.plain_refusal is None, tails, alone)
        return self._one_by_one(rows, logits_of, tails)

    def _one_by_one(self, rows: list[Row], logits_of: list[int], tails: Sequence[int] | None) -> torch.Tensor:
        """The model's own forward on each row's cache, in turn (what it would run alone)."""
        device = self.model.device
        wanted = {index: len(rows[index][1]) if tails is None else min(tails[number], len(rows[index][1]))
                  for number, index in enumerate(logits_of)}  # a row's logits: after its last `wanted[row]` tokens
        logits: dict[int, torch.Tensor] = {}
        for index, (session, fed) in enumerate(rows):
            if not fed:
                raise ValueError("every row of a step feeds at least one token")
            held = len(session.token_ids)
            output = self.model(input_ids=torch.tensor([fed], device=device),
                                position_ids=torch.arange(held, held + len(fed), device=device)[None],
                                past_key_values=session.cache, use_cache=True,
                                logits_to_keep=wanted.get(index, 1))
            if index in wanted:
                logits[index] = output.logits[0]
        if not logits_of:
            return torch.empty(0, self.model.config.get_text_config().vocab_size, device=device)
        return torch.cat([logits[index] for index in logits_of])
