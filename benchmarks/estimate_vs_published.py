"""Memfit's --estimate against published GPU peaks (benchmarks/published_peaks.json), row by row.

    python benchmarks/estimate_vs_published.py            # writes profiles/published/estimate_vs_published.{json,md}
    python benchmarks/estimate_vs_published.py --hub ../shared/litgpt_config_hub   # the default; absent: skipped

Each row of the JSON is a published measurement with its source, hardware, software, settings and unit. For each,
the matching script's ``setup(estimate=True, ...)`` predicts ``max_memory_allocated`` for the same settings, from
the model's name alone (no weights, CPU only, seconds per row). The table gives the error of each row and the
median over the rows whose library versions Memfit models; a row that cannot be matched says why.

A second source is read where it lies, not copied: the "Peak memory" column of litgpt's config hub table
(``config_hub/finetune/README.md``), each row predicted from its own config file through the script's command line
(``--config FILE --estimate true``), with what litgpt's scripts of the table's date ran in place of Memfit's choices:
their loss, PyTorch's foreach AdamW (bitsandbytes' PagedAdamW under --quantize), bitsandbytes 0.42.0 (litgpt's pin
then) and, on several GPUs, gradients accumulated unsharded.
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
HUB = ROOT.parent / "shared" / "litgpt_config_hub"
HUB_SOURCE = {
    "url": "https://github.com/Lightning-AI/litgpt/blob/v0.5.13/config_hub/finetune/README.md",
    "date": "2024-04-24 to 2024-09-27 (the table's commits)",
    "software": "litgpt 0.3-0.4 (its finetune/{lora,full}.py of those dates), bitsandbytes==0.42.0 (litgpt's pin)",
    "hardware": "NVIDIA A10G (24 GB), 1 or 4 on one machine",
    "measure": "'Peak memory': litgpt's fine-tuning scripts print torch.cuda.max_memory_allocated() / 1e9 (GB)",
    "settings": "each row's config file in the hub (read from --hub, unchanged since the table's last commit): bf16-true,"
    " Alpaca2k at 512 tokens; lora.py: its loss over the head in 128-position chunks, full.py: the whole head then"
    " chunked cross-entropy; torch.optim.AdamW (foreach on CUDA), bnb.optim.PagedAdamW under --quantize; several"
    " GPUs: Lightning's FSDPStrategy, every block checkpointed, gradients accumulated unsharded (no_backward_sync)",
    "bitsandbytes": "0.42.0",
}
# The table spells some files otherwise than the hub: in another case (llama-3.2-1b/), or this one
HUB_FILE_SPELLING = {"gemma2b/qlora.yaml": "gemma2-2b/qlora.yaml"}
A10G_BYTES = 23028 * 2**20  # an A10G's memory as nvidia-smi reports it


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
    if row["source"] == "litgpt-resource-tables" and row.get("devices", 1) > 1:
        return (
            "measured with torch's first FSDP (FullyShardedDataParallel, through Lightning's FSDPStrategy);"
            " Memfit runs the second (fully_shard) and predicts that. Not comparable: the figure is"
            " max_memory_allocated over the whole run, and lit-gpt at that commit built the whole model on every"
            " GPU before FSDP sharded it, so it likely holds that load; Memfit's FSDP runs load on the CPU, and"
            " the estimate is of the training step"
        )
    return None


def litgpt_loss(model, batch: dict, on_logits=lambda: None):
    """The loss of litgpt's fine-tuning scripts (lit-gpt's at the sources' commits too): the head in chunks of 128
    positions, all alive at once, cast to float32 by Fabric, then ``chunked_cross_entropy``. Memfit's scripts use
    ``memfit.training.loss`` instead, which keeps far less; the published figures were measured with this one.
    ``on_logits``: called when the model has returned the logits (``holding_the_previous_micro_batch``)."""
    from litgpt.utils import chunked_cross_entropy

    logits = model(batch["input_ids"], lm_head_chunk_size=128)
    on_logits()
    logits[-1] = logits[-1][..., :-1, :]
    return chunked_cross_entropy(logits, batch["labels"][..., 1:])


def litgpt_full_loss(model, batch: dict, on_logits=lambda: None):
    """litgpt's full fine-tuning loss at the hub table's dates: the whole head at once (its logits cast to float32 by
    Fabric), then ``chunked_cross_entropy`` over 128-position chunks of them."""
    from litgpt.utils import chunked_cross_entropy

    logits = model(batch["input_ids"])
    on_logits()
    return chunked_cross_entropy(logits[..., :-1, :], batch["labels"][..., 1:])


def holding_the_previous_micro_batch(loss, four_bit_inputs: bool):
    """``loss`` run as litgpt's loop runs it at the hub table's dates, beside what the loop still holds of the
    micro-batch before: ``logits`` and ``loss`` are variables of its loop, so the previous float32 logits live until
    the model returns this micro-batch's, and the previous graph until this loss replaces it. On that graph
    bitsandbytes before 0.43.2 (``four_bit_inputs``) holds each 4-bit layer's input: its ``MatMul4Bit`` keeps
    ``ctx.tensors = (A, B)``, an attribute, which backward does not free as it frees what ``save_for_backward``
    saved. The previous micro-batch is as long as this one (the table's rows: Alpaca2k samples cut at 512 tokens)."""
    import weakref

    import torch

    def run(model, batch: dict):
        input_ids = batch["input_ids"]
        # (B, T, vocab) in float32, as Fabric's precision plugin hands litgpt's loop the previous logits; the list
        # holds the only reference
        previous_logits = [
            torch.empty(*input_ids.shape, model.config.padded_vocab_size, dtype=torch.float32, device=input_ids.device)
        ]
        previous_inputs, seen = [], set()

        def hold_the_previous_input(_module, args) -> None:
            # one per distinct storage: the fused q/k/v layer and an MLP's two input layers read one tensor, and
            # the head's 128-position chunks are views of one
            storage = args[0].untyped_storage()
            key = id(weakref.ref(storage))
            if key not in seen:
                seen.add(key)
                previous_inputs.append(torch.empty(storage.nbytes(), dtype=torch.uint8, device=input_ids.device))

        frozen_linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and not m.weight.requires_grad]
        hooks = [m.register_forward_pre_hook(hold_the_previous_input) for m in frozen_linears if four_bit_inputs]
        try:
            return loss(model, batch, on_logits=previous_logits.clear)
        finally:
            for hook in hooks:
                hook.remove()
            previous_inputs.clear()

    return run


def hub_rows(hub: Path) -> list[dict]:
    """One row per config file the hub table measured: the table's row whose machine has as many GPUs as the file's
    ``devices`` (the table lists a one-device file again on a 4-GPU machine, the same run and figure), else its first
    row for the file, which then says that the machine and the file differ."""
    import yaml

    files = {str(p.relative_to(hub / "finetune")).lower(): p for p in (hub / "finetune").glob("*/*.yaml")}
    by_file: dict[str, list[dict]] = {}
    for line in (hub / "finetune" / "README.md").read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) < 9 or not cells[0].endswith(".yaml"):
            continue
        path = files[HUB_FILE_SPELLING.get(cells[0], cells[0]).lower()]
        config = str(path.relative_to(hub / "finetune"))
        settings = yaml.safe_load(path.read_text())
        gpus = int(cells[5].split("x")[0])  # "4xA10G"
        figure = "OOM" if cells[8] == "OOM" else float(cells[8].split()[0])
        train = settings["train"]
        by_file.setdefault(config, []).append(
            {
                "source": "litgpt-config-hub",
                "config": config,
                "script": "finetune/full.py" if config.endswith("full.yaml") else "finetune/lora.py",
                "model": Path(settings["checkpoint_dir"]).name,
                "quantize": settings.get("quantize"),
                "micro_batch_size": train["micro_batch_size"],
                "global_batch_size": train["global_batch_size"],
                "length": train["max_seq_length"],
                "devices": settings.get("devices", 1),
                "machine": cells[5],
                "machine_differs": gpus != settings.get("devices", 1),
                "figure": figure,
                "unit": "GB",
                "capacity_bytes": A10G_BYTES,
            }
        )
    return [next((r for r in rows if not r["machine_differs"]), rows[0]) for rows in by_file.values()]


def state_floor(result) -> int:
    """What a run holds whatever its activations: weights, gradients and optimizer state at the optimizer step."""
    roles = result.phases["optimizer_step"]["roles"]
    return sum(
        roles[r] for r in ("params_trainable", "params_frozen", "params_quantized", "gradients", "optimizer_state")
    )


def predict_hub(row: dict, source: dict, hub: Path) -> tuple[float, float]:
    """(predicted peak, ``state_floor``) in bytes of the row's config file, through the script's command line as a
    user runs it, with what litgpt's scripts ran in place of Memfit's choices (the module's docstring)."""
    import memfit.prediction.estimate

    modelled_before = memfit.prediction.estimate.BITSANDBYTES
    memfit.prediction.estimate.BITSANDBYTES = source["bitsandbytes"]
    module = _script(row["script"])
    memfit_loss = module.loss_fn
    loss = litgpt_full_loss if row["script"] == "finetune/full.py" else litgpt_loss
    four_bit_inputs = row["quantize"] is not None and memfit.prediction.estimate._keeps_4bit_inputs(
        source["bitsandbytes"]
    )
    module.loss_fn = holding_the_previous_micro_batch(loss, four_bit_inputs)
    optimizer = "PagedAdamW" if row["quantize"] else "AdamW-foreach"
    try:
        with contextlib.redirect_stdout(io.StringIO()), tempfile.TemporaryDirectory() as pictures:
            args = ["--config", str(hub / "finetune" / row["config"]), "--estimate", "true", "--accelerator", "cuda",
                    "--optimizer", optimizer, "--profile_dir", pictures]  # fmt: skip
            if row["devices"] > 1:  # litgpt's FSDPStrategy: every block a unit, checkpointed
                args += [
                    "--strategy",
                    "fsdp",
                    "--activation_checkpointing",
                    "true",
                    "--fsdp.accumulate_unsharded",
                    "true",
                ]
            result = module.CLI(module.setup, args, real_model_defaults=module.LITGPT_DEFAULTS,
                                hidden=module.PRETRAINING_ONLY)  # fmt: skip
    finally:
        memfit.prediction.estimate.BITSANDBYTES = modelled_before
        module.loss_fn = memfit_loss
    return result.peak, state_floor(result)


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


def summarize(rows: list[dict]) -> dict:
    modelled = [abs(r["error"]) for r in rows if r["error"] is not None and not r["not_modelled"]]
    return {
        "median_abs_error": statistics.median(modelled) if modelled else None,
        "max_abs_error": max(modelled) if modelled else None,
        "modelled_rows": len(modelled),
        "rows": len(rows),
        "oom_rows_agreeing": sum(1 for r in rows if r.get("agrees")),
        "oom_rows": sum(1 for r in rows if r["figure"] == "OOM"),
    }


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hub", type=Path, default=HUB, help="litgpt's config_hub folder (its table and files)")
    args = parser.parse_args()
    published = json.loads((ROOT / "benchmarks/published_peaks.json").read_text())
    sources = dict(published["sources"])
    work = [(row, lambda row, source: predict(row, source)) for row in published["rows"]]
    if (args.hub / "finetune" / "README.md").is_file():
        sources["litgpt-config-hub"] = HUB_SOURCE
        work += [(row, lambda row, source: predict_hub(row, source, args.hub)) for row in hub_rows(args.hub)]
    else:
        print(f"{args.hub} holds no finetune/README.md: litgpt's config hub table is left out")
    rows = []
    for row, predictor in work:
        source = sources[row["source"]]
        started = time.perf_counter()
        peak, floor = predictor(row, source)
        entry = {
            **row,
            "predicted_bytes": peak,
            "seconds": round(time.perf_counter() - started, 1),
            "not_modelled": not_modelled(row, source),
        }
        if row["source"] == "litgpt-config-hub":
            entry["state_floor_bytes"] = floor
            if row["figure"] != "OOM" and row["figure"] * UNITS[row["unit"]] < floor:
                entry["not_modelled"] = (
                    f"the figure is below what its file's model holds in weights, gradients and optimizer state alone"
                    f" ({floor / UNITS[row['unit']]:.2f} {row['unit']}): it was measured with other settings"
                )
        if row["figure"] == "OOM":
            capacity = row.get("capacity_bytes") or row["capacity"] * UNITS[row["unit"]]
            entry["agrees"] = peak > capacity - CUDA_CONTEXT
            entry["error"] = None
        else:
            measured = row["figure"] * UNITS[row["unit"]]
            entry["measured_bytes"] = measured
            entry["error"] = peak / measured - 1
        rows.append(entry)
        print(
            f"{row.get('config', row['script']):<24} {row['model']:<24} {str(row.get('quantize')):<11}"
            f" mb {row['micro_batch_size']} x{row.get('devices', 1)}:"
            f" predicted {peak / UNITS[row['unit']]:.2f} {row['unit']} vs {row['figure']}"
            + (f" ({entry['error']:+.1%})" if entry["error"] is not None else f" (OOM agrees: {entry['agrees']})")
            + (" [not modelled]" if entry["not_modelled"] else ""),
            flush=True,
        )
    summary = summarize(rows)
    by_source = {name: summarize([r for r in rows if r["source"] == name]) for name in sources}
    for name, part in by_source.items():
        if part["modelled_rows"]:
            print(
                f"{name}: median |error| {part['median_abs_error']:.1%}, max {part['max_abs_error']:.1%} over"
                f" {part['modelled_rows']} modelled rows"
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
        "sources": sources,
        "summary": summary,
        "by_source": by_source,
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
        *[
            f"- {name}: median |error| {part['median_abs_error']:.1%}, largest {part['max_abs_error']:.1%} over"
            f" {part['modelled_rows']} rows"
            + (
                f"; {part['oom_rows_agreeing']} of {part['oom_rows']} out-of-memory rows predicted over the card"
                if part["oom_rows"]
                else ""
            )
            for name, part in record.get("by_source", {}).items()
            if part["modelled_rows"]
        ],
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
        script = f"{r['script']} `{r['config']}`" if "config" in r else r["script"]
        note = r["not_modelled"] or ""
        if r.get("machine_differs"):
            note = f"the table says {r['machine']}; its file runs {r['devices']} device(s), as predicted. {note}"
        lines.append(
            f"| {r['source']} | {script} | {r['model']} | {r.get('quantize') or '-'} |"
            f" {r['micro_batch_size']} | {r.get('devices', 1)} | {r['length']} | {published} |"
            f" {r['predicted_bytes'] / unit:.2f} {r['unit']} | {error} | {note} |"
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
