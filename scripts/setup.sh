#!/usr/bin/env bash
# Creates .venv and installs metrale with its test extras; quick when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  "${PYTHON:-python3}" -m venv .venv
fi
. .venv/bin/activate
stamp=.venv/.metrale-installed
want=$(cat pyproject.toml | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  python -m pip install -q --upgrade pip
  # Pinned first: an unpinned torch would pull a multi-GB CUDA build; this one is the CPU build.
  python -c "import torch" 2>/dev/null || python -m pip install -q torch==2.13.0
  python -m pip install -q -e ".[test]"
  echo "$want" > "$stamp"
fi
