#!/usr/bin/env bash
# The GPU runner's one command: every recipe under `pytest -m cuda`, then the GPU benchmarks; raw results (JSON with
# device, versions, command and figures) under profiles/gpu/, then the resource table.
#   bash benchmarks/gpu_smoke.sh            # everything (about an hour on one H100)
#   QUICK=1 bash benchmarks/gpu_smoke.sh    # the tests and one configuration of each benchmark
# Keeps going when a step fails, and exits non-zero at the end if any did.
set -uo pipefail
cd "$(dirname "$0")/.."
mkdir -p profiles/gpu
failed=0
step() { echo "== $*"; "$@" || { echo "FAILED: $*"; failed=1; }; }

step python -m pytest -m cuda -ra -p no:cacheprovider --junitxml=profiles/gpu/pytest_cuda.xml
if [ -n "${QUICK:-}" ]; then
  step python benchmarks/estimate_accuracy.py --only qlora-7b-512 --out profiles/gpu/estimate_accuracy.json
  step python benchmarks/loading.py --device cuda --model Llama-2-7b-hf --repeats 1 --out profiles/gpu/loading.json
  step python benchmarks/compare_litgpt.py --device cuda --repeats 1 --steps 10 --only 0 8 \
    --out profiles/gpu/compare_litgpt.json
else
  step python benchmarks/estimate_accuracy.py --out profiles/gpu/estimate_accuracy.json
  step python benchmarks/loading.py --device cuda --model Llama-2-7b-hf --repeats 2 --out profiles/gpu/loading.json
  step python benchmarks/compare_litgpt.py --device cuda --repeats 2 --steps 10 --out profiles/gpu/compare_litgpt.json
fi
step python benchmarks/resource_table.py
exit $failed
