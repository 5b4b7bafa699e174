"""Start-up cost of the bundled engine per method: seconds to build it (weights, KV cache, CUDA
graphs captured at start), GPU memory reserved by it, and the graphs it holds. The worker's
log lines give the capture times of the step graphs and of the chained-round graphs.

    cd scripts && python3 captime.py ngram:a3 mtp:a3 dflash:a7     # METHOD:DRAFTS, as stepprof
"""
import logging
import sys
import time

import torch

from stepprof import engine   # this script's folder is on the path

logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
for spec in sys.argv[1:]:
    method, drafts = spec.split(":")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_reserved()
    start = time.perf_counter()
    llm = engine(method, drafts)
    torch.cuda.synchronize()
    worker = llm.worker
    chained = len(worker.chain.graphs_by_shape) if worker.chain is not None else 0
    print(f"{spec}: start {time.perf_counter() - start:.1f} s, reserved "
          f"+{(torch.cuda.memory_reserved() - base) / 2**20:.0f} MiB, step graphs "
          f"{len(worker.graphs.graphs) if worker.graphs is not None else 0}, chained shapes "
          f"{chained}, KV cache {worker.memory_report()['kv_cache_bytes'] / 2**20:.0f} MiB", flush=True)
    llm.close()
    del llm, worker
