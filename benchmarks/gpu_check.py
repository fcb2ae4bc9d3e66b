"""The lent GPU's two prepared calls, each under 5 minutes of command time, so that a 15-minute window (a machine start
of 2-4 minutes per call included) brings both back, or one call and a rerun of what failed in it.

    bash benchmarks/gpu_session.sh 1                        # on the GPU machine: wheels, then this with --call 1
    python benchmarks/gpu_check.py --call 1 --rehearse      # here, on the CPU: the same plumbing, CPU-sized

Call 1, the code as it is: the environment and a bitsandbytes CUDA round trip, the 1.1B checkpoint (random weights
drawn on the GPU, in /dev/shm); then two lanes share the card: lane A the CUDA tests (``pytest -m cuda``, six at a
time: every script, every quantizer and precision, partial checkpointing in a two-step profiler window, activation
offloading, FSDP with pinned CPU offload on one GPU, the OOM path, resumes), lane B the estimate's accuracy
(QLoRA on a Llama-2-7B-shaped model; bf16-mixed on a Llama and a Pythia), predicted / measured.

Call 2, the benchmarks: a real out-of-memory with no cap and its first suggestion run, with the card to itself; then
lane A the reverse answer checked on the card (the largest micro-batch that fits a budget, run under that budget
as the card's cap, and the next one up), lane B the README's signature command and its estimate, what the recorded
step costs on 7B QLoRA, and Memfit against litgpt if time is left.

Every process gets what is left of the call's seconds, at most its own limit; a check that cannot start with a
minute left is skipped and says so (``--only NAME`` runs it again). As each check ends it appends one JSON line to
``$OUT/checks.jsonl`` (what a cut-off call still brings back), and the call ends with a one-screen summary
(``summary.txt``) and ``results.tgz``: every log, the benchmarks' JSON, and one real run's ledger, summary and
allocator snapshot (the fixtures of ``tests/test_cuda_run_fixture.py``, under ``tests/data/cuda_run/``).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CALL_SECONDS = 270
"""Every process of a call has ended by then (each gets what is left, at most its own limit); the summary and the
packing take seconds: under 5 minutes of command time"""
TINY_LLAMA = "TinyLlama-1.1B-intermediate-step-1431k-3T"
LLAMA_7B = "Llama-2-7b-hf"
SIGNATURE = "python finetune/lora.py --precision bf16-true --quantize bnb.nf4"
"""The README's main job, exactly as typed there (tests/test_gpu_check.py checks the README still says it)"""


@dataclass
class Session:
    out: Path
    work: Path
    checkpoints: Path
    rehearse: bool
    deadline: float
    """When the last process must have ended: a check's processes get what is left of it, at most their own limit"""
    lock: threading.Lock
    running: set = field(default_factory=set)
    """The checks running now, in either lane: a timing taken beside another check is marked as such"""

    def limit(self, seconds: float) -> float:
        return max(1.0, min(seconds, self.deadline - time.time()))

    def run(self, name: str, command: list[str] | str, limit: float, cwd: Path | None = None, env=None) -> dict:
        """Runs one process of a check, its output in ``logs/<name>.log``; ``returncode`` 124 when stopped."""
        log = self.out / "logs" / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        started = time.time()
        shell = isinstance(command, str)
        with log.open("w") as f:
            f.write(f"$ {command if shell else shlex.join(command)}\n")
            f.flush()
            try:
                completed = subprocess.run(
                    command,
                    shell=shell,
                    cwd=cwd or ROOT,
                    stdout=f,
                    stderr=subprocess.STDOUT,
                    timeout=max(1.0, limit),
                    env={**os.environ, **(env or {})},
                )
                code = completed.returncode
            except subprocess.TimeoutExpired:
                code = 124
                f.write(f"\nstopped after {limit:.0f} s\n")
        text = log.read_text(errors="replace")
        return {"returncode": code, "seconds": round(time.time() - started, 1), "text": text, "log": log.name}

    def record(self, result: dict) -> None:
        with self.lock, (self.out / "checks.jsonl").open("a") as f:
            f.write(json.dumps(result) + "\n")
        print(f"[{time.strftime('%H:%M:%S')}] {result['check']}: {result['status']}", flush=True)


def failed(step: dict, why: str) -> dict:
    return {"status": "fail", "why": why, "tail": step["text"][-1500:], "seconds": step["seconds"]}


def predicted_bytes(text: str) -> float | None:
    if "Predicted peak: " not in text:
        return None
    number, unit = text.split("Predicted peak: ")[1].split()[:2]
    return float(number) * {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}[unit]


def ledger_peak(profile_dir: Path) -> tuple[int, Path] | None:
    ledgers = sorted(profile_dir.glob("*/ledger.json"))
    if not ledgers:
        return None
    ledger = json.loads(ledgers[-1].read_text())
    return max(p["peak_bytes"] for p in ledger["phases"].values()), ledgers[-1].parent


# -- lane B ------------------------------------------------------------------------------------------------------


def check_environment(s: Session) -> dict:
    probe = (
        "import json, platform, importlib.metadata as m, torch\n"
        "out = {'python': platform.python_version(), 'torch': torch.__version__, 'cuda': torch.version.cuda}\n"
        "out.update({p: m.version(p) for p in ('lightning', 'litgpt', 'bitsandbytes', 'jsonargparse',"
        " 'torch-tb-profiler', 'plotly', 'matplotlib', 'tensorboard', 'pytest', 'pytest-xdist')})\n"
        "if torch.cuda.is_available():\n"
        "    import bitsandbytes as bnb, bitsandbytes.functional as F\n"
        "    free, total = torch.cuda.mem_get_info()\n"
        "    out.update(device=torch.cuda.get_device_name(0), free_bytes=free, total_bytes=total)\n"
        "    w = torch.randn(4096, 4096, device='cuda', dtype=torch.bfloat16)\n"
        "    q, state = F.quantize_4bit(w, quant_type='nf4')\n"
        "    back = F.dequantize_4bit(q, state)\n"
        "    out['nf4_relative_error'] = ((back - w).float().norm() / w.float().norm()).item()\n"
        "    layer = bnb.nn.Linear4bit(4096, 4096, compute_dtype=torch.bfloat16, quant_type='nf4').cuda()\n"
        "    y = layer(torch.randn(8, 4096, device='cuda', dtype=torch.bfloat16))\n"
        "    out['linear4bit_finite'] = bool(torch.isfinite(y).all())\n"
        "print('ENV ' + json.dumps(out))\n"
    )
    step = s.run("environment", [sys.executable, "-c", probe], s.limit(90))
    found = [line for line in step["text"].splitlines() if line.startswith("ENV {")]
    if step["returncode"] or not found:
        return failed(step, "the environment probe failed")
    figures = json.loads(found[0].removeprefix("ENV "))
    ok = s.rehearse or (figures.get("nf4_relative_error", 1) < 0.15 and figures.get("linear4bit_finite"))
    return {"status": "pass" if ok else "fail", "figures": figures, "seconds": step["seconds"]}


def write_checkpoints(s: Session, name: str, architectures: list[str]) -> dict:
    """Random-weight checkpoints (drawn on the GPU) in memory (/dev/shm), shared by every check and test."""
    code = (
        "import sys; sys.path.insert(0, sys.argv.pop(1)); from memfit.training.random_checkpoints import random_checkpoint\n"
        "[random_checkpoint(name, sys.argv[1]) for name in sys.argv[2:]]\n"
    )
    root = str(Path(__file__).resolve().parents[1])  # the checkout, whose memfit/ is imported
    step = s.run(name, [sys.executable, "-c", code, root, str(s.checkpoints), *architectures], s.limit(120))
    if step["returncode"]:
        return failed(step, "writing the random checkpoints failed")
    return {"status": "pass", "figures": {"written": architectures}, "seconds": step["seconds"]}


def check_checkpoints(s: Session) -> dict:
    return write_checkpoints(s, "checkpoints", [] if s.rehearse else [TINY_LLAMA])


def check_signature_command(s: Session) -> dict:
    """The README's main job exactly as typed, in a fresh directory (the embedded default), then its estimate."""
    cwd = s.work / "signature"
    shutil.rmtree(cwd, ignore_errors=True)  # as on a fresh clone: no earlier run's out/ (a rerun on a warm machine)
    cwd.mkdir(parents=True)
    command = SIGNATURE.replace("finetune/", f"{ROOT}/finetune/", 1)  # from a directory of its own
    if s.rehearse:
        command += " --train.max_steps 4"
    step = s.run("signature_command", command, s.limit(180), cwd=cwd)
    if step["returncode"]:
        return failed(step, f"exit {step['returncode']}")
    estimate = s.run("signature_estimate", command + " --estimate true", s.limit(90), cwd=cwd)
    measured = ledger_peak(cwd / "out" / "profiles")
    predicted = predicted_bytes(estimate["text"])
    figures = {
        "loss": next((line.strip() for line in step["text"].splitlines() if " -> " in line and "loss" in line), None),
        "train_seconds": step["seconds"],
        "estimate_seconds": estimate["seconds"],
    }
    if measured and predicted:
        figures.update(measured_bytes=measured[0], predicted_bytes=predicted, ratio=round(predicted / measured[0], 3))
        fixtures = s.out / "fixtures"
        fixtures.mkdir(exist_ok=True)
        for name in ("ledger.json", "summary.json", "memory_snapshot.pickle"):
            if (measured[1] / name).is_file():
                shutil.copy2(measured[1] / name, fixtures / name)
    # judged on running: the estimate plans for the data's longest sample, the ledger's step has its own (the QLoRA
    # 7B check compares the two on samples of one length)
    ok = bool(measured and predicted) and estimate["returncode"] == 0
    return {"status": "pass" if ok else "fail", "figures": figures, "seconds": step["seconds"] + estimate["seconds"]}


def estimate_accuracy(s: Session, name: str, configurations: list[str], limit: float) -> dict:
    """Predicted / measured from ``benchmarks/estimate_accuracy.py`` (both sides in one run); pass within 5%."""
    out = s.out / f"{name}.json"
    if s.rehearse:  # the benchmark needs CUDA: the rehearsal runs its estimate half on the CPU's model names
        cwd = s.work / name
        cwd.mkdir(parents=True, exist_ok=True)
        estimate = [sys.executable, str(ROOT / "finetune/lora.py"), "--model_name", LLAMA_7B, "--estimate", "true"]
        step = s.run(name, estimate, limit, cwd=cwd)
        ok = step["returncode"] == 0 and predicted_bytes(step["text"]) is not None
        return {
            "status": "pass" if ok else "fail",
            "figures": {"rehearsal": "estimate only"},
            "seconds": step["seconds"],
        }
    command = [
        sys.executable,
        "benchmarks/estimate_accuracy.py",
        "--only",
        *configurations,
        "--checkpoints",
        str(s.checkpoints),
        "--timeout",
        str(int(limit / 2)),
        "--out",
        str(out),
    ]
    step = s.run(name, command, s.limit(limit))
    if not out.is_file():
        return failed(step, "no results written")
    results = json.loads(out.read_text())["results"]
    ratios = {r["name"]: round(r["ratio"], 3) if "ratio" in r else r.get("error", "")[-300:] for r in results}
    ok = len(results) == len(configurations) and all(
        isinstance(r, float) and abs(r - 1) <= 0.05 for r in ratios.values()
    )
    return {"status": "pass" if ok else "fail", "figures": {"predicted/measured": ratios}, "seconds": step["seconds"]}


def check_qlora_7b(s: Session) -> dict:
    return estimate_accuracy(s, "qlora_7b", ["qlora-7b-512", "qlora-7b-2048"], 150)


def check_bf16_mixed(s: Session) -> dict:
    return estimate_accuracy(s, "bf16_mixed", ["lora-bf16-mixed-1.1b", "lora-bf16-mixed-pythia-1b"], 120)


def check_compare_litgpt(s: Session) -> dict:
    """Memfit and litgpt on the same QLoRA 7B settings (nf4, 4 x 512), one run each, peaks read by the same hook."""
    out = s.out / "compare_litgpt.json"
    device = ["--device", "cpu", "--only", "0", "--steps", "4"] if s.rehearse else ["--device", "cuda", "--only", "1"]
    command = [
        sys.executable,
        "benchmarks/compare_litgpt.py",
        *device,
        "--repeats",
        "1",
        "--warmup_steps",
        "2",
        "--checkpoints",
        str(s.checkpoints),
        "--timeout",
        "150",  # litgpt's 7B QLoRA run did not end in 75 s (Memfit's took 61 s wall, 20 s of it training)
        "--out",
        str(out),
    ]
    if not s.rehearse:
        command += ["--steps", "10"]
    beside = set(s.running) - {"compare_litgpt"}  # tokens/s are a clean comparison only with the card to itself
    step = s.run("compare_litgpt", command, s.limit(320))
    beside |= set(s.running) - {"compare_litgpt"}
    if not out.is_file():
        return failed(step, "no results written")
    (result,) = json.loads(out.read_text())["results"]
    figures = {k: result.get(k) for k in ("tokens_per_s_ratio", "steady_tokens_per_s_ratio", "peak_memory_ratio")}
    figures["failed"] = result.get("failed")
    figures["card_shared_with"] = sorted(beside)  # empty: run alone (--only large_checkpoints compare_litgpt)
    ok = figures["peak_memory_ratio"] is not None and not result.get("failed", {}).get("memfit")
    return {"status": "pass" if ok else "fail", "figures": figures, "seconds": step["seconds"]}


# -- lane A ------------------------------------------------------------------------------------------------------


def check_pytest_cuda(s: Session) -> dict:
    junit = s.out / "pytest_cuda.xml"
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-m",
        "cuda",
        "-ra",
        "-p",
        "no:cacheprovider",
        f"--junitxml={junit}",
        f"--basetemp={s.work / 'pytest'}",
    ]
    # -v: each outcome in the log as it ends, beside the JSON lines
    command += ["--collect-only", "-q"] if s.rehearse else ["-n", "6", "--dist", "load", "--timeout", "150", "-v"]
    reports = s.out / "pytest_cuda.jsonl"
    env = {"MEMFIT_TEST_CHECKPOINTS": str(s.checkpoints), "MEMFIT_TEST_REPORT": str(reports)}
    step = s.run("pytest_cuda", command, s.limit(210), env=env)
    if s.rehearse:
        collected = [line for line in step["text"].splitlines() if line.startswith("tests/test_cuda")]
        ok = step["returncode"] == 0 and len(collected) >= 20
        return {
            "status": "pass" if ok else "fail",
            "figures": {"collected": len(collected)},
            "seconds": step["seconds"],
        }
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from cuda_tests_json import outcomes

    if not junit.is_file():  # stopped at its limit: what ended is in the JSON lines (tests/conftest.py)
        ended = [json.loads(line) for line in reports.read_text().splitlines()] if reports.is_file() else []
        counts = {o: sum(1 for r in ended if r["outcome"] == o) for o in ("passed", "failed", "skipped")}
        reasons = {r["test"]: r["why"] for r in ended if r["outcome"] == "failed"}
        why = f"stopped at its limit after {sum(counts.values())} tests ({counts})"
        return {**failed(step, why), "figures": {**counts, "failures": reasons}}
    s.run(
        "pytest_cuda_json",
        [sys.executable, "benchmarks/cuda_tests_json.py", str(junit), "--out", str(s.out / "pytest_cuda.json")]
        + ["--command", shlex.join(command[command.index("-m") - 1 :]), "--tmp", str(s.work)],
        60,
    )
    results, reasons = outcomes(junit)
    counts = {o: sum(1 for _, outcome in results if outcome == o) for o in ("PASSED", "FAILED", "ERROR", "SKIPPED")}
    ok = step["returncode"] == 0 and counts["FAILED"] == counts["ERROR"] == 0
    return {"status": "pass" if ok else "fail", "figures": {**counts, "failures": reasons}, "seconds": step["seconds"]}


# -- alone ---------------------------------------------------------------------------------------------------------


def long_samples(s: Session) -> Path:
    """Instruction records longer than any sequence length used here, every token counted: each micro-batch then has
    the shape the estimate assumes (benchmarks/estimate_accuracy.py's)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from estimate_accuracy import fixed_length_records

    path = s.work / "long_samples.json"
    if not path.is_file():
        path.write_text(json.dumps(fixed_length_records(256, 2 * 2048)))
    return path


def check_out_of_memory(s: Session) -> dict:
    """A real out-of-memory with no cap, on the card alone: full fine-tuning of the 1.1B model with 64 x 2048-token
    micro-batches (activations of hundreds of GiB: more than any card); then the first setting its explanation
    suggests, run for 2 steps, its ledger's peak against the card's memory."""
    if s.rehearse:  # the same path on the CPU, under an address-space limit (as tests/test_planner.py's)
        from memfit.failure.oom import ADDRESS_SPACE_LIMITED

        base = [
            sys.executable,
            "-c",
            ADDRESS_SPACE_LIMITED,
            str(ROOT / "finetune/full.py"),
            "--train.global_batch_size",
            "1024",
        ]
        failing = ["--train.micro_batch_size", "1024"]
    else:
        from memfit.training.random_checkpoints import random_checkpoint

        base = [
            sys.executable,
            str(ROOT / "finetune/full.py"),
            "--checkpoint_dir",
            str(random_checkpoint(TINY_LLAMA, s.checkpoints)),
            "--precision",
            "bf16-true",
            "--data",
            "JSON",
            "--data.json_path",
            str(long_samples(s)),
            "--data.mask_prompt",
            "false",
            "--data.val_split_fraction",
            "0.05",
            "--train.max_seq_length",
            "2048",
            "--train.global_batch_size",
            "64",
            "--eval.max_iters",
            "1",
        ]
        failing = ["--train.micro_batch_size", "64"]
    base += ["--train.max_steps", "2", "--logger_name", "csv"]
    cwd = s.work / "oom"
    shutil.rmtree(cwd, ignore_errors=True)
    cwd.mkdir(parents=True)
    step = s.run("out_of_memory", base + failing, s.limit(150), cwd=cwd)
    if step["returncode"] != 3 or "The first as flags: " not in step["text"]:
        return failed(step, f"exit {step['returncode']}, not 3 with an explanation")
    flags = step["text"].split("The first as flags: ")[1].splitlines()[0]
    fits = ["--out_dir", str(cwd / "fits"), "--profile_dir", str(cwd / "fits-profiles")]
    first = s.run("first_suggestion", base + flags.split() + fits, s.limit(150), cwd=cwd)
    figures = {
        "explanation": step["text"][step["text"].find("Out of memory in") :][:1500],
        "first_suggestion": flags,
        "first_suggestion_exit": first["returncode"],
    }
    measured = ledger_peak(cwd / "fits-profiles")
    if measured:
        figures["first_suggestion_measured_bytes"] = measured[0]
    ok = first["returncode"] == 0 and "Traceback" not in step["text"]
    return {"status": "pass" if ok else "fail", "figures": figures, "seconds": step["seconds"] + first["seconds"]}


def check_large_checkpoints(s: Session) -> dict:
    return write_checkpoints(s, "large_checkpoints", [] if s.rehearse else [LLAMA_7B, "pythia-1b"])


def check_llama_7b(s: Session) -> dict:
    return write_checkpoints(s, "llama_7b", [] if s.rehearse else [LLAMA_7B])


def check_recorded_step_cost(s: Session) -> dict:
    """What the observatory costs on 7B QLoRA (nf4, bf16-true, 4 x 512 tokens, 8 steps): the recorded step's
    seconds against the median of the steps after it (same run; every sample of the fixed-length records is 512
    tokens, so each step has the same tokens), and the whole process with the profiler window against
    ``--profile.enabled false``, run one after the other."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from recorded_step_cost import recorded_step_figures, tokens_per_s_by_step

    if s.rehearse:
        checkpoint = ["--accelerator", "cpu"]
        micro, length = 2, 64
    else:
        from memfit.training.random_checkpoints import random_checkpoint

        checkpoint = ["--checkpoint_dir", str(random_checkpoint(LLAMA_7B, s.checkpoints)), "--quantize", "bnb.nf4"]
        micro, length = 4, 512
    base = [
        sys.executable,
        str(ROOT / "finetune/lora.py"),
        *checkpoint,
        "--precision",
        "bf16-true",
        "--data",
        "JSON",
        "--data.json_path",
        str(long_samples(s)),
        "--data.mask_prompt",
        "false",
        "--data.val_split_fraction",
        "0.05",
        "--train.micro_batch_size",
        str(micro),
        "--train.global_batch_size",
        str(micro),
        "--train.max_seq_length",
        str(length),
        "--train.max_steps",
        "8",
        "--eval.max_iters",
        "1",
        "--logger_name",
        "csv",
    ]
    beside = set(s.running) - {"recorded_step_cost"}
    figures: dict = {}
    for name, flags in (("profiled", []), ("unprofiled", ["--profile.enabled", "false"])):
        cwd = s.work / f"recorded_step_cost_{name}"
        shutil.rmtree(cwd, ignore_errors=True)
        cwd.mkdir(parents=True)
        step = s.run(f"recorded_step_cost_{name}", base + flags, s.limit(120), cwd=cwd)
        if step["returncode"]:
            return {**failed(step, f"the {name} run: exit {step['returncode']}"), "figures": figures}
        (metrics,) = cwd.glob("out/profiles/*/metrics.csv")
        figures[f"{name}_process_seconds"] = step["seconds"]
        figures[f"{name}_tokens_per_s_by_step"] = {k: round(v, 1) for k, v in tokens_per_s_by_step(metrics).items()}
    from memfit.args import ProfileArgs

    recorded_at = ProfileArgs.default_recorded_step(8)  # the runs' --train.max_steps
    recorded = recorded_step_figures(figures["profiled_tokens_per_s_by_step"], micro * length, recorded_at)
    figures.update({key: value for key, value in recorded.items() if key != "seconds_by_step"})
    figures["process_extra_seconds"] = round(
        figures["profiled_process_seconds"] - figures["unprofiled_process_seconds"], 1
    )
    figures["card_shared_with"] = sorted(beside | (set(s.running) - {"recorded_step_cost"}))
    return {"status": "pass", "figures": figures}


def check_fill_the_card(s: Session) -> dict:
    """The reverse answer on the card: ``--estimate true --memory_budget`` for LoRA on the 1.1B model at 2048 tokens
    gives the largest micro-batch that fits the budget; that micro-batch and the next run for 3 steps with the
    card's memory capped at the budget (``torch.cuda.set_per_process_memory_fraction``). The answer must run with its
    ledger peak inside the allocator reserve the answer keeps; the next must need more (or run out of the cap)."""
    budget_gib = 0.2 if s.rehearse else 24.0  # the rehearsal's answer stays under the 243 training records
    launcher = (  # the cap, then the script as typed
        "import runpy, sys, torch\n"
        "budget = float(sys.argv.pop(1)) * 2**30\n"
        "if torch.cuda.is_available():\n"
        "    torch.cuda.set_per_process_memory_fraction(budget / torch.cuda.mem_get_info()[1])\n"
        "sys.argv = sys.argv[1:]\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n"
    )
    if s.rehearse:
        checkpoint, length = ["--accelerator", "cpu"], "64"
    else:
        from memfit.training.random_checkpoints import random_checkpoint

        checkpoint, length = ["--checkpoint_dir", str(random_checkpoint(TINY_LLAMA, s.checkpoints))], "2048"
    base = [
        str(ROOT / "finetune/lora.py"),
        *checkpoint,
        "--precision",
        "bf16-true",
        "--data",
        "JSON",
        "--data.json_path",
        str(long_samples(s)),
        "--data.mask_prompt",
        "false",
        "--data.val_split_fraction",
        "0.05",
        "--train.max_seq_length",
        length,
        "--eval.max_iters",
        "1",
        "--logger_name",
        "csv",
    ]
    cwd = s.work / "fill_the_card"
    shutil.rmtree(cwd, ignore_errors=True)
    cwd.mkdir(parents=True)
    estimate = s.run(
        "fill_the_card_estimate",
        [sys.executable, *base, "--estimate", "true", "--memory_budget", f"{budget_gib}GiB"],
        s.limit(120),
        cwd=cwd,
    )
    answer = [line.strip() for line in estimate["text"].splitlines() if line.strip().startswith("these settings:")]
    if estimate["returncode"] or not answer or "--train.micro_batch_size " not in answer[0]:
        return failed(estimate, "no largest micro-batch in the estimate's answer")
    micro = int(answer[0].split("--train.micro_batch_size ")[1].split()[0])
    figures: dict = {"budget_gib": budget_gib, "answer": answer[0], "micro_batch_size": micro}
    for name, size in (("answer", micro), ("next", micro + 1)):
        batch = ["--train.micro_batch_size", str(size), "--train.global_batch_size", str(size)]
        place = ["--out_dir", str(cwd / name), "--profile_dir", str(cwd / f"{name}-profiles")]
        step = s.run(
            f"fill_the_card_{name}",
            [sys.executable, "-c", launcher, str(budget_gib), *base, *batch, "--train.max_steps", "3", *place],
            s.limit(120),
            cwd=cwd,
        )
        measured = ledger_peak(cwd / f"{name}-profiles")
        figures[f"{name}_exit"] = step["returncode"]
        figures[f"{name}_measured_bytes"] = measured[0] if measured else None
    reserve = 0.0 if s.rehearse else 0.10  # memfit.settings.budget.reserve_fraction: none against the CPU ledger
    kept = (1 - reserve) * budget_gib * 2**30
    answer_peak, next_peak = figures["answer_measured_bytes"], figures["next_measured_bytes"]
    ok = figures["answer_exit"] == 0 and answer_peak is not None and answer_peak <= kept
    ok = ok and (figures["next_exit"] == 3 or (next_peak is not None and next_peak > kept))
    return {"status": "pass" if ok else "fail", "figures": figures}


def check_compile(s: Session) -> dict:
    """``--compile true`` against eager on the card, ``benchmarks/compile.py``'s rows: full fine-tuning and
    pretraining of pythia-160m's architecture (random weights), 8 steps each, tokens/s, the ledger's peak and the
    estimate of each. Passes where every compiled estimate is within 5% of its measured peak (on the CPU: within 4%,
    docs/compile.md); the speeds are what the planner's COMPILED_STEP_COST takes from torchtune, measured."""
    out = s.out / "compile.json"
    command = [sys.executable, "benchmarks/compile.py", "--recipes", "finetune/full.py", "pretrain/pretrain.py"]
    command += ["--out", str(out)]
    if s.rehearse:
        command += ["--steps", "4", "--accelerator", "cpu"]
    else:
        command += ["--steps", "8", "--accelerator", "cuda", "--model", "pythia-160m"]
    step = s.run("compile", command, s.limit(180))
    if not out.is_file():
        return failed(step, "no results written")
    rows = json.loads(out.read_text())["rows"]
    figures = {}
    for row in rows:
        compiled = row["compiled"]
        ratio = (
            round(row["compiled_estimate_bytes"] / compiled["measured_peak_bytes"], 3)
            if compiled.get("returncode") == 0
            else compiled.get("stderr_tail", "")[-300:]
        )
        speed = row.get("compiled_over_eager", {}).get("tokens_per_s")
        figures[row["recipe"]] = {"compiled_estimate_over_measured": ratio, "tokens_per_s_compiled_over_eager": speed}
    ratios = [figure["compiled_estimate_over_measured"] for figure in figures.values()]
    ok = len(rows) == 2 and all(isinstance(r, float) and abs(r - 1) <= 0.05 for r in ratios)
    return {"status": "pass" if ok else "fail", "figures": figures, "seconds": step["seconds"]}


CALLS = {
    1: (
        # the card to themselves first; then the tests beside the estimate's accuracy
        [("environment", check_environment, 90), ("checkpoints", check_checkpoints, 60)],
        [("pytest_cuda", check_pytest_cuda, 210)],
        [
            ("large_checkpoints", check_large_checkpoints, 90),
            ("qlora_7b", check_qlora_7b, 150),
            ("bf16_mixed", check_bf16_mixed, 120),
        ],
    ),
    2: (
        # the out-of-memory check must not meet another process's memory
        [("checkpoints", check_checkpoints, 60), ("out_of_memory", check_out_of_memory, 120)],
        [("fill_the_card", check_fill_the_card, 150), ("compile", check_compile, 180)],
        [
            ("signature_command", check_signature_command, 120),
            ("llama_7b", check_llama_7b, 60),
            ("recorded_step_cost", check_recorded_step_cost, 180),
            ("compare_litgpt", check_compare_litgpt, 240),
        ],
    ),
}
"""Each call's checks: (first, with the card to themselves; lane A; lane B), each with the seconds it may take"""


def lane(s: Session, checks, only) -> None:
    for name, check, limit in checks:
        if only and name not in only:
            continue
        left = s.deadline - time.time()
        if left < min(limit, 60):
            s.record({"check": name, "status": "skip", "why": f"{left:.0f} s left of the session, {limit} needed"})
            continue
        started = time.time()
        s.running.add(name)
        try:
            result = check(s)
        except Exception as error:  # noqa: BLE001  (one check's bug must not cost the others)
            result = {"status": "fail", "why": f"{type(error).__name__}: {error}"[:500]}
        finally:
            s.running.discard(name)
        result.setdefault("seconds", round(time.time() - started, 1))
        s.record({"check": name, **result})


def summary(out: Path, started: float) -> str:
    code = os.environ.get("MEMFIT_CODE", "the commit was not given (MEMFIT_CODE)")
    lines = [f"GPU check of {code}: {time.time() - started:.0f} s in all; one line per check (checks.jsonl: figures)"]
    for line in (out / "checks.jsonl").read_text().splitlines():
        result = json.loads(line)
        figures = result.get("figures") or {}
        shown = {k: v for k, v in figures.items() if k not in ("explanation", "failures")}
        text = result.get("why") or json.dumps(shown)[:240]
        lines.append(f"  {result['status'].upper():5} {result['check']:<18} {result.get('seconds', 0):>6.0f} s  {text}")
        for test, reason in (figures.get("failures") or {}).items():
            lines.append(f"        {test}: {reason[:160]}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or ROOT / "profiles/gpu/session"))
    parser.add_argument("--rehearse", action="store_true", help="on the CPU: every check's plumbing, CPU-sized")
    parser.add_argument("--only", nargs="*", help="names of the checks to run (default: all)")
    parser.add_argument("--call", type=int, choices=sorted(CALLS), required=True, help="1: tests; 2: benchmarks")
    parser.add_argument("--seconds", type=float, default=CALL_SECONDS, help="when every process must have ended")
    args = parser.parse_args()
    started = time.time()
    sys.path.insert(0, str(ROOT))  # memfit, for the checks that import it here (not installed on the GPU machine)
    fast = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")
    work = Path(os.environ.get("MEMFIT_GPU_WORK") or fast / "memfit-gpu-check")
    work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "checks.jsonl").write_text("")
    os.environ.setdefault("MEMFIT_CACHE", str(work / "cache"))
    os.environ.setdefault("MEMFIT_TEST_CACHE", str(work / "cache"))
    # `python` (the README's commands) and the `litgpt` command are this interpreter's: a GPU image may have only
    # `python3`, and a virtual environment here is not on PATH unless activated
    bin_dir = work / "bin"
    bin_dir.mkdir(exist_ok=True)
    shim = (
        bin_dir / "python"
    )  # a script, not a link: a virtual environment's interpreter finds its packages by its path
    shim.unlink(missing_ok=True)
    shim.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} "$@"\n')
    shim.chmod(0o755)
    os.environ["PATH"] = os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent), os.environ["PATH"]])
    os.environ["PYTHONUNBUFFERED"] = "1"
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    s = Session(args.out, work, work / "checkpoints", args.rehearse, started + args.seconds, threading.Lock())
    first, lane_a, lane_b = CALLS[args.call]
    lane(s, first, args.only)
    lanes = [threading.Thread(target=lane, args=(s, checks, args.only)) for checks in (lane_a, lane_b)]
    for thread in lanes:
        thread.start()
    for thread in lanes:
        thread.join()
    text = summary(args.out, started)
    (args.out / "summary.txt").write_text(text + "\n")
    with tarfile.open(args.out / "results.tgz", "w:gz") as tar:
        for name in ("logs", "fixtures"):
            if (args.out / name).is_dir():
                tar.add(args.out / name, arcname=name)
        for path in [*args.out.glob("*.json"), *args.out.glob("*.jsonl"), *args.out.glob("*.xml")]:
            tar.add(path, arcname=path.name)
    print(text)


if __name__ == "__main__":
    main()
