#!/usr/bin/env bash
# Sets up everything on a fresh machine, then runs the test suite (GPU tests skip without a GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
exec python -m pytest "$@"
