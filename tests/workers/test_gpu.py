"""The engine on CUDA with plain PyTorch: same greedy tokens as the float32 reference."""

from __future__ import annotations

import pytest
import torch

import checkpoints
from metrale.cluster.params import SamplingParams
from metrale.deploy.llm import LLM

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name", ["qwen3", "qwen3_5", "qwen3_5-vl"])
def test_cuda_greedy_matches_reference(checkpoint, name):
    model_dir = checkpoint(name)
    llm = LLM(model_dir, device="cuda", dtype="float32", block_size=16, max_num_batched_tokens=9)
    prompts = [llm.encode(p) for p in ["def schedule(self, tokens):", "The café engine", "x"]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=48, temperature=0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == checkpoints.reference_greedy(model_dir, prompt, 48)
    assert llm.worker.kv.k.device.type == "cuda"


def test_cuda_bfloat16_generates(checkpoint):
    llm = LLM(checkpoint("qwen3_5"), device="cuda", dtype="bfloat16")
    out = llm.generate(["def f(x):"], SamplingParams(max_tokens=32, temperature=0.7, seed=1,
                                                     ignore_eos=True))[0]
    assert len(out.token_ids) == 32 and llm.worker.model.lm_head.weight.dtype == torch.bfloat16


def test_to_device_copies_from_the_pinned_ring_arrive_intact():
    """More small copies than the ring has slots, queued behind a long kernel: each arrives with
    its own values (a slot is reused only once the copy that left from it is done)."""
    from metrale.workers.batch import _Staging, to_device
    device = torch.device("cuda", torch.cuda.current_device())
    x = torch.randn(4096, 4096, device=device)
    for _ in range(20):   # keeps the stream busy while the host queues the copies
        x = x @ x / 64
    sent = [to_device([[i, i + 1], [i * 3, -i]], device) for i in range(3 * _Staging.SLOTS)]
    sent.append(to_device(list(range(40000)), device, torch.int32))   # above a slot: pinned anew
    torch.cuda.synchronize()
    for i, t in enumerate(sent[:-1]):
        assert t.tolist() == [[i, i + 1], [i * 3, -i]] and t.dtype == torch.long
    assert sent[-1].tolist() == list(range(40000)) and sent[-1].dtype == torch.int32
