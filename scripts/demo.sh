#!/usr/bin/env bash
# Sets up everything, builds a tiny Qwen3.5 checkpoint if none exists, and generates from it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
model=${METRALE_DEMO_MODEL:-.cache/demo-qwen3_5}
[ -f "$model/config.json" ] || python tests/checkpoints.py "$model" --arch qwen3_5
exec metrale generate --model "$model" --prompt "def fibonacci(n):" --prompt "Hello" \
  --max-tokens 32 --temperature 0.8 --seed 0 "$@"
