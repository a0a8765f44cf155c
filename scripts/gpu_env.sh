# Sourced at the start of a device call (GPU image; run from the repository root, with .whl carried):
# installs the wheels of scripts/gpu_wheels.sh into /tmp/site once per machine, puts `python` /
# `python3` wrappers for the image's venv first on PATH (a symlink would lose the venv: Python finds
# pyvenv.cfg next to the path it was started by), and exports PYTHONPATH and CONDATTN_GIT_COMMIT
# (from ./COMMIT when the tree is a `git archive` copy, else from git).
PYBIN=/opt/torch/.venv/bin/python3
[ -x "$PYBIN" ] || PYBIN=$(command -v python3)
mkdir -p /tmp/site /tmp/bin
if [ ! -e /tmp/site/.ok ]; then
  "$PYBIN" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && touch /tmp/site/.ok
fi
printf '#!/bin/sh\nexec %s "$@"\n' "$PYBIN" > /tmp/bin/python
chmod +x /tmp/bin/python && cp /tmp/bin/python /tmp/bin/python3
export PATH=/tmp/bin:$PATH PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
export CONDATTN_GIT_COMMIT=${CONDATTN_GIT_COMMIT:-$(cat COMMIT 2>/dev/null || git rev-parse --short HEAD)}
