"""The MTP head computes the same rows when trained (no cache, whole sequences) as when it
serves (paged cache, rows arriving in chunks), so a head trained by `metrale train` drafts as trained."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import torch

from metrale.drafting.mtp import MTPHead
from metrale.workers.batch import ForwardBatch
from metrale.workers.kv_cache import PagedKVCache
from metrale.workers.models import ModelConfig
from metrale.workers.models.layers import Rotary


def test_training_and_serving_paths_agree(checkpoint):
    cfg = dataclasses.replace(ModelConfig.from_dir(checkpoint("qwen3_5")), mtp_num_hidden_layers=1)
    torch.manual_seed(0)
    head = MTPHead(cfg).eval()
    embed = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size)
    rotary = Rotary(cfg.rotary_dim, cfg.rope_theta)
    tokens = torch.randint(0, cfg.vocab_size, (23,))
    hidden = torch.randn(23, cfg.hidden_size)
    with torch.no_grad():
        whole = ForwardBatch.build([(tokens.tolist(), 0, [0], -1)], 23, torch.device("cpu"))
        trained = head(embed, rotary, tokens, hidden, whole, None)
        kv = PagedKVCache(1, 8, 4, cfg.num_key_value_heads, cfg.head_dim, cfg.dtype, "cpu")
        served = []
        for start, end in ((0, 9), (9, 10), (10, 23)):
            chunk = ForwardBatch.build([(tokens[start:end].tolist(), start, list(range(8)), -1)],
                                       4, torch.device("cpu"))
            served.append(head(embed, rotary, chunk.input_ids, hidden[start:end], chunk, kv))
    torch.testing.assert_close(torch.cat(served), trained, atol=1e-5, rtol=1e-4)


def test_mtp_graphs_send_block_tables_only_when_they_change(checkpoint, monkeypatch):
    """A round's catch-up and drafts mostly read the same block tables: the second is not sent
    again. Tables that differ (a block added, another bucket) are sent, and so is everything
    after a capture, which points the static tables at the spare block."""
    from metrale.deploy.llm import LLM
    from metrale.drafting import mtp
    llm = LLM(checkpoint("qwen3_5"), device="cpu", speculative_method="mtp", num_drafts=3)
    spare = llm.worker.kv.num_blocks - 1
    graphs = mtp.MTPGraphs(llm.worker.proposer, 4, spare)
    sent = []
    real = mtp.to_device
    monkeypatch.setattr(mtp, "to_device", lambda *a, **kw: sent.append(1) or real(*a, **kw))

    def check(tables, bucket, copies):
        graphs._tables(tables, bucket)
        assert len(sent) == copies
        width = max(map(len, tables))
        expect = [t + [spare] * (width - len(t)) for t in tables] + [[spare] * width] * (
            bucket - len(tables))
        assert graphs.tables[:bucket, :width].tolist() == expect
        assert (graphs.tables[:bucket, width:] == spare).all()
    a = [[3, 5], [7]]
    check(a, 2, 1)
    check([list(t) for t in a], 2, 1)          # equal tables: not sent
    a[1].append(9)                              # the caller's lists change after a send
    check(a, 2, 2)
    check(a, 4, 3)                              # another bucket
    check(a, 4, 3)
    # a capture points them at the spare block (the step itself is not run here)
    monkeypatch.setattr(mtp, "capture", lambda step, pool: (SimpleNamespace(pool=lambda: None),
                                                            (None, None)))
    for capture in (lambda: graphs._capture(4, 2), lambda: graphs._capture_catch_up(4, 1)):
        copies = len(sent)
        capture()
        assert (graphs.tables[:4] == spare).all()
        check(a, 4, copies + 1)
