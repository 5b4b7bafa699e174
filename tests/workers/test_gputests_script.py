"""scripts/gputests.sh, which runs the GPU tests in shards within a device call's time, accounts for
every test: one that failed, and one that a shard stopped at its time limit never ran, are named,
and either makes it exit non-zero."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gputests.sh"


def gputests(tree: Path, cases: str, **env) -> subprocess.CompletedProcess:
    """Runs the script as if `tree` were the repository (its pytest root), over `cases`, the
    test file's text."""
    (tree / "scripts").mkdir()
    shutil.copy(SCRIPT, tree / "scripts")
    (tree / "pyproject.toml").write_text("[tool.pytest.ini_options]\n")
    (tree / "cases").mkdir()
    (tree / "cases" / "test_cases.py").write_text(cases)
    return subprocess.run(["bash", str(tree / "scripts" / "gputests.sh"), str(tree / "logs"),
                           "cases"], env={**os.environ, "PYTHON": sys.executable, **env},
                          capture_output=True, text=True, timeout=120)


def test_a_shard_stopped_at_its_limit_names_the_tests_it_did_not_run(tmp_path):
    run = gputests(
        tmp_path,
        "import time, pytest\n"
        "def test_ok(): pass\n"
        "def test_bad(): assert 1 == 2\n"
        "def test_skipped(): pytest.skip('no device')\n"
        "@pytest.mark.parametrize('n', [1, 2])\n"
        "def test_param(n): pass\n"
        "def test_slow(): time.sleep(120)\n"
        "def test_after_slow(): pass\n", SHARDS="2", LIMIT="8")
    assert run.returncode != 0, run.stdout + run.stderr
    outcomes = dict(reversed(line.split(" ", 1)) for line in
                    (tmp_path / "logs" / "outcomes").read_text().splitlines())
    name = {i.rsplit("::", 1)[1]: o for i, o in outcomes.items()}
    # shard 0 takes tests 1, 3, 5, 7 (ok, skipped, param[2], after_slow); shard 1 the others,
    # and stops inside test_slow
    assert name == {"test_ok": "PASSED", "test_bad": "FAILED", "test_skipped": "SKIPPED",
                    "test_param[1]": "PASSED", "test_param[2]": "PASSED",
                    "test_slow": "NOT-REACHED", "test_after_slow": "PASSED"}
    assert "4 passed, 1 failed, 1 skipped, 1 not reached (of 7)" in run.stdout
    assert "  FAILED " in run.stdout and "test_bad" in run.stdout
    assert "  NOT-REACHED " in run.stdout and "test_slow" in run.stdout


def test_every_test_passing_or_skipped_exits_zero(tmp_path):
    run = gputests(tmp_path, "import pytest\n"
                             "def test_ok(): pass\n"
                             "def test_skipped(): pytest.skip('no device')\n", SHARDS="3")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "1 passed, 0 failed, 1 skipped, 0 not reached (of 2)" in run.stdout
