#!/usr/bin/env bash
# Download into .whl/ (git-ignored) the wheels the GPU image lacks: grain, ml-collections, tokamax
# and the dependencies of theirs the image does not hold (checked against the device tool's package
# list, 2026-11: the image's python3 is 3.12 at /opt/torch/.venv). About 11 MB; carry ".whl" with
# each device call, then `source scripts/gpu_env.sh` there.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
PKGS=(grain==0.2.13 array-record==0.8.6 dm-tree==0.1.10 more-itertools==11.2.1 portpicker==1.6.0
      ml-collections==1.1.0 tokamax==0.0.17 einshape==1.0 pydantic==2.14.4 pydantic-core==2.50.5
      annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0 qwix==0.1.8
      immutabledict==4.3.1 tensorboardx==2.6.5)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl "${PKGS[@]}"
ls .whl
