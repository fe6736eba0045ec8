"""Token ids to text as they stream: bytes of a character split over tokens are held back."""

from __future__ import annotations

from typing import Sequence

from transformers import PreTrainedTokenizerBase


class IncrementalDecoder:
    """Token ids in, text deltas out; holds back bytes of a character that is not complete yet."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, skip_ids: set[int], context_ids: Sequence[int] = ()):
        self.tokenizer = tokenizer
        self.skip_ids = skip_ids
        self.ids: list[int] = list(context_ids)  # tokens already shown (a reply being continued)
        self.context_text = self._decode(self.ids)
        self._prefix_offset = max(0, len(self.ids) - 6)  # a few tokens of context for merges
        self._read_offset = len(self.ids)

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode([i for i in ids if i not in self.skip_ids], skip_special_tokens=False)

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        before = self._decode(self.ids[self._prefix_offset : self._read_offset])
        after = self._decode(self.ids[self._prefix_offset :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
            return after[len(before) :]
        return ""

    def flush(self) -> str:
        before = self._decode(self.ids[self._prefix_offset : self._read_offset])
        after = self._decode(self.ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self.ids)
        return after[len(before) :]
