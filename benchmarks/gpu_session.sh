#!/usr/bin/env bash
# One lent-GPU session's whole command (device time is counted, so everything runs in one call): the allocator
# snapshot fixture, then the CUDA tests (4 at a time) beside the estimate-accuracy benchmark, each under its own time
# limit; every result lands under profiles/gpu/ and tests/data/cuda_snapshot/, and is packed into $OUT when set.
#   bash benchmarks/gpu_session.sh        (wheels for what the GPU image lacks: see the device notes in profiles/README.md)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fast=/tmp; [ -d /dev/shm ] && fast=/dev/shm
export MEMFIT_TEST_CACHE=$fast/memfit-cache MEMFIT_CACHE=$fast/memfit-cache CHECKPOINTS=$fast/memfit-checkpoints
out=${OUT:-profiles/gpu/logs}
mkdir -p "$MEMFIT_TEST_CACHE" "$CHECKPOINTS" "$out"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc; free -g; df -h "$fast"
  python3 -c "import torch, importlib.metadata as m; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0)); print({p: m.version(p) for p in ('lightning', 'litgpt', 'bitsandbytes', 'jsonargparse', 'plotly', 'matplotlib', 'tensorboard', 'torch-tb-profiler', 'pytest', 'pytest-xdist')})"
} > "$out/env.txt" 2>&1
SECONDS=0
python3 -c "from memfit.embedded import ensure_embedded; ensure_embedded()" > "$out/embedded.log" 2>&1
bash benchmarks/gpu_smoke.sh snapshot > "$out/snapshot.log" 2>&1
echo "setup done at ${SECONDS} s"
(JOBS=4 TEST_TIMEOUT=${TEST_TIMEOUT:-240} timeout "${TESTS_LIMIT:-400}" bash benchmarks/gpu_smoke.sh tests > "$out/tests.log" 2>&1;
 echo "tests ended at ${SECONDS} s, exit $?") &
(timeout "${ESTIMATE_LIMIT:-420}" python3 benchmarks/estimate_accuracy.py --checkpoints "$CHECKPOINTS" --timeout 200 \
   --out profiles/gpu/estimate_accuracy.json > "$out/estimate_accuracy.log" 2>&1;
 echo "estimate accuracy ended at ${SECONDS} s, exit $?") &
wait
python3 benchmarks/resource_table.py >> "$out/tests.log" 2>&1
if [ -n "${OUT:-}" ]; then
  tar czf "$OUT/results.tgz" profiles/gpu profiles/README.md tests/data/cuda_snapshot 2>/dev/null
fi
echo "all done at ${SECONDS} s"
