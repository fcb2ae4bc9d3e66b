"""Keeps the `# Memory:` line of each recipe in recipes/ equal to what --estimate predicts for it on CUDA.

    python benchmarks/recipe_headers.py            # rewrites every header that changed
    python benchmarks/recipe_headers.py --check    # lists the stale ones, exit 1 if any (nothing written)
    python benchmarks/recipe_headers.py --only tinyllama-1.1b/lora

Each recipe is estimated as its reader would estimate it before launch, on a machine without its weights or data:
`python SCRIPT --config RECIPE --estimate true --accelerator cuda` in an empty directory. The script then notes that
the checkpoint dir and the data file are not there, takes the architecture from litgpt's table by the dir's name, and
assumes samples of --train.max_seq_length, which every recipe sets. A change to the estimate changes the headers: run
this after one.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MEMORY_LINE = re.compile(r"^# Memory:.*$", re.M)


def header(recipe: Path) -> str:
    """The `# Memory:` line --estimate gives the recipe today."""
    script = re.search(r"^# Run:\s+python (\S+) --config", recipe.read_text(), re.M).group(1)
    with tempfile.TemporaryDirectory() as scratch:  # nothing the recipe names is there; the picture goes there
        result = subprocess.run(
            [
                sys.executable,
                str(ROOT / script),
                "--config",
                str(recipe),
                "--estimate",
                "true",
                "--accelerator",
                "cuda",
            ],
            capture_output=True,
            text=True,
            timeout=900,
            cwd=scratch,
        )
    if result.returncode != 0:
        raise SystemExit(f"{recipe}: --estimate failed:\n{result.stderr[-2000:]}")
    for note in re.findall(r"^note: .*$", result.stdout, re.M):
        print(f"{recipe.relative_to(ROOT)}: {note}")
    peak, phase = re.search(r"Predicted peak: (\S+ \S+) in (\w+)", result.stdout).groups()
    tokens = re.search(r", (\d+) tokens per sample", result.stdout).group(1)
    return (
        f"# Memory:   {peak} per GPU predicted by --estimate (max_memory_allocated, peak in {phase},"
        f" {tokens}-token samples); not measured"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="list stale headers and exit 1 if any; write nothing")
    parser.add_argument("--only", nargs="*", help="recipes as <model>/<name>, e.g. tinyllama-1.1b/lora")
    args = parser.parse_args()
    recipes = sorted((ROOT / "recipes").glob("*/*.yaml"))
    if args.only:
        recipes = [r for r in recipes if f"{r.parent.name}/{r.stem}" in args.only]
    stale = []
    for recipe in recipes:
        text = recipe.read_text()
        old, new = MEMORY_LINE.search(text).group(0), header(recipe)
        if old != new:
            stale.append(recipe)
            print(f"{recipe.relative_to(ROOT)}:\n  was {old}\n  now {new}")
            if not args.check:
                recipe.write_text(MEMORY_LINE.sub(new, text, count=1))
    print(f"{len(stale)} of {len(recipes)} headers {'stale' if args.check else 'rewritten'}")
    if args.check and stale:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
