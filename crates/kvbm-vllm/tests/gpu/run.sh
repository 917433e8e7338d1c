#!/usr/bin/env bash
# The GPU check, on the GPU machine: installs the wheels prepare.sh put in .gpu/ (no index is
# reachable there) and runs roundtrip.py. Its JSON goes to $OUT when that is set.
set -euo pipefail
cd "$(dirname "$0")/../../../.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/kvbm-gpu-site .gpu/*.whl
export PYTHONPATH=/tmp/kvbm-gpu-site${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
PYTHONUNBUFFERED=1 exec python3 crates/kvbm-vllm/tests/gpu/roundtrip.py \
  --vllm-src .gpu/vllm-0.33.0 --out "${OUT:-/tmp}/gpu-check.json" "$@"
