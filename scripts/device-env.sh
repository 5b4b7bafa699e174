#!/usr/bin/env bash
# Sourced on the GPU machine (no package registry there): makes metrale importable from this tree
# without installing it, and adds the staged wheels (see ../shared/GPU.md) when present. Wheels
# carried in .fla-wheels (flash-linear-attention, downloaded on a machine with a registry:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12
#     --implementation cp -d .fla-wheels fla-core==0.6.0 flash-linear-attention==0.6.0)
# are installed into the staged site first, once a machine.
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
site=${METRALE_SITE:-/root/site}
export PATH=/opt/torch/.venv/bin:$PATH
if compgen -G "$root/.fla-wheels/*.whl" > /dev/null && [ ! -d "$site/fla" ]; then
    python3 -m pip install -q --no-deps --no-index --target "$site" "$root"/.fla-wheels/*.whl
fi
mkdir -p /tmp/metrale-src/metrale
for d in cluster workers drafting deploy; do ln -sfn "$root/$d" "/tmp/metrale-src/metrale/$d"; done
export PYTHONPATH="/tmp/metrale-src:$root/tests${PYTHONPATH:+:$PYTHONPATH}"
[ -d "$site" ] && export PYTHONPATH="$PYTHONPATH:$site"
