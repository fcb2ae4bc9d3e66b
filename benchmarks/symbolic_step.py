"""What the traced step as a formula costs against concrete traces (``memfit.prediction.symbolic_step``), both in one
run:

    python benchmarks/symbolic_step.py --out profiles/cpu/symbolic_step.json

For each model (a 2-block model of the embedded model's kind, and Llama-3.1-8B's blocks two deep, as the planner's
shallow traces take them), LoRA's step at micro-batch 2: the seconds of a concrete trace (the median of 3, after one
to warm up), of one symbolic trace, and of one setting evaluated from it; how many pieces a sweep of sequence lengths
needs, and whether each setting's ledger equals its concrete trace's. Process CPU time, on this machine.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _script(config_args: dict, name: str | None):
    import importlib.util

    from litgpt.lora import GPT, Block, Config, mark_only_lora_as_trainable

    from memfit.settings.run import ScriptStep

    spec = importlib.util.spec_from_file_location("lora_script", ROOT / "finetune/lora.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["lora_script"] = module
    spec.loader.exec_module(module)
    lora = dict(lora_r=8, lora_alpha=16, lora_query=True, lora_value=True)
    config = Config.from_name(name, **config_args, **lora) if name else Config(**config_args, **lora)
    return ScriptStep(GPT, Block, config, mark_only_lora_as_trainable, module.train_step)


def _plan(micro_batch_size: int, sequence_length: int):
    from memfit.prediction.fake_step import Plan
    from memfit.training.optim import optimizer_kind

    return Plan(
        micro_batch_size=micro_batch_size,
        accumulation=1,
        sequence_length=sequence_length,
        precision="bf16-true",
        quantize=None,
        optimizer=optimizer_kind("AdamW"),
        activation_checkpointing=0,
        optimizer_in_backward=False,
        strategy="auto",
        cpu_offload=False,
        world_size=1,
        blocks=2,
    )


def _numbers(ledger, unsaved: int) -> dict:
    return {
        "unsaved": unsaved,
        **{name: (r.peak, r.activations, sorted(r.roles_at_end.items())) for name, r in ledger.phases.items()},
    }


def measure(label: str, script, lengths: list[int], checked: list[int]) -> dict:
    from memfit.prediction.fake_step import trace_step
    from memfit.prediction.symbolic_step import SymbolicStep

    hint = lengths[len(lengths) // 2]

    def concrete(t: int):
        return trace_step(script, _plan(2, t), whole_step=False)

    concrete(hint)  # warm-up: the first trace pays for imports and caches
    seconds = []
    for _ in range(3):
        start = time.process_time()
        concrete(hint)
        seconds.append(time.process_time() - start)
    concrete_s = statistics.median(seconds)

    formula = SymbolicStep(script, _plan(2, hint))
    start = time.process_time()
    formula.ledger(2, hint)
    symbolic_s = time.process_time() - start
    start = time.process_time()
    for _ in range(100):
        formula.ledger(2, hint)
    evaluation_s = (time.process_time() - start) / 100

    start = time.process_time()
    for t in lengths:
        formula.ledger(2, t)
    sweep_s = time.process_time() - start
    equal = {t: _numbers(*formula.ledger(2, t)[0:3:2]) == _numbers(*concrete(t)[0:3:2]) for t in checked}
    row = {
        "model": label,
        "concrete_trace_s": round(concrete_s, 3),
        "symbolic_trace_s": round(symbolic_s, 3),
        "symbolic_over_concrete": round(symbolic_s / concrete_s, 1),
        "evaluation_s": round(evaluation_s, 6),
        "sweep": {"lengths": len(lengths), "from": lengths[0], "to": lengths[-1], "pieces": len(formula.pieces)},
        "sweep_s": round(sweep_s, 2),
        "sweep_concrete_s_at_the_median": round(len(lengths) * concrete_s, 2),
        "equal_to_concrete": {str(t): ok for t, ok in equal.items()},
    }
    print(json.dumps(row))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    import torch

    small = dict(
        n_layer=2,
        n_embd=128,
        n_head=4,
        n_query_groups=2,
        intermediate_size=344,
        vocab_size=1024,
        padded_vocab_size=1024,
        block_size=4096,
        mlp_class_name="LLaMAMLP",
        norm_class_name="RMSNorm",
        bias=False,
        parallel_residual=False,
        rotary_percentage=1.0,
    )
    rows = [
        measure("2 blocks of 128 wide, vocabulary 1,024", _script(small, None), list(range(64, 4096, 63)), [64, 1999]),
        measure(
            "Meta-Llama-3.1-8B, 2 blocks", _script({"n_layer": 2}, "Meta-Llama-3.1-8B"), [2048, 4096, 8192], [8192]
        ),
    ]
    record = {
        "what": (
            "process CPU seconds: a concrete trace of LoRA's step at micro-batch 2 (median of 3), one symbolic trace"
            " (the micro-batch size and sequence length as symbols), one setting evaluated from it, and a sweep of"
            " sequence lengths through the formula (new pieces traced as needed) against that many concrete traces;"
            " equal_to_concrete: every byte count of the ledger equal"
        ),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
        "versions": {"python": platform.python_version(), "torch": torch.__version__},
        "rows": rows,
    }
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
