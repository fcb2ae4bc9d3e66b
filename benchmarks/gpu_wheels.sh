#!/usr/bin/env bash
# Downloads benchmarks/gpu_wheels.txt into .whl/ (git-ignored) for the lent GPU's Python (3.12, x86-64 Linux), where
# nothing can be downloaded: run it here, then carry .whl with the call; benchmarks/gpu_session.sh installs them.
# About 55 MB: with the repository it stays under the 64 MiB a call carries.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl && mkdir .whl
grep -v '^#' benchmarks/gpu_wheels.txt | xargs python3 -m pip download --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux1_x86_64 --platform any -d .whl
du -sh .whl
