#!/usr/bin/env bash
# The lent GPU's one command (device time is counted from the machine's start, so everything runs in one call):
# installs the carried wheels, then benchmarks/gpu_check.py (every check, its JSON lines and summary under $OUT).
#   here:   bash benchmarks/gpu_wheels.sh
#   device: run(command="bash benchmarks/gpu_session.sh", carry=[".whl"], timeout_s=540)
# Raw results: copy $OUT's checks.jsonl, summary.txt and results.tgz under profiles/gpu/ and commit them.
set -uo pipefail
cd "$(dirname "$0")/.."
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "installing the carried wheels failed"; exit 1; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PATH=/tmp/site/bin:$PATH  # the litgpt command, for the comparison
out=${OUT:-profiles/gpu/session}
python3 benchmarks/gpu_check.py --out "$out" "$@"
