"""profiles/README.md: the resource table, made only from the raw results committed under profiles/.

    python benchmarks/resource_table.py            # rewrites profiles/README.md
    python benchmarks/resource_table.py --check    # exit 1 if profiles/README.md is not what the JSON files give

Every figure in the table is read from a JSON file written by a benchmark (each file names its device, versions, date
and command); nothing is typed in. CPU and GPU results are in separate sections, and a file that is absent gives no
row (there are GPU rows only once a GPU session committed ``profiles/gpu/``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROFILES = ROOT / "profiles"


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def _mib(n: float) -> str:
    return f"{n / 2**20:.0f} MiB"


def _source(data: dict, path: Path) -> str:
    versions = ", ".join(f"{k} {v}" for k, v in data.get("versions", {}).items())
    when = data.get("date", "date not recorded")
    return f"`{path.relative_to(ROOT)}`: {data.get('device', '?')}; {versions}; {when}; `{data.get('command', '?')}`"


def _ratio(spread: dict | None) -> str:
    return f"x{spread['median']:.2f} ({spread['min']:.2f}-{spread['max']:.2f})" if spread else "-"


def compare_section(path: Path) -> list[str]:
    data = json.loads(path.read_text())
    cuda = not data["device"].startswith("CPU")
    key, label, fmt = (
        ("max_allocated_bytes", "CUDA max allocated", _gib) if cuda else ("peak_rss_bytes", "peak RSS", _mib)
    )
    # a run with the profiler window off beside the default one: what the window costs the timed steps
    unprofiled = any("memfit_unprofiled" in r["median"] for r in data["results"])
    lines = [
        f"Source: {_source(data, path)}. Measures: {data['measures']} (warm-up: the first"
        f" {data['settings']['warmup_steps']} optimizer steps).",
        "",
        f"| recipe | model | precision | quantize | micro-batch | sequence | Memfit {label} | litgpt {label} |"
        f" memory Memfit/litgpt | Memfit tokens/s | litgpt tokens/s | tokens/s Memfit/litgpt |"
        f" after warm-up, Memfit/litgpt |"
        + (" Memfit unprofiled tokens/s | unprofiled/litgpt, after warm-up |" if unprofiled else "")
        + (" floor memory | floor tokens/s |" if cuda else ""),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|"
        + ("---|---|" if unprofiled else "")
        + ("---|---|" if cuda else ""),
    ]
    for r in data["results"]:
        ours, theirs = r["median"].get("memfit"), r["median"].get("litgpt")
        cells = [
            f"finetune/{r['method']}.py",
            r["architecture"],
            r["precision"],
            r["quantize"] or "-",
            str(r["micro_batch_size"]),
            str(r["sequence_length"]),
            fmt(ours[key]) if ours else "failed",
            fmt(theirs[key]) if theirs else f"refused: {r['failed'].get('litgpt', 'failed')}",
            _ratio(r.get("peak_memory_ratio")),
            f"{ours['tokens_per_s']:,.0f}" if ours else "-",
            f"{theirs['tokens_per_s']:,.0f}" if theirs else "-",
            _ratio(r.get("tokens_per_s_ratio")),
            _ratio(r.get("steady_tokens_per_s_ratio")),
        ]
        if unprofiled:
            bare = r["median"].get("memfit_unprofiled")
            cells += (
                [
                    f"{bare['tokens_per_s']:,.0f}",
                    f"{bare['tokens_per_s'] / theirs['tokens_per_s']:.2f},"
                    f" {bare['steady_tokens_per_s'] / theirs['steady_tokens_per_s']:.2f}",
                ]
                if bare and theirs
                else ["-", "-"]
            )
        if cuda:
            floor = r.get("floor")
            cells += [_gib(floor["memory_bytes"]), f"{floor['tokens_per_s']:,.0f}"] if floor else ["-", "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def loading_section(path: Path) -> list[str]:
    data = json.loads(path.read_text())
    lines = [
        f"Source: {_source(data, path)}. Measures: {data['measures']}. Checkpoint: {data['model']} architecture,"
        f" random bf16 weights, {data['file_bytes'] / 2**30:.2f} GiB.",
        "",
        "| loading | RssAnon added | of the file | RSS added | seconds | first forward, s |",
        "|---|---|---|---|---|---|",
    ]
    for mode, m in data["median"].items():
        share = m["anon_added_peak_bytes"] / data["file_bytes"]
        lines.append(
            f"| {mode} | {_mib(m['anon_added_peak_bytes'])} | {share:.1%} | {_mib(m['rss_added_peak_bytes'])}"
            f" | {m['seconds']:.1f} | {m['first_forward_seconds']:.2f} |"
        )
    return lines


def overhead_section(path: Path) -> list[str]:
    data = json.loads(path.read_text())
    lines = [
        f"Source: {_source(data, path)}. Measures: {data['measures']}.",
        "",
        "| steps | instrumentation | wall s | CPU s | tokens/s | wall with/without (pairs: median, spread) |"
        " CPU with/without |",
        "|---|---|---|---|---|---|---|",
    ]
    for length in data["lengths"]:
        ratio = length["ratio_with_over_without"]
        for side, m in length["median"].items():
            ratios = (
                " | ".join(
                    f"x{ratio[key]['median']:.3f} ({ratio[key]['min']:.2f}-{ratio[key]['max']:.2f})"
                    for key in ("wall_s", "cpu_s")
                )
                if side == "with"
                else " | "
            )
            lines.append(
                f"| {length['steps']} | {side} | {m['wall_s']:.2f} | {m['cpu_s']:.2f}"
                f" | {m['tokens_per_s']:,.0f} | {ratios} |"
            )
    return lines


def recorded_step_section(path: Path) -> list[str]:
    data = json.loads(path.read_text())
    lines = [
        f"Source: {_source(data, path)}. Measures: {data['measures']}.",
        "",
        "| pair | run | recorded step s | steady step s (median after it) | recorded - steady s | wall s | CPU s |",
        "|---|---|---|---|---|---|---|",
    ]
    for i, pair in enumerate(data["pairs"], start=1):
        for side in ("profiled", "unprofiled"):
            run = pair[side]
            lines.append(
                f"| {i} | {side} | {run['recorded_step_seconds']:.2f} | {run['steady_step_seconds_median']:.2f}"
                f" | {run['recorded_step_extra_seconds']:+.2f} | {run['wall_s']:.1f} | {run['cpu_s']:.1f} |"
            )
    return lines


def accuracy_section(path: Path) -> list[str]:
    data = json.loads(path.read_text())
    warmup = data.get("settings", {}).get("warmup_steps")
    lines = [
        f"Source: {_source(data, path)}. Measures: {data['measures']}"
        + (f" (warm-up: the first {warmup} optimizer steps)." if warmup else "."),
        "",
        "| configuration | script | architecture | predicted | measured | predicted/measured |",
        "|---|---|---|---|---|---|",
    ]
    for r in data["results"]:
        if "error" in r:
            lines.append(f"| {r['name']} | {r['script']} | {r['architecture']} | - | - | failed |")
        else:
            lines.append(
                f"| {r['name']} | {r['script']} | {r['architecture']} | {_gib(r['predicted_bytes'])}"
                f" | {_gib(r['measured_bytes'])} | {r['ratio']:.3f} |"
            )
    return lines


def tests_section(path: Path) -> list[str]:
    """The CUDA tests: each call's outcome of each test, and the reason kept for each failure."""
    data = json.loads(path.read_text())
    lines = [
        f"Source: `profiles/{path.relative_to(PROFILES)}` ({data['device']}; {data['date']};"
        f" torch {data['versions']['torch']}; {data['code']}). {data['architecture']}.",
        "",
    ]
    if "found_later" in data:
        lines += [f"Found after this run: {data['found_later']}.", ""]
    for i, run in enumerate(data["runs"], 1):
        lines += [
            f"Call {i}: {run['call']}; tmp in {run['tmp']}.",
            "",
            "| test | outcome | reason kept |",
            "|---|---|---|",
        ]
        reasons = run.get("failure_reasons", {})
        for test, outcome in run["outcomes"]:
            lines.append(f"| `{test.split('::')[-1]}` | {outcome} | {reasons.get(test, '')} |")
        lines += [f"| `{test.split('::')[-1]}` | did not finish | |" for test in run.get("not_finished", [])] + [""]
    lines += [
        f"- fixed before call 2: `{test.split('::')[-1]}`: {fix}."
        for test, fix in data.get("fixes_between_calls", {}).items()
    ]
    for single in data.get("single_runs", []):
        phases = ", ".join(f"{k} {v:.2f} MiB" for k, v in single["peak_bytes_by_phase_MiB"].items())
        lines.append(
            f"- `{single['command']}` ({single['model']}): {single['seconds_whole_process']} s;"
            f" {single['measures']}: {phases}." + (f" Also: {single['note']}." if "note" in single else "")
        )
    return lines


def check_section(path: Path) -> list[str]:
    """``benchmarks/gpu_check.py``'s calls in one GPU session: each check's outcome and figures, call by call (every
    ``call*/checks.jsonl`` beside ``path``, which is the first's)."""
    calls = sorted(path.parent.parent.glob("call*/checks.jsonl"))
    first = [json.loads(line) for line in path.read_text().splitlines()]
    env = next((c["figures"] for c in first if c["check"] == "environment" and "figures" in c), {})
    lines = [
        f"Source: `profiles/{path.parent.parent.relative_to(PROFILES)}/call*/` (`checks.jsonl`, `summary.txt`, and"
        f" `results.tgz` with every log); {env.get('device', 'device not recorded')}; torch {env.get('torch', '?')},"
        f" bitsandbytes {env.get('bitsandbytes', '?')}, litgpt {env.get('litgpt', '?')}. Command:"
        " `bash benchmarks/gpu_session.sh` (call 1; later calls: `--only` the checks named).",
        "",
        "| call | check | outcome | seconds | figures, or why it failed |",
        "|---|---|---|---|---|",
    ]
    for number, checks in enumerate(calls, 1):
        for check in (json.loads(line) for line in checks.read_text().splitlines()):
            figures = {k: v for k, v in (check.get("figures") or {}).items() if k not in ("explanation", "failures")}
            said = check.get("why") or ", ".join(f"{k} {v}" for k, v in figures.items() if k != "python")
            said += "".join(
                f"; {test.split('::')[-1]}: {why}"
                for test, why in (check.get("figures") or {}).get("failures", {}).items()
            )
            lines.append(
                f"| {number} | {check['check']} | {check['status']} | {check.get('seconds', 0):.0f}"
                f" | {said.replace('|', '/')[:400]} |"
            )
    return lines


def strategies_section(path: Path) -> list[str]:
    data = json.loads(path.read_text())
    settings = data["settings"]
    measures = data["runs"]["1 process"][0]["rank0_peak_tensor_measures"]
    lines = [
        f"Source: {_source(data, path)}. Pretraining {settings['model_name']} (random weights), global batch"
        f" {settings['global_batch_size']} x {settings['length']} tokens, {settings['steps']} steps, medians of"
        f" {settings['repeats']}. Rank 0's peak tensors: {measures}; RSS: rank 0's process.",
        "",
        "| side | tokens/s | x 1 process | rank 0 peak tensors | x 1 process | rank 0 peak RSS |",
        "|---|---|---|---|---|---|",
    ]
    for side, m in data["medians"].items():
        lines.append(
            f"| {side} | {m['tokens_per_s']:,.0f} | x{m['tokens_per_s_ratio']:.2f}"
            f" | {_mib(m['rank0_peak_tensor_bytes'])} | x{m['rank0_peak_tensor_ratio']:.2f}"
            f" | {_mib(m['rank0_peak_rss_bytes'])} |"
        )
    return lines


SECTIONS = [  # (heading, file under profiles/, renderer)
    ("CPU: Memfit against litgpt (finetune_lora)", "cpu/compare_litgpt.json", compare_section),
    # another CPU family: no AVX512-BF16 or AMX, so 16-bit matmuls are emulated there (memfit.training.precision)
    (
        "CPU with AVX2 only: Memfit against litgpt (finetune_lora, 32-true)",
        "cpu/compare_litgpt_avx2.json",
        compare_section,
    ),
    ("CPU with AVX2 only: the tiny model again, 6 repeats", "cpu/compare_litgpt_avx2_tiny6.json", compare_section),
    ("CPU: what the memory instrumentation costs", "cpu/instrumentation_overhead.json", overhead_section),
    ("CPU: the recorded step on a 1.1B model", "cpu/recorded_step_cost_1.1b.json", recorded_step_section),
    ("CPU: loading a checkpoint", "cpu/loading.json", loading_section),
    ("CPU: one process, DDP and FSDP", "cpu/strategies.json", strategies_section),
    ("GPU (H100): the prepared check", "gpu/h100/call1/checks.jsonl", check_section),
    ("GPU (H100): QLoRA 7B, the estimate against the measured peak", "gpu/h100/qlora_7b.json", accuracy_section),
    ("GPU (H100): bf16-mixed, the estimate against the measured peak", "gpu/h100/bf16_mixed.json", accuracy_section),
    (
        "GPU (H100): Memfit against litgpt, QLoRA 7B (call 4: beside the CUDA tests for its first two runs, so its"
        " tokens/s are not a clean comparison; memory is per process)",
        "gpu/h100/call4/compare_litgpt.json",
        compare_section,
    ),
    ("GPU: the CUDA tests", "gpu/pytest_cuda.json", tests_section),
    ("GPU: Memfit against litgpt", "gpu/compare_litgpt.json", compare_section),
    ("GPU: the estimate against the measured peak", "gpu/estimate_accuracy.json", accuracy_section),
    ("GPU: loading a checkpoint", "gpu/loading.json", loading_section),
]


def table() -> str:
    lines = [
        "# Resource table",
        "",
        "Made by `python benchmarks/resource_table.py` from the raw results beside this file; every figure is a",
        "measurement from the JSON file named above its table. The estimate against published GPU figures is in",
        "[published/estimate_vs_published.md](published/estimate_vs_published.md).",
        "",
    ]
    missing = []
    for heading, name, render in SECTIONS:
        path = PROFILES / name
        if not path.is_file():
            missing.append(f"`profiles/{name}`")
            continue
        lines += [f"## {heading}", "", *render(path), ""]
    if missing:
        lines += [
            "## Not measured yet",
            "",
            "No results are committed for: "
            + ", ".join(missing)
            + " (GPU results come from `bash benchmarks/gpu_session.sh` on a GPU machine).",
            "",
        ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--check", action="store_true", help="exit 1 if profiles/README.md is out of date")
    args = parser.parse_args()
    text = table()
    target = PROFILES / "README.md"
    if args.check:
        if not target.is_file() or target.read_text() != text:
            sys.exit("profiles/README.md is not what the results give: run python benchmarks/resource_table.py")
        return
    target.write_text(text)
    print(f"wrote {target}")


if __name__ == "__main__":
    main()
