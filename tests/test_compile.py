"""--compile true: each transformer block compiled with torch.compile (memfit.training.compiled_blocks) trains as the
eager model does, its compile time said apart, and where it cannot run it is refused in one line."""

import os
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, run_script, script_summary, step_losses, tiny_train

needs_a_compiler = pytest.mark.skipif(
    shutil.which(os.environ.get("CXX", "g++")) is None, reason="inductor needs a C++ compiler on a CPU (g++ or $CXX)"
)


def _final_weights(out_dir) -> dict:
    weights = torch.load(out_dir / "final" / "lit_model.pth", weights_only=True)
    return weights.get("model", weights)


@pytest.mark.slow
@needs_a_compiler
def test_a_compiled_run_trains_as_the_eager_one_and_its_estimate_follows(tmp_path, embedded, capsys):
    """Pretraining (every block the same length: one compilation) 8 steps eager and compiled: the losses agree to
    1e-5 of their size and the weights to 1% of what Adam may move a weight in those steps (lr per step). Not to the
    bit: inductor's fused kernels sum in another order, which moves float32 results in their last bits (measured:
    2.5e-7 of the loss, 3.9e-5 of a weight). The compiled step's estimate (--estimate true --compile true) is below
    the eager one's, as the measured peaks are, and within 5% of the compiled run's (the ledger's CPU tensor memory):
    it runs the partitioned graphs as inductor allocates them, what it fuses uncounted (measured here: 90.02 MiB,
    predicted 90.00; 9.3% above when every operation of the graphs was counted)."""
    from conftest import load_script
    from memfit.args import EvalArgs, ProfileArgs

    train = tiny_train(max_steps=8)
    same = dict(train=train, logger_name="csv", accelerator="cpu", precision="32-true", eval=EvalArgs(max_iters=2))
    eager = script_summary("pretrain/pretrain.py", tmp_path / "eager", profile=ProfileArgs(), **same)
    capsys.readouterr()
    compiled = script_summary(
        "pretrain/pretrain.py", tmp_path / "compiled", profile=ProfileArgs(), compile=True, **same
    )
    assert eager["compile_seconds"] == 0 and compiled["compile_seconds"] > 0
    # compiling is a phase of its own, said as it starts and timed apart from the first step
    printed = capsys.readouterr()
    assert "Compiling: this first step compiles the model's blocks with torch.compile" in printed.out + printed.err
    assert "Compiled in " in printed.out + printed.err and "; the first step, compiling, took " in printed.out
    a, b = step_losses(tmp_path / "eager/profiles"), step_losses(tmp_path / "compiled/profiles")
    assert len(a) == len(b) == 8
    assert max(abs(x - y) / abs(x) for x, y in zip(a, b, strict=True)) < 1e-5, (a, b)
    wa, wb = _final_weights(tmp_path / "eager/out"), _final_weights(tmp_path / "compiled/out")
    assert wa.keys() == wb.keys()  # compiled in place: the same parameter names in the checkpoint
    apart = max((wa[name] - wb[name]).abs().max().item() for name in wa)
    assert apart < 0.01 * train.lr * train.max_steps, apart

    # the ledger names the block that made what is alive at the forward's peak, compiled as eager (a compiled
    # block's kernels have no operator or source line of their own): every block saved the same for backward, less
    # compiled (its partitioner saves fewer tensors and computes cheap ones again)
    import json

    saved = {}
    for run in ("eager", "compiled"):
        (ledger,) = (tmp_path / run / "profiles").glob("*/ledger.json")
        by_block = json.loads(ledger.read_text())["phases"]["forward"]["alive_at_peak_by_block_bytes"]
        saved[run] = [size for name, size in by_block.items() if name.startswith("transformer.h.") and " " not in name]
    assert len(saved["eager"]) == len(saved["compiled"]) >= 2, saved  # every block named, in both runs
    assert len(set(saved["eager"])) == len(set(saved["compiled"])) == 1, saved  # the blocks are alike
    assert 0 < saved["compiled"][0] < saved["eager"][0], saved

    pretrain = load_script("pretrain/pretrain.py")
    predicted = {
        compiles: pretrain.setup(estimate=True, compile=compiles, profile_dir=tmp_path / "estimates", **same).step_peak
        for compiles in (False, True)
    }
    measured = {False: eager["ledger_peak_bytes"], True: compiled["ledger_peak_bytes"]}
    assert measured[True] < measured[False] and predicted[True] < predicted[False], (measured, predicted)
    assert abs(predicted[True] - measured[True]) <= 0.05 * measured[True], (measured, predicted)


def _eager_and_compiled(script: str, flags: list[str], tmp_path) -> tuple[dict, dict, dict]:
    """``script`` with ``flags``, eager then compiled, each run and estimated: by ``--compile``'s value, the ledger's
    peak (CPU tensor memory of the recorded step), the losses of every step, and the estimate's highest step phase."""
    import json

    peaks, losses, predicted = {}, {}, {}
    for compiles in ("false", "true"):
        run = tmp_path / f"compile-{compiles}"
        result = run_script(
            script,
            *flags,
            *("--compile", compiles, "--logger_name", "csv"),
            *("--out_dir", str(run / "out"), "--profile_dir", str(run / "profiles")),
            cwd=tmp_path,
            timeout=600,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        (run_dir,) = (run / "profiles").iterdir()
        peaks[compiles] = json.loads((run_dir / "summary.json").read_text())["ledger_peak_bytes"]
        losses[compiles] = step_losses(run / "profiles")
        estimate = run_script(
            script,
            *flags,
            *("--compile", compiles, "--estimate", "true", "--profile_dir", str(run / "estimate")),
            cwd=tmp_path,
        )
        assert estimate.returncode == 0, estimate.stderr[-3000:]
        (estimate_json,) = (run / "estimate").glob("*/estimate.json")
        document = json.loads(estimate_json.read_text())
        predicted[compiles] = max(phase["peak_bytes"] for phase in document["phases"].values())
    return peaks, losses, predicted


@pytest.mark.slow
@needs_a_compiler
def test_qlora_compiled_trains_as_eager_qlora_and_its_estimate_follows(tmp_path, embedded):
    """QLoRA (bitsandbytes NF4 base, bf16-true) compiled: each 4-bit layer breaks the block's graph (bitsandbytes'
    kernels are not traced), the rest of the block compiles. Every batch 16 x 32 tokens (every embedded sample is
    longer), so LoRA compiles once. The losses of 6 steps agree with eager's to 1% of their size (bf16 rounds to 1 in
    256, and fused kernels round in another order: measured 0.1%); the compiled run's ledger peak is below the eager
    one's, and so is its estimate, within 5% of it."""
    flags = ["--quantize", "bnb.nf4", "--precision", "bf16-true", "--accelerator", "cpu"]
    flags += ["--train.max_seq_length", "32", "--train.micro_batch_size", "16", "--train.global_batch_size", "16"]
    flags += ["--train.max_steps", "6", "--data", "JSON", "--data.json_path", str(embedded[1])]
    flags += ["--data.val_split_fraction", "0.1", "--data.mask_prompt", "false", "--eval.max_iters", "2"]
    peaks, losses, predicted = _eager_and_compiled("finetune/lora.py", flags, tmp_path)
    a, b = losses["false"], losses["true"]
    assert len(a) == len(b) == 6
    assert max(abs(x - y) / abs(x) for x, y in zip(a, b, strict=True)) < 1e-2, (a, b)
    assert peaks["true"] < peaks["false"] and predicted["true"] < predicted["false"], (peaks, predicted)
    assert abs(predicted["true"] - peaks["true"]) <= 0.05 * peaks["true"], (peaks, predicted)


@pytest.mark.slow
@needs_a_compiler
def test_fsdp_compiled_trains_as_eager_fsdp_and_its_estimate_follows(tmp_path, embedded):
    """FSDP2 on 2 CPU processes, full fine-tuning, each block compiled before it is sharded (torchtitan's order;
    FSDP's all-gathers and reduce-scatters run in the hooks around the compiled forward): the losses of 6 steps agree
    with eager FSDP's to 1e-5 of their size, the compiled run's ledger peak is below the eager one's, and so is its
    estimate, within 5% of it (what inductor fuses left uncounted: 12% above when every operation was counted)."""
    flags = ["--accelerator", "cpu", "--devices", "2", "--strategy", "fsdp", "--precision", "32-true"]
    flags += ["--train.max_steps", "6", "--train.global_batch_size", "4", "--train.micro_batch_size", "2"]
    peaks, losses, predicted = _eager_and_compiled("finetune/full.py", flags, tmp_path)
    a, b = losses["false"], losses["true"]
    assert len(a) == len(b) == 6
    assert max(abs(x - y) / abs(x) for x, y in zip(a, b, strict=True)) < 1e-5, (a, b)
    assert peaks["true"] < peaks["false"] and predicted["true"] < predicted["false"], (peaks, predicted)
    assert abs(predicted["true"] - peaks["true"]) <= 0.05 * peaks["true"], (peaks, predicted)


@pytest.mark.slow
def test_compile_on_a_cpu_without_a_cpp_compiler_is_refused_before_training(tmp_path):
    """inductor builds C++ kernels on a CPU: with no compiler ($CXX naming none) the run says so in one line before
    anything is written, where torch's error came as a traceback in the first step."""
    env = {**os.environ, "CXX": str(tmp_path / "no-such-compiler")}
    env.pop("TORCH_INDUCTOR_INSTALL_GXX", None)
    result = subprocess.run(
        [sys.executable, str(ROOT / "finetune/lora.py"), "--compile", "true", "--out_dir", str(tmp_path / "out")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr[-2000:]
    assert "found no C++ compiler" in lines[0]
    assert not (tmp_path / "out").exists()


def test_the_litgpt_pretraining_table_is_its_benchmarks_record():
    """docs/compile.md's table of litgpt's pretraining (which compiles the whole model) beside Memfit's eager and
    compiled is what benchmarks/compile_vs_litgpt.py rendered from its committed record: every run trained the same
    steps."""
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location("compile_vs_litgpt", ROOT / "benchmarks/compile_vs_litgpt.py")
    benchmark = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(benchmark)
    record = json.loads((ROOT / "profiles/cpu/compile_vs_litgpt.json").read_text())
    runs = [run for side in benchmark.SIDES for run in record["runs"][side]]
    assert runs and all("failed" not in run for run in runs)
    # each tool's own count of what it trained: the same steps of the same positions (Memfit's adds a sample's next
    # token)
    assert all(
        0 <= run["tokens"] - run["positions"] <= run["positions"] // record["settings"]["length"] for run in runs
    )
    assert benchmark.table(record) in (ROOT / "docs/compile.md").read_text()


@pytest.mark.parametrize("record_name", ["compile.json", "compile_pythia14m.json"])
def test_the_compile_page_table_is_the_benchmarks_record(record_name):
    """docs/compile.md's tables, the embedded default's and pythia-14m's, are what benchmarks/compile.py rendered from
    its committed records, row for row."""
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location("compile_benchmark", ROOT / "benchmarks/compile.py")
    benchmark = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(benchmark)
    record = json.loads((ROOT / "profiles/cpu" / record_name).read_text())
    assert all(row["eager"]["returncode"] == row["compiled"]["returncode"] == 0 for row in record["rows"])
    assert benchmark.table(record) in (ROOT / "docs/compile.md").read_text()


@pytest.mark.slow
@needs_a_compiler
def test_a_compiled_run_resumed_ends_as_an_uninterrupted_compiled_one(tmp_path, embedded):
    """Full fine-tuning compiled, stopped after step 4 and resumed compiled, ends with the weights of an
    uninterrupted compiled 8-step run (as test_checkpoint.py's eager resume, to the same tolerance)."""
    import shutil

    train = tiny_train(max_steps=8, save_interval=4, lr=1e-3)
    script_summary("finetune/full.py", tmp_path / "straight", train=train, compile=True)
    script_summary("finetune/full.py", tmp_path / "resumed", train=train, compile=True)
    shutil.rmtree(tmp_path / "resumed/out/final")
    shutil.rmtree(tmp_path / "resumed/profiles")
    assert (
        script_summary("finetune/full.py", tmp_path / "resumed", train=train, resume=True, compile=True)["steps"] == 8
    )
    a, b = _final_weights(tmp_path / "straight/out"), _final_weights(tmp_path / "resumed/out")
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-5, atol=1e-6)


def test_the_estimate_allocates_what_inductor_writes_to_memory():
    """A fused kernel's intermediates live in its registers: an outer product summed at once (64 x 64 x 64 float32,
    1 MiB) is never written to memory by inductor, while the sum a matmul reads and the matmul's output are. The
    estimate's backend (``traced_backend``) counts those two alone; the same function run eager makes the product."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memfit.prediction.fake_step import CompilingLiveBytes
    from memfit.training.compiled_blocks import traced_backend

    def outer_then_matmul(x, w):
        return (x.unsqueeze(-1) * x.unsqueeze(-2)).sum(-1) @ w  # (64, 64, 64) summed to (64, 64), then (64, 64)

    peaks = {}
    for compiles in (False, True):
        torch._dynamo.reset()
        live = CompilingLiveBytes()
        with FakeTensorMode(), torch.no_grad():
            x, w = torch.ones(64, 64), torch.ones(64, 64)
            run = (
                torch.compile(outer_then_matmul, backend=traced_backend(live.uncounted))
                if compiles
                else outer_then_matmul
            )
            with live:
                out = run(x, w)
        assert out.shape == (64, 64)
        peaks[compiles] = live.peak
    matrix = 64 * 64 * 4
    assert peaks[False] >= 64 * matrix + matrix, peaks  # the product, and its sum beside it
    assert peaks[True] == 2 * matrix, peaks  # the sum the matmul reads, and the matmul's output


@pytest.mark.slow
@needs_a_compiler
def test_a_compiled_plans_graphs_serve_its_next_lengths_and_micro_batches_to_the_byte(embedded):
    """A planner's search estimates one compiled plan at many sequence lengths and micro-batches: the blocks' graphs
    compiled for the first serve the next (``memfit.prediction.fake_step.CompiledTraces``) until a run compiles, and
    every estimate is the byte count of one compiled afresh, validation included. (The sample's generation compiles
    again for each length: its key-value cache and mask are as long as the sample; the planner's 1.1B search measured
    the same bytes with it, docs/memory.md.)"""
    import dataclasses

    from litgpt import GPT, Config
    from litgpt.model import Block

    from conftest import load_script, one_process_plan
    from memfit.prediction import fake_step
    from memfit.prediction.estimate import estimate
    from memfit.settings.run import ScriptStep
    from memfit.training.compiled_blocks import compile_blocks

    config = Config.from_file(embedded[0] / "model_config.yaml")
    step = load_script("finetune/full.py").train_step
    plan = one_process_plan(
        micro_batch_size=2,
        accumulation=2,
        sequence_length=64,
        validation_length=64,
        precision="bf16-true",
        compile=True,
    )
    # (tokens, micro-batch): the second size makes the batch dynamic, and that graph serves the third at a new length
    settings = [(64, 2), (80, 3), (112, 4)]

    def at(length: int, micro_batch: int):
        return dataclasses.replace(plan.at_length(length), micro_batch_size=micro_batch)

    script = ScriptStep(GPT, Block, config, None, step)
    fake_step.COMPILED_TRACES.compiled_for = None
    reused = [estimate(script, at(*each), whole_step=False).peak for each in settings]
    assert fake_step.COMPILED_TRACES.graphs == 2  # one graph for each of the first two micro-batch sizes
    # a run compiling its blocks in between (a run's estimate, then the run) makes dynamo forget: the next estimate
    # compiles afresh, as each estimate did before, a graph of its own sizes
    compile_blocks(GPT(config), Block)
    assert estimate(ScriptStep(GPT, Block, config, None, step), at(*settings[-1]), whole_step=False).peak == reused[-1]
    assert fake_step.COMPILED_TRACES.graphs == 1
