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


def test_a_steps_tokens_end_a_sequence_where_appending_one_at_a_time_would(tmp_path):
    """The scheduler takes a step's tokens (accepted drafts and the sampled one) together and
    decodes their text once: the tokens kept, the text and the finish reason equal those of
    appending them one at a time (as plain decoding does), for stop tokens, EOS, the length,
    stop strings and multi-byte text. A request not streamed ends with the same text and
    reason, its text decoded only at the end (unless it has stop strings to look for)."""
    from metrale.cluster.params import SamplingParams
    from metrale.cluster.plan import WorkerCapacity
    from metrale.cluster.scheduler import Scheduler, SchedulerConfig
    tok = checkpoints.train_tokenizer(tmp_path)
    text = tok.encode("日本語 🙂 naïve façade Grüße 👋 東京 and the rest").ids
    eos = text[9]
    capacity = WorkerCapacity(num_blocks=64, block_size=4, num_slots=4, max_model_len=256,
                              vocab_size=tok.get_vocab_size(), eos_token_ids=(eos,),
                              hybrid=False)
    cases = [(dict(max_tokens=40, ignore_eos=True), (3, 1, 5, 2, 8, 4, 40)),
             (dict(max_tokens=40), (4, 8, 40)),                            # EOS at index 9
             (dict(max_tokens=40, ignore_eos=True, stop_token_ids=[text[6]]), (5, 5, 40)),
             (dict(max_tokens=7, ignore_eos=True), (3, 8)),                # the length, mid-step
             (dict(max_tokens=40, ignore_eos=True, stop=["Gr"]), (6, 8, 40))]
    for params, chunks in cases:
        together, alone, whole = (Scheduler(SchedulerConfig(), capacity, tok) for _ in range(3))
        for s in (together, alone, whole):
            s.add_request("r", [5, 6, 7], SamplingParams(**params), streamed=s is not whole)
        a, b, c = together.waiting[0], alone.waiting[0], whole.waiting[0]
        start, taken = 0, []
        for n in chunks:
            taken.append(together._append_tokens(a, text[start:start + n]))
            for token in text[start:start + n]:
                alone._append_tokens(b, [token])
            whole._append_tokens(c, text[start:start + n])
            if not c.finished and "stop" not in params:
                assert c.text == ""   # not decoded while no one reads it
            start += n
        assert a.output_ids == b.output_ids == c.output_ids and sum(taken) == len(a.output_ids)
        assert a.text == b.text == c.text, params
        assert a.finish_reason == b.finish_reason == c.finish_reason is not None, params
