"""A PlainText corpus that is one long line, tokenized whole and in pieces (``memfit.training.data.text_pieces``), each
in a process of its own: its peak RSS (ru_maxrss), its seconds, and whether the two give the same number of tokens.

    python benchmarks/long_line_tokenizing.py [--megabytes 89]

One 89 MB line made the tokenizer abort a pretraining run (``memory allocation failed``, exit 134). The corpus is the
embedded default's words drawn at random into one line of that many bytes, tokenized by the embedded tokenizer.
Writes profiles/cpu/long_line_tokenizing.json.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROBE = """
import json, resource, sys, time
from pathlib import Path
from litgpt.tokenizer import Tokenizer
import memfit.training.data as data
tokenizer = Tokenizer(Path(sys.argv[1]))
if sys.argv[3] == "whole":
    data.TOKENIZED_AT_ONCE = 10**12
corpus = data.PlainText(path=Path(sys.argv[2]))
corpus.connect(tokenizer, max_seq_length=255)
start = time.perf_counter()
corpus.setup()
seconds = time.perf_counter() - start
blocks = len(corpus.train_dataset) + len(corpus.val_dataset)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"seconds": seconds, "blocks_of_256": blocks, "peak_rss_bytes": peak}))
"""


def probe(checkpoint_dir: Path, corpus: Path, how: str) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", PROBE, str(checkpoint_dir), str(corpus), how], capture_output=True, text=True
    )
    if result.returncode:
        tail = (result.stderr.strip().splitlines() or ["(nothing on stderr)"])[-1]
        return {"exit_status": result.returncode, "last_line": tail}
    return {"exit_status": 0, **json.loads(result.stdout.strip().splitlines()[-1])}


def main() -> None:
    from memfit.training.embedded import ensure_embedded
    from memfit.training.precision import cpu_description

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megabytes", type=int, default=89)
    args = parser.parse_args()
    checkpoint_dir, json_path = ensure_embedded()
    words = json_path.with_name("corpus.txt").read_text().split()
    rng, size, chosen = random.Random(0), args.megabytes * 10**6, []
    while size > 0:
        chosen.append(rng.choice(words))
        size -= len(chosen[-1]) + 1
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "one_line.txt"
        corpus.write_text(" ".join(chosen))
        pieces = probe(checkpoint_dir, corpus, "pieces")
        whole = probe(checkpoint_dir, corpus, "whole")
    record = {
        "machine": cpu_description(),
        "corpus_bytes": args.megabytes * 10**6,
        "lines": 1,
        "in_pieces": pieces,
        "whole": whole,
    }
    if pieces.get("exit_status") == 0 and whole.get("exit_status") == 0:
        record["peak_rss_pieces_over_whole"] = round(pieces["peak_rss_bytes"] / whole["peak_rss_bytes"], 3)
        record["blocks_pieces_over_whole"] = pieces["blocks_of_256"] / whole["blocks_of_256"]
    out = ROOT / "profiles/cpu/long_line_tokenizing.json"
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
