"""What Memfit's layout of bitsandbytes' 4-bit backward on a CPU buys: the README's QLoRA run with it and with
bitsandbytes' own backward, alternated in one run.

    python benchmarks/bnb_cpu_backward.py --pairs 2 --steps 20

``memfit.training.bitsandbytes_layers`` multiplies a transposed copy of each dequantized weight in a 16-bit backward on
a CPU, where bitsandbytes' ``torch.matmul(grad, W)`` takes torch's slow bfloat16 path on CPUs without native bfloat16.
"Own" runs the same script with bitsandbytes' backward put back before the script starts. Each run is a fresh process on
the embedded default (``--precision bf16-true --quantize bnb.nf4``, the profiler window off); the figures are its
training tokens/s (the run's own line) and its CPU time, and each back-to-back pair's ratio.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from memfit.training.precision import cpu_description  # noqa: E402  (after the path)

OWN_BACKWARD = """
import runpy, sys
from memfit.training.bitsandbytes_layers import import_bitsandbytes
matmul_4bit = import_bitsandbytes().autograd._functions.MatMul4Bit
matmul_4bit.backward = staticmethod(matmul_4bit._memfit_own_backward)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def one_run(own: bool, steps: int, work: Path) -> dict:
    """The run's training tokens/s and its summary line."""
    work.mkdir(parents=True)
    script = [str(ROOT / "finetune/lora.py"), "--precision", "bf16-true", "--quantize", "bnb.nf4"]
    script += ["--train.max_steps", str(steps), "--profile.enabled", "false"]
    command = [sys.executable, "-c", OWN_BACKWARD, *script] if own else [sys.executable, *script]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    process = subprocess.Popen(command, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stdout, stderr = process.communicate()
    if process.returncode != 0:
        raise SystemExit(f"the run failed: {stderr[-2000:]}")
    done = next(line for line in stdout.splitlines() if line.startswith("Done:"))
    tokens = float(re.search(r"([\d,]+) tokens/s", done).group(1).replace(",", ""))
    return {"tokens_per_s": tokens, "done": done}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    print(cpu_description())
    ratios = []
    with tempfile.TemporaryDirectory() as tmp:
        for pair in range(args.pairs):
            runs = {}
            for own in (pair % 2 == 1, pair % 2 == 0):  # alternated: each side goes first in every other pair
                start = os.times()
                runs[own] = one_run(own, args.steps, Path(tmp) / f"{pair}-{'own' if own else 'memfit'}")
                end = os.times()
                runs[own]["cpu_s"] = (end.children_user - start.children_user) + (
                    end.children_system - start.children_system
                )
            ratio = runs[False]["tokens_per_s"] / runs[True]["tokens_per_s"]
            ratios.append(ratio)
            print(
                f"pair {pair + 1}: Memfit's layout {runs[False]['tokens_per_s']:,.0f} tokens/s"
                f" ({runs[False]['cpu_s']:.1f} s CPU), bitsandbytes' own {runs[True]['tokens_per_s']:,.0f} tokens/s"
                f" ({runs[True]['cpu_s']:.1f} s CPU): x{ratio:.2f} the tokens/s"
            )
            print(f"  Memfit: {runs[False]['done']}\n  own:    {runs[True]['done']}")
    print(
        f"median x{statistics.median(ratios):.2f} the training tokens/s over {args.pairs} pairs of {args.steps} steps"
    )


if __name__ == "__main__":
    main()
