"""Why a peak Memfit predicts for its own run differs from a figure in litgpt's or torchtune's tables: each difference
Memfit can run or model, as two estimates of the same settings, one as Memfit runs them and one as the other tool ran
them, and the size between them.

    python benchmarks/published_differences.py     # writes profiles/published/differences.json

Every figure is ``--estimate``'s prediction of ``max_memory_allocated`` on a GPU, made on a CPU from the model's name
(no weights); the rows say which settings each pair shares. docs/memory.md ("The tables users know") reads them.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import io
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from estimate_vs_published import _script, litgpt_loss  # noqa: E402  (the same loss its comparison models)


def estimate(
    script: str, *, loss=None, bitsandbytes: str | None = None, math_attention: bool = False, **options
) -> int:
    """The predicted peak of ``script``'s ``setup(estimate=True, **options)``, with the script's loss replaced by
    ``loss``, 4-bit layers modelled as ``bitsandbytes`` ran them where given, and with ``math_attention`` the
    attention traced through scaled_dot_product_attention's math kernel (each layer's attention matrix made whole)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import memfit.prediction.estimate

    module = _script(script)
    own_loss, own_version = module.loss_fn, memfit.prediction.estimate.BITSANDBYTES
    module.loss_fn = loss or own_loss  # the script's train_step calls it by name
    memfit.prediction.estimate.BITSANDBYTES = bitsandbytes or importlib.metadata.version("bitsandbytes")
    try:
        attention = sdpa_kernel(SDPBackend.MATH) if math_attention else contextlib.nullcontext()
        with contextlib.redirect_stdout(io.StringIO()), tempfile.TemporaryDirectory() as pictures, attention:
            return module.setup(estimate=True, accelerator="cuda", profile_dir=Path(pictures), **options).peak
    finally:
        module.loss_fn, memfit.prediction.estimate.BITSANDBYTES = own_loss, own_version


def train(micro_batch_size: int, global_batch_size: int, length: int):
    from memfit.args import TrainArgs

    return TrainArgs(
        micro_batch_size=micro_batch_size,
        global_batch_size=global_batch_size,
        max_seq_length=length,
        max_steps=1,
        lr=1e-4,
        save_interval=None,
    )


def differences() -> list[dict]:
    lora_7b = dict(model_name="Llama-2-7b-hf", precision="bf16-true", train=train(1, 128, 1304))
    lora_8b = dict(model_name="Meta-Llama-3.1-8B", precision="bf16-true", train=train(4, 8, 2048))
    fsdp_1b = dict(
        model_name="tiny-llama-1.1b", precision="bf16-true", strategy="fsdp", devices=8, train=train(1, 16, 2048)
    )
    qlora_8b = dict(model_name="Meta-Llama-3.1-8B", precision="bf16-true", quantize="bnb.nf4", train=train(4, 8, 2048))
    # litgpt's config hub falcon-7b/lora.yaml
    falcon = dict(
        model_name="falcon-7b",
        precision="bf16-true",
        lora_r=32,
        lora_query=True,
        lora_value=True,
        train=train(1, 8, 512),
    )
    return [
        {
            "difference": "litgpt's loss: the head in 128-position chunks, all alive at once, cast to float32, then"
            " chunked cross-entropy (Memfit: a chunk of the head and its loss at a time)",
            "settings": "finetune/lora.py, Llama-2-7B, bf16-true, micro-batch 1 x 1304 tokens",
            "memfit": ("finetune/lora.py", lora_7b),
            "other": ("finetune/lora.py", dict(lora_7b, loss=litgpt_loss)),
        },
        {
            "difference": "the same, with Llama-3's 128,256-token vocabulary and four samples a micro-batch",
            "settings": "finetune/lora.py, Llama-3.1-8B, bf16-true, micro-batch 4 x 2048 tokens",
            "memfit": ("finetune/lora.py", lora_8b),
            "other": ("finetune/lora.py", dict(lora_8b, loss=litgpt_loss)),
        },
        {
            "difference": "bitsandbytes before 0.43.2 (litgpt's QLoRA tables: 0.41.1): each 4-bit layer kept its"
            " input for backward",
            "settings": "finetune/lora.py, Llama-2-7B, bf16-true, bnb.nf4, micro-batch 1 x 1304 tokens",
            "memfit": ("finetune/lora.py", dict(lora_7b, quantize="bnb.nf4")),
            "other": ("finetune/lora.py", dict(lora_7b, quantize="bnb.nf4", bitsandbytes="0.41.1")),
        },
        {
            "difference": "torch's first FSDP as Lightning's FSDPStrategy runs it (litgpt's multi-GPU tables):"
            " gradients accumulated unsharded until the step's last micro-batch; Memfit reduce-scatters each"
            " micro-batch's. --fsdp.accumulate_unsharded true runs the first's way",
            "settings": "finetune/full.py, TinyLlama-1.1B, bf16-true, FSDP x8, 2 micro-batches of 1 x 2048 a rank",
            "memfit": ("finetune/full.py", fsdp_1b),
            "other": ("finetune/full.py", dict(fsdp_1b, fsdp=_fsdp(accumulate_unsharded=True))),
        },
        {
            "difference": "torchtune's QLoRA recipes offload activations to the host (enable_activation_offloading);"
            " --activation_offloading true does the same",
            "settings": "finetune/lora.py, Llama-3.1-8B, bf16-true, bnb.nf4, micro-batch 4 x 2048 tokens",
            "memfit": ("finetune/lora.py", qlora_8b),
            "other": ("finetune/lora.py", dict(qlora_8b, activation_offloading=True)),
        },
        {
            "difference": "scaled_dot_product_attention's math kernel, which Falcon's unequal head counts (71 query"
            " heads, one key/value head) met in 2023's litgpt: each layer's attention matrix made whole and kept for"
            " backward (Memfit: the fused kernel, which keeps its output and log-sum-exp)",
            "settings": "finetune/lora.py, Falcon-7B, bf16-true, LoRA r 32 on query and value, micro-batch 1 x 512"
            " tokens (litgpt's falcon-7b/lora.yaml)",
            "memfit": ("finetune/lora.py", falcon),
            "other": ("finetune/lora.py", dict(falcon, math_attention=True)),
        },
    ]


def _fsdp(**values):
    from memfit.args import FSDPArgs

    return FSDPArgs(**values)


def main() -> None:
    rows = []
    for entry in differences():
        started = time.process_time()
        memfit_peak = estimate(entry["memfit"][0], **entry["memfit"][1])
        other_peak = estimate(entry["other"][0], **entry["other"][1])
        row = {
            "difference": entry["difference"],
            "settings": entry["settings"],
            "memfit_bytes": memfit_peak,
            "other_bytes": other_peak,
            "other_minus_memfit_bytes": other_peak - memfit_peak,
            "cpu_seconds": round(time.process_time() - started, 1),
        }
        rows.append(row)
        print(
            f"{row['settings']}: Memfit {memfit_peak / 2**30:.2f} GiB, the other way {other_peak / 2**30:.2f} GiB"
            f" ({(other_peak - memfit_peak) / 2**30:+.2f} GiB)"
        )
    out = ROOT / "profiles/published/differences.json"
    record = {
        "what": "predicted max_memory_allocated of Memfit's run and of the same settings run as litgpt's or"
        " torchtune's tables ran them (--estimate, on a CPU, from the model's name)",
        "command": "python benchmarks/published_differences.py",
        "versions": {m: importlib.metadata.version(m) for m in ("torch", "lightning", "litgpt", "bitsandbytes")},
        "rows": rows,
    }
    out.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
