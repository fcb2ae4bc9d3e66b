#!/usr/bin/env bash
# The lent GPU's two prepared calls, each under 5 minutes of command time (a window of 15 minutes pays a machine
# start of 2-4 minutes per call): call 1 the CUDA tests and the estimate's accuracy, call 2 the benchmarks. Every
# check appends its JSON line to $OUT/checks.jsonl as it ends, so a call cut short still brings back what ended.
#   here:   bash benchmarks/gpu_wheels.sh     (the packages the GPU image lacks, into .whl/)
#   device: run(command="bash benchmarks/gpu_session.sh 1", carry=[".whl"], timeout_s=300), then the same with 2
#   CPU:    python benchmarks/gpu_check.py --call 1 --rehearse   (the same plumbing, CPU-sized)
# Raw results: copy $OUT's files under profiles/gpu/<card>/<commit>-call<N>/ and commit them.
set -uo pipefail
cd "$(dirname "$0")/.."
call=${1:-}
if [[ "$call" != 1 && "$call" != 2 ]]; then
  echo "usage: bash benchmarks/gpu_session.sh 1|2 (1: the CUDA tests and the estimate's accuracy; 2: the benchmarks)"
  exit 2
fi
if ! command -v nvidia-smi > /dev/null || ! nvidia-smi -L > /dev/null 2>&1; then
  echo "benchmarks/gpu_session.sh needs an NVIDIA GPU (nvidia-smi finds none); on a CPU rehearse it:" \
    "python benchmarks/gpu_check.py --call $call --rehearse"
  exit 1
fi
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "installing the carried wheels failed"; exit 1; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PATH=/tmp/site/bin:$PATH  # the litgpt command, for the comparison
out=${OUT:-profiles/gpu/session}
python3 benchmarks/gpu_check.py --call "$call" --out "$out" "${@:2}"
