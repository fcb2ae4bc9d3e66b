"""What a bitsandbytes 4-bit head costs the chunked loss (``memfit.training.loss``): each chunk of tokens dequantizes
the whole head for its logits, and again for its gradient with respect to the hidden states, one dequantized copy at a
time. Both sides timed in one run on this machine: the dequantization of the head, and one chunk's matmul with it.

    python benchmarks/bnb_head_dequantize.py --out profiles/cpu/bnb_head_dequantize.json

Float32 on CPU (16-bit matmuls are emulated on CPUs without AVX512-BF16); a GPU's ratio differs and is not measured
here. Best of 3 of each.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from memfit.training.bitsandbytes_layers import import_bitsandbytes  # noqa: E402
from memfit.training.loss import rows_per_chunk  # noqa: E402

HEADS = {"Llama-2 (32,000 x 4,096)": (32000, 4096), "Llama-3 (128,256 x 4,096)": (128256, 4096)}
TOKENS = 4 * 2048
"""A micro-batch of 4 x 2048 tokens"""


def best_of(function, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        function()
        times.append(time.perf_counter() - started)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=ROOT / "profiles/cpu/bnb_head_dequantize.json")
    args = parser.parse_args()
    import_bitsandbytes()
    import bitsandbytes.functional as F

    torch.manual_seed(0)
    rows = []
    for name, (vocab, width) in HEADS.items():
        weight = torch.randn(vocab, width) * 0.02
        packed, state = F.quantize_4bit(weight, quant_type="nf4")
        chunk = rows_per_chunk(TOKENS, width, vocab)
        hidden = torch.randn(chunk, width)
        dequantize = best_of(lambda: F.dequantize_4bit(packed, state, quant_type="nf4"))
        dequantized = F.dequantize_4bit(packed, state, quant_type="nf4")
        matmul = best_of(lambda: hidden @ dequantized.t())  # (chunk, vocab): one chunk's logits
        rows.append(
            {
                "head": name,
                "chunk_rows": chunk,
                "chunks_per_micro_batch": -(-TOKENS // chunk),
                "dequantize_s": round(dequantize, 3),
                "chunk_matmul_s": round(matmul, 3),
                "dequantize_over_matmul": round(dequantize / matmul, 3),
                "dequantized_bytes_bf16": vocab * width * 2,
            }
        )
        print(f"{name}: dequantize {dequantize:.2f} s, a chunk's matmul ({chunk} rows) {matmul:.2f} s")
    record = {
        "what": "bitsandbytes nf4 head: dequantization against one chunk's matmul, float32, best of 3",
        "command": "python benchmarks/bnb_head_dequantize.py",
        "machine": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
