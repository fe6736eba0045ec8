"""How one reply picks its next token: transformers' own logits processors and warpers, per row.

A batch row may be greedy while its neighbour samples at temperature 0.8 with a repetition
penalty: each reply builds the processor list `generate` would build for its options, and
applies it to its own row of logits with its own token history. An optional seed gives the
reply its own random generator, so a sampled reply does not depend on what else ran.
"""

from __future__ import annotations

from typing import Sequence

import torch
from transformers import PreTrainedModel

from chat.dialogue.options import GenerationOptions


class TokenChooser:
    def __init__(self, model: PreTrainedModel, options: GenerationOptions, prompt_length: int):
        config, _ = model._prepare_generation_config(None, **options.generate_kwargs())
        model._prepare_special_tokens(config, kwargs_has_attention_mask=True, device=model.device)
        self.processors = model._get_logits_processor(config, input_ids_seq_length=prompt_length,
                                                      device=model.device)
        self.do_sample = bool(config.do_sample)
        self.max_new_tokens = options.max_new_tokens
        eos = config.eos_token_id
        self.eos_token_ids = frozenset([eos] if isinstance(eos, int) else eos or [])
        self.device = model.device
        self.generator: torch.Generator | None = None
        if options.seed is not None:
            self.generator = torch.Generator(device=model.device).manual_seed(options.seed)

    def choose(self, sequence: Sequence[int], logits: torch.Tensor) -> int:
        """The next token after `sequence` (prompt and reply so far), from its (1, vocab) logits."""
        scores = logits.float()
        if self.processors:
            scores = self.processors(torch.tensor([list(sequence)], device=self.device), scores)
        if not self.do_sample:
            return int(scores.argmax(-1))
        probabilities = torch.softmax(scores, dim=-1)
        return int(torch.multinomial(probabilities, num_samples=1, generator=self.generator))

    def ends(self, token_id: int, generated: int) -> bool:
        return token_id in self.eos_token_ids or generated >= self.max_new_tokens
