"""Grammar masks through xgrammar: JSON schemas, regular expressions and EBNF, compiled per tokenizer."""

from __future__ import annotations

import json
import threading
from functools import lru_cache
from typing import Sequence

import torch
from tokenizers import Tokenizer, decoders

from metrale.cluster.params import GrammarSpec, RequestError

MAX_ROLLBACK = 64   # deeper than any verify: a rejection rolls back at most k + 1 tokens
# JSON with compact separators and no free whitespace: a constrained output is bounded by its schema
COMPACT = dict(any_whitespace=False, separators=(",", ":"))


class GrammarCompiler:
    """Compiles specs against one tokenizer, caching each compiled grammar."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: Sequence[int]):
        import xgrammar as xgr
        self.xgr, self.vocab_size = xgr, vocab_size
        self.info = _tokenizer_info(xgr, tokenizer, vocab_size, list(stop_token_ids))
        self.compiler = xgr.GrammarCompiler(self.info, cache_enabled=True)
        self._lock = threading.Lock()

    def compile(self, spec: GrammarSpec):
        """The compiled grammar; RequestError naming the problem when the spec is invalid."""
        with self._lock:
            return self._compile(spec)

    @lru_cache(maxsize=256)
    def _compile(self, spec: GrammarSpec):
        try:
            if spec.kind == "json_object":
                return self.compiler.compile_json_schema('{"type": "object"}', **COMPACT)
            if spec.kind == "json_schema":
                json.loads(spec.value)
                return self.compiler.compile_json_schema(spec.value, strict_mode=spec.strict,
                                                         **COMPACT)
            if spec.kind == "regex":
                return self.compiler.compile_regex(spec.value)
            return self.compiler.compile_grammar(spec.value)
        except json.JSONDecodeError as e:
            raise RequestError(f"response_format: the JSON schema is not valid JSON ({e})") from e
        except Exception as e:   # xgrammar reports bad schemas and grammars as RuntimeError etc.
            raise RequestError(f"response_format: invalid {spec.kind.replace('_', ' ')}: "
                               f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from e

    def constraint(self, spec: GrammarSpec) -> "GrammarConstraint":
        return GrammarConstraint(self, self.compile(spec))


class GrammarConstraint:
    """A TokenConstraint over an xgrammar matcher. `allowed(generated)` rolls the matcher back to
    the longest prefix it shares with `generated` and advances it over the rest, so rejected
    drafts are undone by asking again with the shorter prefix."""

    def __init__(self, compiler: GrammarCompiler, compiled):
        xgr = compiler.xgr
        self.matcher = xgr.GrammarMatcher(compiled, max_rollback_tokens=MAX_ROLLBACK)
        self.bitmask = xgr.allocate_token_bitmask(1, compiler.vocab_size)
        self.vocab_size = compiler.vocab_size
        self.consumed: list[int] = []
        self.stop_mask = torch.zeros(self.vocab_size, dtype=torch.bool)
        self.stop_mask[list(compiler.info.stop_token_ids)] = True
        self._bits = torch.arange(32, dtype=torch.int32)

    def allowed(self, generated: Sequence[int]) -> torch.Tensor:
        common = 0
        for a, b in zip(self.consumed, generated):
            if a != b:
                break
            common += 1
        if common < len(self.consumed):
            self.matcher.rollback(len(self.consumed) - common)
            del self.consumed[common:]
        for token in generated[common:]:
            if self.matcher.is_terminated():   # tokens after the end of text move nothing
                break
            if not self.matcher.accept_token(token):
                raise ValueError(f"token {token} breaks the grammar; masks should prevent it")
            self.consumed.append(token)
        if self.matcher.is_terminated():   # complete: only the end of text may follow
            return self.stop_mask
        self.matcher.fill_next_token_bitmask(self.bitmask)
        words = self.bitmask[0]
        mask = ((words[:, None] >> self._bits) & 1).flatten().bool()
        return mask[:self.vocab_size]


def _tokenizer_info(xgr, tokenizer: Tokenizer, vocab_size: int, stop_ids: list[int]):
    """xgrammar's view of a `tokenizers` vocabulary: byte-level BPE, or raw strings otherwise."""
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    encoded = [""] * max(len(vocab), 1)
    for token, i in vocab.items():
        if i < len(encoded):
            encoded[i] = token
    byte_level = isinstance(tokenizer.decoder, decoders.ByteLevel)
    vocab_type = xgr.VocabType.BYTE_LEVEL if byte_level else xgr.VocabType.RAW
    return xgr.TokenizerInfo(encoded, vocab_type, vocab_size=vocab_size, stop_token_ids=stop_ids)


def grammar_compiler(tokenizer: Tokenizer, vocab_size: int, stop_token_ids) -> GrammarCompiler:
    """A compiler for this tokenizer; RequestError when xgrammar is not installed."""
    try:
        import xgrammar  # noqa: F401
    except ImportError as e:
        raise RequestError("structured output (response_format) needs the xgrammar package, "
                           "which is not installed") from e
    return GrammarCompiler(tokenizer, vocab_size, stop_token_ids)
