"""Where a decode step's time goes on the GPU: copy bandwidth, cuBLAS GEMV bandwidth at the
Qwen3-8B projection shapes, then for 8-layer Qwen3-8B- and Qwen3.5-2B-shaped random checkpoints
the forward at batch 1 and 8 with and without CUDA graphs, the host's share (batch build, graph
buffer fill) against the replay's device time, and torch.profiler's kernel table of the eager
step. On the GPU machine: `source scripts/device-env.sh && python3 scripts/gpuprof.py`."""
import statistics, time
from pathlib import Path
import torch
import torch.nn.functional as F
from metrale.deploy.random_checkpoint import QWEN3_8B, QWEN3_5_2B, write_random_checkpoint
from metrale.deploy.llm import LLM
from metrale.workers.batch import RowsLayout

dev = torch.device("cuda")

def cuda_ms(fn, iters=50):
    for _ in range(5): fn()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(); s.record()
    for _ in range(iters): fn()
    e.record(); torch.cuda.synchronize()
    return s.elapsed_time(e) / iters

def copy_bw():
    a = torch.empty(1 << 30, dtype=torch.uint8, device=dev); b = torch.empty_like(a)
    ms = cuda_ms(lambda: b.copy_(a), 10)
    return 2 * a.numel() / ms / 1e6   # GB/s (read + write)

print("copy GB/s", round(copy_bw()))
for n, k in [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288), (151936, 4096), (8192, 2048)]:
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16); x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    ms = cuda_ms(lambda: F.linear(x, w), 200)
    print(f"gemv {n}x{k}: {ms*1000:.1f} us, {n*k*2/ms/1e6:.0f} GB/s")

def profile(name, shape):
    d = write_random_checkpoint(Path(f"/tmp/ck-{name}"), shape, "cuda")
    for graphs in (True, False):
        llm = LLM(d, device="cuda", dtype="bfloat16", max_num_seqs=8, kv_cache_bytes=2 << 30,
                  speculative_method="ngram", max_drafts=15, cuda_graphs=graphs, capture_at_start=False)
        w = llm.worker
        t = w.time_forward(1, 1, 512, 30)
        print(f"{name} graphs={graphs} time_forward B=1 {t:.3f} ms; B=8 {w.time_forward(8,1,512,30):.3f} ms")
        bs = w.config.block_size
        chunks = [([1], 512, list(range(33)), 0, False)]
        host = []
        for _ in range(50):
            s = time.perf_counter(); b = RowsLayout.of(chunks, bs); host.append(time.perf_counter() - s)
        print(f"  layout host {statistics.median(host)*1e3:.3f} ms")
        b = RowsLayout.of(chunks, bs)
        if graphs:
            g = w.graphs
            key = (1, 1, False)
            graph = g.graphs[key][0]
            print(f"  replay GPU {cuda_ms(graph.replay, 50):.3f} ms")
            hs = []
            for _ in range(50):
                torch.cuda.synchronize(); s = time.perf_counter(); g._fill(b, 1, 1); torch.cuda.synchronize(); hs.append(time.perf_counter()-s)
            print(f"  fill host+gpu {statistics.median(hs)*1e3:.3f} ms")
            rs = []
            for _ in range(50):
                torch.cuda.synchronize(); s = time.perf_counter(); out = g.run(b); out[2].argmax(-1).tolist(); rs.append(time.perf_counter()-s)
            print(f"  run+argmax wall {statistics.median(rs)*1e3:.3f} ms")
        else:
            from torch.profiler import profile as prof, ProfilerActivity
            for _ in range(3): w._forward(b)
            torch.cuda.synchronize()
            with prof(activities=[ProfilerActivity.CUDA]) as p:
                for _ in range(5):
                    h, c, lg = w._forward(b)
                    if lg is None: w.model.logits(h)
                torch.cuda.synchronize()
            print(p.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70))
        del llm, w; torch.cuda.empty_cache()

profile("8b8", dict(QWEN3_8B, num_hidden_layers=8))
profile("2b8", dict(QWEN3_5_2B, num_hidden_layers=8))
