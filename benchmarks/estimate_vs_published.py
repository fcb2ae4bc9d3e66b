"""Memfit's --estimate against published GPU peaks (benchmarks/published_peaks.json), row by row.

    python benchmarks/estimate_vs_published.py            # writes profiles/published/estimate_vs_published.{json,md}

Each row of the JSON is a published measurement with its source, hardware, software, settings and unit. For each,
the matching script's ``setup(estimate=True, ...)`` predicts ``max_memory_allocated`` for the same settings, from
the model's name alone (no weights, CPU only, seconds per row). The table gives the error of each row and the
median over the rows whose library versions Memfit models; a row that cannot be matched says why.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import io
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

UNITS = {"GB": 1e9, "GiB": 2**30}
CUDA_CONTEXT = 0.5 * 2**30


def _script(relative: str):
    name = "memfit_script_" + Path(relative).stem
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / relative)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # jsonargparse resolves signatures through the module registry
        spec.loader.exec_module(module)
    return sys.modules[name]


def not_modelled(row: dict, source: dict) -> str | None:
    """Why a row's prediction cannot be held against its figure, or None."""
    if row.get("devices", 1) > 1:
        return (
            "measured with torch's first FSDP (FullyShardedDataParallel, through Lightning's FSDPStrategy);"
            " Memfit runs the second (fully_shard) and predicts that. Not comparable: the figure is"
            " max_memory_allocated over the whole run, and lit-gpt at that commit built the whole model on every"
            " GPU before FSDP sharded it, so it likely holds that load; Memfit's FSDP runs load on the CPU, and"
            " the estimate is of the training step"
        )
    return None


def litgpt_loss(model, batch: dict):
    """The loss of litgpt's fine-tuning scripts (lit-gpt's at the sources' commits too): the head in chunks of 128
    positions, all alive at once, cast to float32 by Fabric, then ``chunked_cross_entropy``. Memfit's scripts use
    ``memfit.training.loss`` instead, which keeps far less; the published figures were measured with this one."""
    from litgpt.utils import chunked_cross_entropy

    logits = model(batch["input_ids"], lm_head_chunk_size=128)
    logits[-1] = logits[-1][..., :-1, :]
    return chunked_cross_entropy(logits, batch["labels"][..., 1:])


def predict(row: dict, source: dict) -> tuple[float, float]:
    """(predicted peak, predicted end of backward) in bytes for the row's settings, with 4-bit layers modelled as
    the source's bitsandbytes ran them and the loss as the source's scripts computed it."""
    import memfit.prediction.estimate
    from memfit.args import TrainArgs

    modelled_before = memfit.prediction.estimate.BITSANDBYTES
    memfit.prediction.estimate.BITSANDBYTES = source.get("bitsandbytes", importlib.metadata.version("bitsandbytes"))
    module = _script(row["script"])
    memfit_loss, module.loss_fn = module.loss_fn, litgpt_loss  # the script's train_step calls it by name
    devices = row.get("devices", 1)
    quantize = row.get("quantize")
    optimizer = "PagedAdamW" if quantize else "AdamW-foreach"  # what lit-gpt's scripts used; PyTorch's default AdamW
    train = TrainArgs(
        micro_batch_size=row["micro_batch_size"],
        global_batch_size=row.get("global_batch_size", 128),
        max_seq_length=row["length"],
        max_steps=1,
        lr=1e-4,
        save_interval=None,
    )
    options = dict(
        model_name=row["model"],
        precision=row.get("precision", "bf16-true"),
        accelerator="cuda",
        train=train,
        optimizer=optimizer,
        estimate=True,
        devices=devices,
    )
    if quantize:
        options["quantize"] = quantize
    if devices > 1:  # lit-gpt's scripts of that commit: FSDP, with activation checkpointing of every block
        options.update(strategy="fsdp", activation_checkpointing=True)
    try:
        # the predicted step's picture is not kept here
        with contextlib.redirect_stdout(io.StringIO()), tempfile.TemporaryDirectory() as pictures:
            result = module.setup(profile_dir=Path(pictures), **options)
    finally:
        memfit.prediction.estimate.BITSANDBYTES = modelled_before
        module.loss_fn = memfit_loss
    return result.peak, result.phases["backward"]["peak"]


def main() -> None:
    published = json.loads((ROOT / "benchmarks/published_peaks.json").read_text())
    rows = []
    for row in published["rows"]:
        source = published["sources"][row["source"]]
        started = time.perf_counter()
        peak, _ = predict(row, source)
        entry = {
            **row,
            "predicted_bytes": peak,
            "seconds": round(time.perf_counter() - started, 1),
            "not_modelled": not_modelled(row, source),
        }
        if row["figure"] == "OOM":
            capacity = row["capacity"] * UNITS[row["unit"]] - CUDA_CONTEXT
            entry["agrees"] = peak > capacity
            entry["error"] = None
        else:
            measured = row["figure"] * UNITS[row["unit"]]
            entry["measured_bytes"] = measured
            entry["error"] = peak / measured - 1
        rows.append(entry)
        print(
            f"{row['script']:<24} {row['model']:<24} {str(row.get('quantize')):<11} mb {row['micro_batch_size']}"
            f" x{row.get('devices', 1)}: predicted {peak / UNITS[row['unit']]:.2f} {row['unit']} vs {row['figure']}"
            + (f" ({entry['error']:+.1%})" if entry["error"] is not None else f" (OOM agrees: {entry['agrees']})")
            + (" [not modelled]" if entry["not_modelled"] else "")
        )
    modelled = [abs(r["error"]) for r in rows if r["error"] is not None and not r["not_modelled"]]
    summary = {
        "median_abs_error": statistics.median(modelled),
        "max_abs_error": max(modelled),
        "modelled_rows": len(modelled),
        "rows": len(rows),
        "oom_rows_agreeing": sum(1 for r in rows if r.get("agrees")),
        "oom_rows": sum(1 for r in rows if r["figure"] == "OOM"),
    }
    print(
        f"median |error| {summary['median_abs_error']:.1%}, max {summary['max_abs_error']:.1%} over"
        f" {len(modelled)} modelled rows"
    )
    out = ROOT / "profiles/published"
    out.mkdir(parents=True, exist_ok=True)
    record = {
        "what": "Memfit --estimate (predicted max_memory_allocated) against published GPU peaks",
        "command": "python benchmarks/estimate_vs_published.py",
        "date": time.strftime("%Y-%m-%d"),
        "machine": platform.machine(),
        "versions": {
            "python": platform.python_version(),
            **{m: importlib.metadata.version(m) for m in ("torch", "lightning", "litgpt", "bitsandbytes")},
        },
        "sources": published["sources"],
        "summary": summary,
        "rows": rows,
    }
    (out / "estimate_vs_published.json").write_text(json.dumps(record, indent=2))
    (out / "estimate_vs_published.md").write_text(markdown(record))


def markdown(record: dict) -> str:
    s = record["summary"]
    lines = [
        "# Memfit's estimate against published GPU peaks",
        "",
        f"Generated by `{record['command']}` on {record['date']} (torch {record['versions']['torch']}, litgpt"
        f" {record['versions']['litgpt']}, bitsandbytes {record['versions']['bitsandbytes']}). Predictions are"
        " `--estimate` (max_memory_allocated), made on a CPU from the model's name; the figures are the sources'.",
        "",
        f"**Median |error| {s['median_abs_error']:.1%}, largest {s['max_abs_error']:.1%}, over the"
        f" {s['modelled_rows']} rows whose library versions Memfit models**; {s['oom_rows_agreeing']} of"
        f" {s['oom_rows']} published out-of-memory rows are predicted over the card's memory.",
        "",
        "| source | script | model | quantize | micro-batch | GPUs | tokens | published | predicted | error | note |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in record["rows"]:
        unit = UNITS[r["unit"]]
        published = "OOM" if r["figure"] == "OOM" else f"{r['figure']:.2f} {r['unit']}"
        error = (
            f"{r['error']:+.1%}"
            if r["error"] is not None
            else ("agrees (over capacity)" if r["agrees"] else "disagrees (fits)")
        )
        lines.append(
            f"| {r['source']} | {r['script']} | {r['model']} | {r.get('quantize') or '-'} |"
            f" {r['micro_batch_size']} | {r.get('devices', 1)} | {r['length']} | {published} |"
            f" {r['predicted_bytes'] / unit:.2f} {r['unit']} | {error} | {r['not_modelled'] or ''} |"
        )
    lines += ["", "Sources:", ""]
    for name, source in record["sources"].items():
        lines.append(
            f"- **{name}**: {source['url']} ({source['date']}); {source['hardware']}; {source['software']};"
            f" measure: {source['measure']}; settings: {source['settings']}."
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
