#!/usr/bin/env bash
# Sets up everything, then serves the bundled demo model (MTP speculation) as an OpenAI-compatible
# endpoint on http://127.0.0.1:8000/v1 through Ray Serve, on CPU when there is no GPU. Ctrl-C stops it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
exec metrale serve --speculative-method mtp "$@"
