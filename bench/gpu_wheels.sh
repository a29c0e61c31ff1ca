#!/usr/bin/env bash
# Wheels an offline GPU machine lacks for bench/gpu_check.py, into .whl/ (ignored by git).
# The device image has Python 3.12 with torch, timm, transformers, accelerate, einops, pytest;
# this adds deepspeed (built here: PyPI has only its source) with what it needs, and
# webdataset (about 5 MB; the pretrained-weight wheels are too large to carry, and the
# check's throughput rows use the same architectures with random weights). On the GPU
# machine, from the repository root:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
#   PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 python3 bench/gpu_check.py
set -euo pipefail
cd "$(dirname "$0")/.."
PIP=".venv/bin/python -m pip"
mkdir -p .whl
grep -qxF '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
platforms=(--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
           --platform manylinux_2_28_x86_64)
# pure-Python wheels and the compiled one (pydantic-core) for CPython 3.12
$PIP download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d .whl \
    webdataset==1.0.2 braceexpand==0.1.7 hjson==3.1.0 pydantic==2.14.4 pydantic-core==2.50.5 \
    annotated-types==0.8.0 typing-inspection==0.4.5
# deepspeed ships as source only: build its pure-Python wheel (no ops compiled ahead)
DS_BUILD_OPS=0 $PIP wheel --quiet --no-deps --no-build-isolation -w .whl deepspeed==0.19.8
ls -la .whl
du -sh .whl
