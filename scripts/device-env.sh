#!/usr/bin/env bash
# Sourced on the GPU machine (no package registry there): makes metrale importable from this tree
# without installing it, and adds the staged wheels (see ../shared/GPU.md) when present.
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
mkdir -p /tmp/metrale-src/metrale
for d in cluster workers drafting deploy; do ln -sfn "$root/$d" "/tmp/metrale-src/metrale/$d"; done
export PYTHONPATH="/tmp/metrale-src:$root/tests${PYTHONPATH:+:$PYTHONPATH}"
[ -d /root/site ] && export PYTHONPATH="$PYTHONPATH:/root/site"
export PATH=/opt/torch/.venv/bin:$PATH
