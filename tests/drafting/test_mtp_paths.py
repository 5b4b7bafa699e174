"""The MTP head computes the same rows when trained (no cache, whole sequences) as when it
serves (paged cache, rows arriving in chunks), so a head trained by `metrale train` drafts as trained."""

from __future__ import annotations

import dataclasses

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
