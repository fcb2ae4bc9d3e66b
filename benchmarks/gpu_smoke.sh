#!/usr/bin/env bash
# The GPU runner's one command: every recipe under `pytest -m cuda`, then the GPU benchmarks; raw results (JSON with
# device, versions, command and figures) under profiles/gpu/, then the resource table.
#   bash benchmarks/gpu_smoke.sh                   # everything (not yet timed end to end)
#   QUICK=1 bash benchmarks/gpu_smoke.sh           # the tests and one configuration of each benchmark
#   bash benchmarks/gpu_smoke.sh tests             # some parts only: tests, estimate, loading, compare, snapshot
#   JOBS=4 bash benchmarks/gpu_smoke.sh tests      # four tests at a time (each measures its own process's memory)
# The CUDA tests took ~45 s each on an H100 one at a time (13 of them, about 10 minutes; 14 now): where a command may
# run for 10 minutes at most, run them several at a time (JOBS) or the parts in separate commands (CHECKPOINTS=<dir>
# shares the random checkpoints between them). TEST_TIMEOUT stops one test (pytest-timeout) after that many seconds.
# Keeps going when a step fails, and exits non-zero at the end if any did; a benchmark process that runs past its
# --timeout is stopped and reported as failed.
set -uo pipefail
cd "$(dirname "$0")/.."
mkdir -p profiles/gpu
# Random-weight checkpoints (1.1B: 2.2 GB, 7B: 13.5 GB), one per architecture, written once and shared by the
# benchmarks. In memory (/dev/shm) where there is one: on the lent H100 torch.save wrote 2.2 GB to /tmp's disk in over
# a minute, and four pytest-xdist workers writing theirs at once stalled every test for over five minutes.
fast=/tmp; [ -d /dev/shm ] && fast=/dev/shm
checkpoints=${CHECKPOINTS:-$(mktemp -d -p "$fast")}
parts=" ${*:-snapshot tests estimate loading compare} "
for part in $parts; do
  case $part in tests|estimate|loading|compare|snapshot) ;;
    *) echo "error: unknown part '$part': choose from tests, estimate, loading, compare, snapshot" >&2; exit 2 ;;
  esac
done
failed=0
step() { echo "== $*"; "$@" || { echo "FAILED: $*"; failed=1; }; }
wants() { [[ $parts == *" $1 "* ]]; }

if wants snapshot; then
  step python benchmarks/cuda_snapshot_fixture.py --out tests/data/cuda_snapshot
fi
if wants tests; then
  # The random checkpoint is written once, before the workers start, and every worker reads it
  step python -c "import sys; from memfit.embedded import random_checkpoint; random_checkpoint(sys.argv[1], sys.argv[2])" \
    TinyLlama-1.1B-intermediate-step-1431k-3T "$checkpoints"
  # each test's runs are processes of their own, and each measures its own process's memory on the one GPU: several
  # at a time (JOBS, pytest-xdist's plain load distribution) measure what one at a time does
  tests_cmd="python -m pytest -m cuda -n ${JOBS:-0} --dist load -v -ra -p no:cacheprovider --basetemp=$fast/memfit-pytest"
  [ -n "${TEST_TIMEOUT:-}" ] && tests_cmd="$tests_cmd --timeout $TEST_TIMEOUT"
  MEMFIT_TEST_CHECKPOINTS="$checkpoints" step $tests_cmd --junitxml=profiles/gpu/pytest_cuda.xml
  step python benchmarks/cuda_tests_json.py profiles/gpu/pytest_cuda.xml --tmp "$fast" --command "$tests_cmd"
fi
if [ -n "${QUICK:-}" ]; then
  wants estimate && step python benchmarks/estimate_accuracy.py --only qlora-7b-512 full-1.1b --checkpoints "$checkpoints" \
    --out profiles/gpu/estimate_accuracy.json
  wants loading && step python benchmarks/loading.py --device cuda --model Llama-2-7b-hf --repeats 1 \
    --checkpoints "$checkpoints" --out profiles/gpu/loading.json
  wants compare && step python benchmarks/compare_litgpt.py --device cuda --repeats 1 --steps 10 --only 0 8 \
    --checkpoints "$checkpoints" --out profiles/gpu/compare_litgpt.json
else
  wants estimate && step python benchmarks/estimate_accuracy.py --checkpoints "$checkpoints" \
    --out profiles/gpu/estimate_accuracy.json
  wants loading && step python benchmarks/loading.py --device cuda --model Llama-2-7b-hf --repeats 2 \
    --checkpoints "$checkpoints" --out profiles/gpu/loading.json
  wants compare && step python benchmarks/compare_litgpt.py --device cuda --repeats 2 --steps 10 \
    --checkpoints "$checkpoints" --out profiles/gpu/compare_litgpt.json
fi
step python benchmarks/resource_table.py
exit $failed
