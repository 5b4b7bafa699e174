#!/usr/bin/env bash
# Sets up everything, then generates with the bundled demo model (MTP speculation), on CPU
# when there is no GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
exec metrale generate --prompt $'class Stack:\n    """A last-in, first-out stack."""\n\n    def __init__(self):\n' \
  --max-tokens 64 --speculative-method mtp --dtype float32 "$@"
