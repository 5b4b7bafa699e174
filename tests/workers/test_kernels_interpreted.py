"""The chained round's kernels compute what their tensor ops do, and few_rows (its row tiles
included) what F.linear does, in CI too: without a GPU,
test_kernels.py runs only under TRITON_INTERPRET=1 (read when the kernels are defined, so at
import), which the suite's own process does not set. This runs those cases in a process that
does. (test_kernel_builds.py checks they build for the GPU.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from metrale.workers.models import kernels

ROOT = Path(__file__).resolve().parents[2]
# 4 + 3 + 3 cases, and few_rows' 8 in float32 (the interpreter mishandles bfloat16)
CASES = "ngram_lookup or bookkeeping or (few_rows_is and dtype0)"


@pytest.mark.skipif(not kernels.available(), reason="triton is not installed")
def test_the_chain_kernels_match_their_references_under_the_interpreter():
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         str(ROOT / "tests" / "workers" / "test_kernels.py"), "-k", CASES],
        env={**os.environ, "TRITON_INTERPRET": "1"}, cwd=ROOT, capture_output=True, text=True,
        timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "18 passed" in run.stdout and "skipped" not in run.stdout.splitlines()[-1]
