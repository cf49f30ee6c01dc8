#!/usr/bin/env bash
# Wheels for a lent GPU machine (no network there; python 3.12, jax 0.11 with CUDA 13):
# the packages jaxpage needs that its image lacks, at this environment's versions,
# downloaded into .whl/ (git-ignored), to travel with a device call (`carry: [".whl"]`)
# and be installed there first:
#
#   bash scripts/device_wheels.sh            # here, with the dev venv active
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#       --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit; ...   # there
#
# The list is what the lent H200s lacked (docs/benchmarks/accelerator/*/README.md): the
# server's stack (fastapi, starlette, uvicorn, pydantic and its parts), gguf (the embedded
# model) and llguidance (structured output). One version of each: two stop the install.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
PACKAGES="gguf fastapi starlette uvicorn pydantic pydantic_core annotated-types typing-inspection llguidance"
rm -rf .whl && mkdir -p .whl
for name in $PACKAGES; do
    version=$("$PYTHON" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")
    "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform manylinux_2_24_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 -d .whl "$name==$version"
done
ls .whl
du -sh .whl
