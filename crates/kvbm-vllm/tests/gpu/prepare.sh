#!/usr/bin/env bash
# Collects what the GPU check (roundtrip.py) needs on a machine that has CUDA and torch but
# neither vLLM nor kvbm, into .gpu/ at the repository root (git-ignored through
# .git/info/exclude): kvbm_vllm's wheel, built now; msgspec for the device's Python 3.12
# (vLLM's kv_offload imports it); vLLM 0.33.0's extracted sources (the CPU harness's
# fetch, pinned by sha256).
#
# Then, on the GPU machine, with .gpu carried: bash crates/kvbm-vllm/tests/gpu/run.sh
set -euo pipefail
cd "$(dirname "$0")/../../../.."
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
rm -rf .gpu && mkdir -p .gpu
python3 -m maturin --version > /dev/null 2>&1 || python3 -m pip install -q maturin
(cd crates/kvbm-vllm && python3 -m maturin build --release -i python3 -o ../../.gpu)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .gpu msgspec==0.21.1
python3 - <<'PY'
import os, sys
sys.path.insert(0, "crates/kvbm-vllm/tests/upstream")
import fetch
cache = os.path.join("target", "peer", "vllm-sdist")
v = fetch.DEFAULT_VERSION  # run.sh's --vllm-src names this version's extraction
fetch.extract(fetch.fetch_sdist(cache, version=v), os.path.join(".gpu", "vllm-" + v), version=v)
PY
du -sh .gpu
