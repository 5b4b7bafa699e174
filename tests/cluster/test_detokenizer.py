"""Incremental detokenisation emits whole characters only, and all of the text in the end."""

from __future__ import annotations

import checkpoints
from metrale.cluster.detokenizer import IncrementalDetokenizer


def test_multibyte_characters_are_never_split(tmp_path):
    tok = checkpoints.train_tokenizer(tmp_path)
    text = "日本語 🙂 naïve façade Grüße 👋 東京"
    ids = tok.encode(text).ids
    assert len(ids) > len(text.split())      # some characters span several byte tokens
    detok, pieces = IncrementalDetokenizer(tok), []
    for i in range(1, len(ids) + 1):
        piece = detok.step(ids[:i], final=i == len(ids))
        assert "\ufffd" not in piece
        pieces.append(piece)
    assert "".join(pieces) == text


def test_final_flush_emits_an_unfinished_character(tmp_path):
    tok = checkpoints.train_tokenizer(tmp_path)
    ids = tok.encode("🙂").ids
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tok)
    assert detok.step(ids[:1]) == ""
    assert detok.step(ids[:1], final=True) == "\ufffd"
