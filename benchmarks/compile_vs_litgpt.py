"""litgpt's pretraining, which compiles the whole model unconditionally, beside Memfit's pretraining eager and with
``--compile true`` (each block compiled), on the same model, data and settings, alternated in one run:

    python benchmarks/compile_vs_litgpt.py --out profiles/cpu/compile_vs_litgpt.json

The model is the embedded tiny Llama's architecture from random weights (``--model_config``), the data the embedded
corpus as litgpt's ``TextFiles`` (one file to train on, one to validate on, tokenized by litdata with the embedded
tokenizer), 32-true on the CPU. Each side runs ``--repeats`` times, in a fresh process each, in the order litgpt,
Memfit eager, Memfit compiled. Figures per run: tokens/s over the training loop with its first step, where both
compile (each tool's own training time), tokens/s over the steps after ``--warmup_steps`` (each tool's own per-step
log), the process's peak RSS (``wait4``'s ``ru_maxrss``), the last step's loss, and the final model's validation
loss (computed here, the same way for both). litgpt's CLI needs ``requests``: ``pip install -e '.[bench]'``.
"""

from __future__ import annotations

import argparse
import csv
import importlib.metadata
import json
import platform
import re
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from compare_litgpt import Failed, run, steady_tokens_per_s, training_seconds  # noqa: E402

SIDES = ("litgpt", "memfit_eager", "memfit_compiled")


def text_files(work: Path) -> tuple[Path, Path]:
    """The embedded corpus split into a training and a validation folder of one text file each (litgpt's TextFiles
    takes folders of ``.txt`` files)."""
    from memfit.training.embedded import ensure_embedded

    checkpoint, _ = ensure_embedded()
    paragraphs = (checkpoint.parent / "corpus.txt").read_text().split("\n\n")
    cut = len(paragraphs) * 19 // 20
    folders = work / "train", work / "val"
    for folder, part in zip(folders, (paragraphs[:cut], paragraphs[cut:])):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "corpus.txt").write_text("\n\n".join(part))
    return folders


def command(side: str, checkpoint: Path, train: Path, val: Path, args) -> list[str]:
    import yaml

    # the fields themselves: both tools read --model_config as a Config, not as a file's path
    model_config = json.dumps(yaml.safe_load((checkpoint / "model_config.yaml").read_text()))
    shared = [
        "--model_config",
        model_config,
        "--tokenizer_dir",
        str(checkpoint),
        "--data",
        "TextFiles",
        "--data.train_data_path",
        str(train),
        "--data.val_data_path",
        str(val),
        "--data.num_workers",
        "1",
        "--precision",
        "32-true",
        "--train.micro_batch_size",
        str(args.micro_batch_size),
        "--train.global_batch_size",
        str(args.micro_batch_size),
        "--train.max_seq_length",
        str(args.length),
        "--train.max_tokens",
        str(args.steps * args.micro_batch_size * args.length),
        "--train.log_interval",
        "1",
        # the same schedule, clipping and seed for both: the tools' defaults differ
        "--optimizer",
        json.dumps({"class_path": "torch.optim.AdamW", "init_args": {"lr": 1e-3, "weight_decay": 0.0}}),
        "--train.lr_warmup_steps",
        "2",
        "--train.min_lr",
        "1e-4",
        "--train.max_norm",
        "1.0",
        "--seed",
        "42",
        "--train.save_interval",
        "100000",
        "--eval.interval",
        "100000",
        "--eval.final_validation",
        "false",
        "--logger_name",
        "csv",
        "--out_dir",
        "out",
    ]
    if side == "litgpt":
        beside = Path(sys.executable).parent / "litgpt"  # this interpreter's environment's, activated or not
        litgpt = str(beside) if beside.is_file() else shutil.which("litgpt") or "litgpt"
        # litgpt's CLI requires a name even beside --model_config, which replaces what the name would choose
        name = json.loads(model_config)["name"]
        return [litgpt, "pretrain", name, *shared, "--eval.initial_validation", "false"]
    compiled = str(side == "memfit_compiled").lower()
    return [sys.executable, str(ROOT / "pretrain/pretrain.py"), *shared, "--compile", compiled, "--accelerator", "cpu"]


def tokens_trained(side: str, output: str, cwd: Path) -> int:
    if side == "litgpt":
        return int(re.search(r"Total tokens\s*:\s*([0-9,]+)", output).group(1).replace(",", ""))
    (summary,) = (cwd / "out" / "profiles").glob("*/summary.json")
    return json.loads(summary.read_text())["tokens_trained"]


def final_loss(side: str, cwd: Path) -> float:
    if side == "litgpt":
        (log,) = (cwd / "out").rglob("metrics.csv")
        return [float(r["loss"]) for r in csv.DictReader(log.open()) if r.get("loss")][-1]
    (summary,) = (cwd / "out" / "profiles").glob("*/summary.json")
    return json.loads(summary.read_text())["last_loss"]


def validation_loss(cwd: Path, checkpoint: Path, val: Path, length: int) -> float:
    """The final model's mean next-token loss over the validation text in consecutive windows of ``length`` positions,
    computed here the same way for either tool's ``out/final/lit_model.pth``: the last step's training loss is one
    micro-batch's, and the two tools draw their batches in different orders (their per-step losses differ by up to
    0.6 from step to step), so it does not compare the two trainings."""
    import torch
    from litgpt import GPT, Config
    from litgpt.tokenizer import Tokenizer

    model = GPT(Config.from_file(checkpoint / "model_config.yaml"))
    state = torch.load(cwd / "out" / "final" / "lit_model.pth", weights_only=True)
    model.load_state_dict(state.get("model", state))  # litgpt's pretraining saves the weights under "model"
    model.eval()
    ids = Tokenizer(checkpoint).encode((val / "corpus.txt").read_text(), bos=True, eos=True)
    windows = ids[: len(ids) // (length + 1) * (length + 1)].long().view(-1, length + 1)  # (windows, length + 1)
    with torch.no_grad():
        logits = model(windows[:, :-1])  # (windows, length, vocabulary)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten())
    return loss.item()


LABELS = {
    "litgpt": "`litgpt pretrain` (the whole model compiled)",
    "memfit_eager": "`pretrain/pretrain.py`",
    "memfit_compiled": "`pretrain/pretrain.py --compile true` (each block compiled)",
}


def table(record: dict) -> str:
    """docs/compile.md's table, from a record this benchmark wrote (tests/test_compile.py checks the page against the
    committed record)."""
    lines = [
        "| run | tokens/s, first step included | tokens/s after the first steps | peak RSS | x litgpt: first step"
        " included | after | peak RSS | last step's loss | validation loss |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for side in SIDES:
        median = record["medians"][side]
        ratio = record.get("ratios_to_litgpt", {}).get(side)
        done = [r for r in record["runs"][side] if "failed" not in r]
        cells = [
            LABELS[side],
            f"{median['tokens_per_s_with_compile']:,.0f}",
            f"{median['steady_tokens_per_s']:,.0f}",
            f"{median['peak_rss_bytes'] / 2**20:,.0f} MiB",
            *(
                [f"{ratio[key]:.2f}" for key in ("tokens_per_s_with_compile", "steady_tokens_per_s", "peak_rss_bytes")]
                if ratio
                else ["1", "1", "1"]
            ),
            ", ".join(f"{r['final_loss']:.3f}" for r in done),
            ", ".join(f"{r['validation_loss']:.3f}" for r in done),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "profiles/cpu/compile_vs_litgpt.json")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--micro_batch_size", type=int, default=8)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--warmup_steps", type=int, default=3, help="steps left out of the steady tokens/s")
    parser.add_argument("--table", action="store_true", help="print docs/compile.md's table from --out, run nothing")
    args = parser.parse_args()
    if args.table:
        print(table(json.loads(args.out.read_text())))
        return

    from memfit.training.embedded import ensure_embedded

    checkpoint, _ = ensure_embedded()
    work = Path(tempfile.mkdtemp(prefix="memfit-compile-vs-litgpt-"))
    train, val = text_files(work / "data")
    runs: dict[str, list[dict]] = {side: [] for side in SIDES}
    for repeat in range(args.repeats):
        for side in SIDES:
            cwd = work / f"{side}-{repeat}"
            try:
                output, wall, peaks = run(command(side, checkpoint, train, val, args), cwd, cuda=False)
            except Failed as failure:
                runs[side].append({"failed": str(failure)})
                print(f"{side} #{repeat}: failed: {failure}", flush=True)
                continue
            # tokens/s of the same count for both: the positions trained (Memfit's own count adds each sample's
            # next token, 129 a sample for 128 positions)
            positions = args.steps * args.micro_batch_size * args.length
            seconds = training_seconds(side.split("_")[0], output, cwd)
            entry = {
                "tokens": tokens_trained(side, output, cwd),
                "positions": positions,
                "train_seconds": seconds,
                "tokens_per_s_with_compile": positions / seconds,
                "steady_tokens_per_s": steady_tokens_per_s(
                    side.split("_")[0], cwd, args.micro_batch_size * args.length, 1, args.warmup_steps
                ),
                "peak_rss_bytes": peaks["peak_rss_bytes"],
                "wall_seconds": round(wall, 1),
                "final_loss": final_loss(side, cwd),
                "validation_loss": validation_loss(cwd, checkpoint, val, args.length),
            }
            runs[side].append(entry)
            print(
                f"{side} #{repeat}: {entry['tokens_per_s_with_compile']:,.0f} tokens/s with compile,"
                f" {entry['steady_tokens_per_s']:,.0f} steady, peak RSS {entry['peak_rss_bytes'] / 2**20:,.0f} MiB,"
                f" last step's loss {entry['final_loss']:.3f}, validation loss {entry['validation_loss']:.3f}",
                flush=True,
            )
    medians = {
        side: {
            key: statistics.median(r[key] for r in done)
            for key in ("tokens_per_s_with_compile", "steady_tokens_per_s", "peak_rss_bytes")
        }
        for side, done in ((side, [r for r in runs[side] if "failed" not in r]) for side in SIDES)
        if done
    }
    record = {
        "what": "litgpt pretrain (whole model compiled) vs Memfit's pretrain eager and --compile true (blocks"
        " compiled): same model config, data, settings; CPU, 32-true; medians over the repeats",
        "command": "python benchmarks/compile_vs_litgpt.py " + " ".join(sys.argv[1:]),
        "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}, python {platform.python_version()}",
        "versions": {m: importlib.metadata.version(m) for m in ("torch", "lightning", "litgpt", "litdata")},
        "settings": vars(args) | {"out": str(args.out)},
        "runs": runs,
        "medians": medians,
    }
    if "litgpt" in medians:
        record["ratios_to_litgpt"] = {
            side: {key: value / medians["litgpt"][key] for key, value in medians[side].items()}
            for side in SIDES[1:]
            if side in medians
        }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record.get("ratios_to_litgpt", {}), indent=1))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
