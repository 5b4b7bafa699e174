"""Incremental detokenisation that never emits half of a multi-byte character."""

from __future__ import annotations

from tokenizers import Tokenizer


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.prefix_offset = 0   # start of the window decoded for context
        self.read_offset = 0     # tokens already turned into emitted text

    def step(self, token_ids: list[int], final: bool = False) -> str:
        """New text for the completion `token_ids` so far; holds back an unfinished character
        (decoded as U+FFFD) until the token that completes it arrives, or `final` flushes it."""
        before = self.tokenizer.decode(token_ids[self.prefix_offset:self.read_offset]) \
            if self.read_offset > self.prefix_offset else ""
        after = self.tokenizer.decode(token_ids[self.prefix_offset:])
        if len(after) <= len(before) or (after.endswith("\ufffd") and not final):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(token_ids)
        return after[len(before):]
