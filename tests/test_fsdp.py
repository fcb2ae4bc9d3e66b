"""FSDP (torch's second FSDP, ``fully_shard``, through Fabric's ModelParallelStrategy) and several nodes, for real on
CPU processes over gloo: sharded training equals one process, the sharding is real, sharded checkpoints resume
exactly after a SIGKILL, and two nodes started by torchrun or with SLURM's variables train what one process trains.

How equal is equal: the ranks reduce their gradients in another order than one process sums them, so the weights
differ by rounding. AdamW divides each step by the gradient's own running size, so an entry whose gradient is near 0
takes a step of about the learning rate in whichever direction its rounding points: the largest single difference
measures the CPU's reduction order (6 steps of full fine-tuning: 1.4e-7 on an AVX2 CPU, 4.6e-5 on an AVX512-BF16
one), not the sharding. The tests compare instead how far apart two runs' weights are as a fraction of how far the
reference's own training moved them (``_apart``, L2 over every trained weight). Measured on 6 steps of full
fine-tuning (32-true; 64-true does not help, litgpt's RMSNorm computes in float32 whatever the dtype):

| second run against one process | apart |
| --- | --- |
| one process, another accumulation (1 x 8 instead of 2 x 4) | 7.9e-7 |
| FSDP on 2 processes | 7.6e-7 |
| FSDP on 2 processes, both sides with torch's unvectorised kernels (``ATEN_CPU_CAPABILITY=default``) | 9.3e-7 |
| planted: rank 1's loss weighted twice (``tests/planted_defects``) | 0.18 |
| planted: the ranks never reduce their gradients | 1.0 |

``APART`` (1e-3) is a thousand times the rounding and 180 times below the subtler defect;
``test_the_comparison_fails_on_a_planted_defect`` keeps the second half of that true.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from functools import partial

import pytest
import torch

from conftest import ROOT, WEIGHTS, made_once, offline, run_script, run_summary, step_losses

pytestmark = pytest.mark.slow
APART = 1e-3
# 6 steps of a global batch of 8: one process accumulates 4 micro-batches of 2, two ranks 2 each
COMMON = [
    "--accelerator",
    "cpu",
    "--precision",
    "32-true",
    "--train.max_steps",
    "6",
    "--train.global_batch_size",
    "8",
    "--train.micro_batch_size",
    "2",
    "--logger_name",
    "csv",
    "--profile.enabled",
    "false",
    "--eval.interval",
    "1000",
    "--eval.final_validation",
    "false",
]


def _path(script: str) -> str:
    return "pretrain/pretrain" if script == "pretrain" else f"finetune/{script}"


def _train(script: str, cwd, *args, timeout=300, env=None):
    cwd.mkdir(parents=True, exist_ok=True)
    result = run_script(f"{_path(script)}.py", *COMMON, *args, cwd=cwd, timeout=timeout, env=env)
    assert result.returncode == 0, (result.stdout[-2000:], result.stderr[-3000:])
    return result


def _final(run_dir, script: str) -> dict:
    out = "out/pretrain" if script == "pretrain" else f"out/finetune/{script}"
    return torch.load(run_dir / f"{out}/final/{WEIGHTS[script]}", weights_only=True)["model"]


def _largest_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys() and a
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def _distance(a: dict, b: dict) -> float:
    """The L2 norm of ``a - b`` over every tensor (float64)."""
    assert a.keys() == b.keys() and a
    return sum(((a[k].double() - b[k].double()) ** 2).sum().item() for k in a) ** 0.5


def _apart(reference: dict, other: dict, start: dict) -> float:
    """How far ``other``'s weights are from ``reference``'s, as a fraction of how far training moved ``reference``
    from ``start`` (its weights at an earlier step): the module docstring says why not the largest difference."""
    moved = _distance(reference, start)
    assert moved > 0, "the reference did not train"
    return _distance(reference, other) / moved


def _step(run_dir, script: str, step: int) -> dict:
    """The trained weights of a run's step-* checkpoint (one process's: a consolidated file)."""
    out = "out/pretrain" if script == "pretrain" else f"out/finetune/{script}"
    return torch.load(run_dir / f"{out}/step-{step:06d}/{WEIGHTS[script]}", weights_only=True)["model"]


def _apart_from_reference(reference_dir, other_dir, script: str) -> float:
    """``_apart`` of two runs' final weights, the reference's movement counted from its step-1 checkpoint (the
    reference runs with ``--train.save_interval 1``)."""
    return _apart(_final(reference_dir, script), _final(other_dir, script), _step(reference_dir, script, 1))


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, embedded):
    """The reference: each script on one process, the same global batch by accumulation; a checkpoint at every step,
    from which ``_apart_from_reference`` measures how far its training moved the weights."""

    def make(root):
        for script in ("lora", "full"):
            lora = ["--lora_dropout", "0"] if script == "lora" else []
            _train(script, root / script, "--devices", "1", "--train.save_interval", "1", *lora)

    return made_once(tmp_path_factory, "fsdp-one-process", make)


@pytest.mark.parametrize(
    "script, fsdp",
    [
        ("lora", []),
        ("full", []),
        # two of the four blocks checkpointed, each wrapped before it is sharded
        ("full", ["--fsdp.cpu_offload", "true", "--activation_checkpointing", "2"]),
        (
            "lora",
            [
                "--fsdp.cpu_offload",
                "true",
                "--fsdp.sharding_strategy",
                "SHARD_GRAD_OP",
                "--activation_checkpointing",
                "true",
            ],
        ),
    ],
)
def test_fsdp_on_two_processes_trains_what_one_process_trains(tmp_path, one_process, script, fsdp):
    lora = ["--lora_dropout", "0"] if script == "lora" else []  # dropout draws differ by rank
    result = _train(script, tmp_path, "--devices", "2", "--strategy", "fsdp", *fsdp, *lora)
    assert "2 process(es) x 2 micro-batch(es) of 2" in result.stdout
    assert "Peak memory by phase (rank 0's process RSS): load " in result.stdout  # not the run's, nor every rank's
    assert _apart_from_reference(one_process / script, tmp_path, script) < APART
    # the logged loss is the step's, over both ranks: what one process logs
    one, two = step_losses(one_process / script / "out" / "profiles"), step_losses(tmp_path / "out" / "profiles")
    assert len(one) == len(two) == 6 and max(abs(a - b) for a, b in zip(one, two)) < 1e-4, (one, two)


def test_each_ranks_host_memory_is_reported_and_estimated(tmp_path, embedded):
    """Each rank's host memory (its peak RSS), which rank 0 alone could not say, is in the run's closing lines and
    summary, and lies in the range the estimate's "Host memory per rank" line gives for the same flags (the
    tensors' peak, the runtime, and what gloo's threads may keep), 5% either side."""
    from conftest import run_in_process

    flags = [*COMMON, "--devices", "2", "--strategy", "fsdp", "--lora_dropout", "0"]
    estimate = run_in_process("finetune/lora.py", *flags, "--estimate", "true", cwd=tmp_path)
    assert estimate.returncode == 0, estimate.stderr[-2000:]
    line = next(line for line in estimate.stdout.splitlines() if line.startswith("Host memory per rank (peak RSS)"))
    low, high = (float(part.split(" MiB")[0]) * 2**20 for part in line.split(": ")[1].split(" to "))
    (tmp_path / "run").mkdir()
    # new interpreters, as a user's: a process forked from the test's script server shares its pages and reads less
    result = run_script("finetune/lora.py", *flags, "--train.max_steps", "2", cwd=tmp_path / "run", fresh=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (
        "Host memory per rank (peak RSS over the run, validation and saves included; anonymous at the end): rank 0 "
        in result.stdout
    )
    hosts = run_summary(tmp_path / "run/out/profiles")["host_per_rank"]
    assert len(hosts) == 2, hosts
    for rank in hosts:
        assert 0 < rank["anonymous"] <= rank["peak_rss"], rank
        assert 0.95 * low < rank["peak_rss"] < 1.05 * high, (rank["peak_rss"] / 2**20, low / 2**20, high / 2**20)


# torch's, MKL's and oneDNN's plainest x86 kernels, by each library's own switch: sums in another order than this
# CPU's own kernels take, as another CPU family's vector width (AVX512's, AVX2's) gives them
OTHER_KERNELS = {"ATEN_CPU_CAPABILITY": "default", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2", "ONEDNN_MAX_CPU_ISA": "SSE41"}


def test_fsdp_on_other_kernels_trains_what_one_process_trains(tmp_path, one_process):
    """As on another CPU family: the two FSDP processes on other kernels (``OTHER_KERNELS``) than the one-process
    reference still end within ``APART`` of it (measured with torch's kernels alone: 9.3e-7)."""
    _train("full", tmp_path, "--devices", "2", "--strategy", "fsdp", env=OTHER_KERNELS)
    assert _apart_from_reference(one_process / "full", tmp_path, "full") < APART


@pytest.mark.parametrize("script", ["adapter", "adapter_v2", "pretrain"])
def test_every_other_script_trains_under_fsdp_what_one_process_trains(tmp_path, embedded, script):
    """The same flags in every script: adapter, adapter_v2 and pretraining (its model initialised before sharding)
    on 2 FSDP processes end with one process's weights after 2 steps."""
    short = ["--train.max_steps", "2"]
    _train(script, tmp_path / "one", "--devices", "1", *short, "--train.save_interval", "1")
    _train(script, tmp_path / "two", "--devices", "2", "--strategy", "fsdp", *short)
    assert _apart_from_reference(tmp_path / "one", tmp_path / "two", script) < APART


def _measured_args(json_path) -> list[str]:
    """Full fine-tuning whose every micro-batch has the shape the estimate assumes (every embedded sample is longer
    than 32 tokens), profiled at step 3 and checkpointed there."""
    return [
        "--train.max_seq_length",
        "32",
        "--data",
        "JSON",
        "--data.json_path",
        str(json_path),
        "--data.val_split_fraction",
        "0.1",
        "--data.mask_prompt",
        "false",
        "--data.num_workers",
        "0",
        "--profile.enabled",
        "true",
        "--profile.wait",
        "1",
        "--profile.warmup",
        "1",
        "--profile.active",
        "1",
        "--train.save_interval",
        "3",
    ]


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory, embedded):
    """``fsdp_run(N)``: the run dir of full fine-tuning on N FSDP processes (``_measured_args``), made once per session
    and world size: its ledger, its sharded step-3 checkpoint and its final weights serve several tests."""

    def run(world_size: int):
        def make(run_dir):
            _train("full", run_dir, "--devices", str(world_size), "--strategy", "fsdp", *_measured_args(embedded[1]))

        return made_once(tmp_path_factory, f"fsdp-x{world_size}", make)

    return run


def _ledger(run_dir) -> dict:
    import json

    return json.loads(next((run_dir / "out" / "profiles").glob("*/ledger.json")).read_text())


def test_fewer_training_samples_than_ranks_is_one_line_on_every_rank(tmp_path, embedded):
    """One training sample for two ranks left rank 1 with none: it raised StopIteration and rank 0 lost it in a
    collective (two tracebacks). Each rank says it in one line, before anything trains, and nothing is written."""
    (record,) = json.loads(embedded[1].read_text())[:1]
    data = tmp_path / "one.json"
    data.write_text(json.dumps([record]))
    args = ["--data", "JSON", "--data.json_path", str(data), "--data.val_split_fraction", "0"]
    result = run_script(
        "finetune/lora.py",
        *COMMON,
        *("--checkpoint_dir", str(embedded[0]), *args, "--devices", "2", "--strategy", "fsdp"),
        cwd=tmp_path,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    said = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert said and set(said) == {
        f"error: --data JSON ({data}): 1 training sample(s) for 2 processes, and each needs one; give more data or"
        " fewer --devices"
    }, said
    assert not (tmp_path / "out").exists()


def test_an_out_dir_in_use_refuses_every_rank_in_one_line(tmp_path, embedded):
    """Rank 0 takes --out_dir's lock; refused, it ended alone and rank 1 failed in its next collective (a C++ and a
    Python traceback, or Lightning killing a rank: exit 137). Every rank now ends on the refusal, exit 2."""
    from memfit.training.out_dir import OutDirLock

    with OutDirLock(tmp_path / "out") as held:  # another run's lock, as a run holds it
        result = run_script(
            "finetune/lora.py",
            *COMMON,
            *("--devices", "2", "--strategy", "fsdp", "--out_dir", str(tmp_path / "out")),
            cwd=tmp_path,
        )
        assert held.path.read_text() == f"{os.getpid()}\n"
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    said = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(said) == 2 and set(said) == {
        f"error: --out_dir {str(tmp_path / 'out')!r} is in use by another run (pid {os.getpid()}, lock file"
        f" {tmp_path / 'out/.memfit.lock'}); wait for it to finish, or choose another --out_dir"
    }, said


def test_an_out_dir_in_use_ends_in_its_refusal_also_when_rank_0_is_slow_to_exit(tmp_path, embedded):
    """Lightning's watcher in rank 0 killed every process (exit 137, "Killed") when rank 1 ended on the refusal while
    rank 0 was still ending, as on a busy machine: rank 0 is made slow to exit here (7 s in an exit handler, past the
    watcher's 5 s look), and the run still ends on the refusal, exit 2."""
    from memfit.training.out_dir import OutDirLock

    slow = tmp_path / "slow_rank_0"
    slow.mkdir()
    (slow / "sitecustomize.py").write_text(
        "import atexit, os, time\nif os.environ.get('LOCAL_RANK', '0') == '0':\n    atexit.register(time.sleep, 7)\n"
    )
    with OutDirLock(tmp_path / "out"):
        result = run_script(
            "finetune/lora.py",
            *COMMON,
            *("--devices", "2", "--strategy", "fsdp", "--out_dir", str(tmp_path / "out")),
            cwd=tmp_path,
            env={"PYTHONPATH": str(slow)},
        )
    assert result.returncode == 2 and "Traceback" not in result.stderr, (result.returncode, result.stderr[-3000:])
    assert sum(line.startswith("error: --out_dir ") for line in result.stderr.splitlines()) == 2, result.stderr


def test_fsdp_shards_every_parameter_and_its_optimizer_state(fsdp_run, embedded):
    """Each rank holds half of every weight, of AdamW's state and, through gradient accumulation too, of the
    gradients, measured from the live tensors by the ledger: it fails if sharding is silently off (each rank would
    hold the whole model) or the gradients are kept whole between micro-batches. The step-* checkpoint is one file
    of shards per rank, about half the weights and state each."""
    from litgpt import GPT, Config

    config = Config.from_file(embedded[0] / "model_config.yaml")
    run_dir = fsdp_run(2)
    weights = sum(p.numel() for p in GPT(config).parameters()) * 4  # float32 bytes
    ledger = _ledger(run_dir)
    held = ledger["phases"]["zero_grad"]["found_at_peak_bytes"]
    # fully_shard pads each weight's first dimension to a multiple of the world size: a few rows at most
    assert abs(held["params_trainable"] - weights / 2) < 0.01 * weights, (held, weights)
    assert abs(held["optimizer_state"] - weights) < 0.01 * weights, (held, weights)  # two moments of half the weights
    # In backward, with 2 micro-batches a rank: each micro-batch's gradients reduce-scattered into the rank's half
    # (the first's accumulated there, the second's arriving), beside the unsharded gradients of the block or two being
    # reduced; and the gathered weights in their own role: at least the block computing.
    backward = ledger["phases"]["backward"]["found_at_peak_bytes"]
    root = 2 * config.padded_vocab_size * config.n_embd * 4
    block = (weights - root) // config.n_layer
    assert 0.99 * weights / 2 <= backward["gradients"] <= weights / 2 + 2 * block, (backward, weights)
    assert backward["gathered_params"] >= 0.99 * block, (backward, block)
    # the roles explain the step (what gloo's own threads hold, unrecorded by the profiler, is the rest)
    assert sum(backward.values()) >= 0.9 * ledger["phases"]["backward"]["peak_bytes"], backward
    # rank 0's picture states its ledger's peak, in the same phase (gathered weights and all)
    picture = json.loads(next((run_dir / "out" / "profiles").glob("*/summary.json")).read_text())["memory_picture"]
    highest = ledger["phases"][ledger["peak_phase"]]["peak_bytes"]
    assert picture["peak_phase"] == ledger["peak_phase"] and abs(picture["peak_bytes"] - highest) <= 0.01 * highest
    shards = sorted((run_dir / "out/finetune/full/step-000003/sharded").glob("*.distcp"))
    assert [p.name for p in shards] == ["__0_0.distcp", "__1_0.distcp"], shards
    for shard in shards:  # half of the weights and of both moments (3 x weights in all), each
        assert 0.45 * 3 * weights < shard.stat().st_size < 0.55 * 3 * weights + 2**16, shard.stat().st_size


def test_bf16_mixed_gathers_bfloat16_copies_of_float32_shards(tmp_path, embedded):
    """--precision bf16-mixed is FSDP's mixed-precision policy: the gathered blocks and root are bfloat16 (half the
    all-gather and its memory), the shards and their optimizer state stay float32; measured from the live tensors."""
    import json

    from litgpt import GPT, Config

    config = Config.from_file(embedded[0] / "model_config.yaml")
    weights = sum(p.numel() for p in GPT(config).parameters())  # elements
    root = 2 * config.padded_vocab_size * config.n_embd
    block = (weights - root) // config.n_layer
    _train(
        "full",
        tmp_path,
        "--devices",
        "2",
        "--strategy",
        "fsdp",
        "--precision",
        "bf16-mixed",
        "--profile.enabled",
        "true",
        "--train.max_steps",
        "4",
    )
    ledger = json.loads(next((tmp_path / "out" / "profiles").glob("*/ledger.json")).read_text())
    forward = ledger["phases"]["forward"]["found_at_peak_bytes"]
    # bfloat16: the head's unit (the forward's peak is the loss, inside the head) and at most three blocks, under the
    # head and one block in float32, the least a forward gathers. Not two copies of the head: its all-gather buffer is
    # freed before the loss runs (memfit.training.strategy._free_the_deferred_all_gather)
    head = config.padded_vocab_size * config.n_embd
    gathered = forward["gathered_params"]
    assert head * 2 <= gathered <= (head + 3 * block) * 2, (forward, head, block)
    assert gathered < (head + block) * 4, (forward, head, block)
    assert abs(forward["params_trainable"] - weights * 4 / 2) < 0.01 * weights * 4, forward  # float32 shards
    assert abs(forward["optimizer_state"] - weights * 4) < 0.01 * weights * 4, forward


@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL"])
def test_fsdp_resumes_a_sharded_checkpoint_exactly_after_sigkill_and_after_sigterm(tmp_path, embedded, how):
    """LoRA with dropout on: each rank's generators are in the checkpoint. Killed (SIGKILL, the whole process group)
    after its step-3 checkpoint, resumed with --resume true; or preempted by SIGTERM sent to rank 0 alone (the
    process the user started; rank 1 learns it from rank 0), which saves the steps it took and exits 143, resumed with
    --resume auto: either ends with the same weights, bit for bit, as the run left alone."""
    args = ["--devices", "2", "--strategy", "fsdp", "--train.save_interval", "3"]
    _train("lora", tmp_path / "straight", *args)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **offline(tmp_path / "network.log")}
    run = tmp_path / how
    run.mkdir()
    process = subprocess.Popen(
        [sys.executable, str(ROOT / "finetune/lora.py"), *COMMON, *args],
        cwd=run,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    first = run / "out/finetune/lora/step-000003"  # signalled as soon as step 3 is saved, 3 steps before the end
    deadline = time.monotonic() + 240
    while not first.is_dir() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    if how == "SIGKILL":
        os.killpg(process.pid, signal.SIGKILL)
    else:
        process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=120)
    assert first.is_dir() and not (run / "out/finetune/lora/final").exists(), "the run was not stopped mid-way"
    if how == "SIGTERM":
        assert process.returncode == 143 and "Traceback" not in stderr, stderr[-3000:]
        latest = max((run / "out/finetune/lora").glob("step-*")).name
        assert f"Preempted by SIGTERM after step {int(latest[5:])}: saved out/finetune/lora/{latest}" in stderr
        assert [p.name for p in (run / "out/finetune/lora").iterdir() if p.name.startswith(".")] == []
    result = _train("lora", run, *args, "--resume", "true" if how == "SIGKILL" else "auto")
    resumed_at = "step-000003" if how == "SIGKILL" else latest
    assert f"Resumed from out/finetune/lora/{resumed_at} at step {int(resumed_at[5:])}" in result.stdout
    assert _largest_difference(_final(tmp_path / "straight", "lora"), _final(run, "lora")) == 0, how


@pytest.mark.parametrize("devices", ["1", "4"])
def test_fsdp_checkpoint_of_two_processes_resumes_on_one_and_on_four(tmp_path, fsdp_run, embedded, devices):
    """A sharded step-* checkpoint written by 2 processes, resumed with --devices 1 or with --devices 4 (the same
    global batch, other accumulation; a damaged later checkpoint beside it, which the resume passes over)
    global batch, other accumulation): torch reshards it on load, the data continues at the same global sample, and
    the run ends where the 2 processes ended."""
    import shutil

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    two = fsdp_run(2)
    step3 = two / "out/finetune/full/step-000003"
    dcp_to_torch_save(step3 / "sharded", tmp_path / "step3.pth")  # the shards as one file: where the resumes start
    at_step3 = torch.load(tmp_path / "step3.pth", weights_only=True)["model"]
    run = tmp_path / f"on-{devices}"
    shutil.copytree(step3, run / "out/finetune/full/step-000003")
    # a later checkpoint, damaged as a disk or a killed copy leaves one: the resume falls back to step 3 with a
    # warning (a truncated shard raises torch's CheckpointException, a BaseException; a garbage .metadata pickle's
    # UnpicklingError)
    damaged = run / "out/finetune/full/step-000004"
    shutil.copytree(step3, damaged)
    if devices == "1":
        shard = sorted((damaged / "sharded").glob("*.distcp"))[0]
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 3])
    else:
        (damaged / "sharded/.metadata").write_bytes(b"not a pickle at all")
    result = _train(
        "full",
        run,
        "--devices",
        devices,
        "--strategy",
        "fsdp",
        *_measured_args(embedded[1]),
        "--profile.enabled",
        "false",
        "--resume",
        "true",
    )
    assert "Resumed from out/finetune/full/step-000003 at step 3" in result.stdout
    assert "warning: out/finetune/full/step-000004 is damaged" in result.stdout, result.stdout[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert f"{devices} process(es) x {4 // int(devices)} micro-batch(es) of 2" in result.stdout
    assert _apart(_final(two, "full"), _final(run, "full"), at_step3) < APART, devices
    straight, resumed = step_losses(two / "out" / "profiles"), step_losses(run / "out" / "profiles")
    assert max(abs(a - b) for a, b in zip(straight[3:], resumed[-3:])) < 1e-4, (straight, resumed)


def test_fsdp_final_is_litgpt_consolidated_checkpoint(tmp_path, embedded, capsys):
    """final/ of an FSDP LoRA run is one lit_model.pth.lora, the LoRA tensors whole (not shards), which litgpt's
    merge_lora merges into the base and litgpt's generate then runs."""
    from litgpt.generate.base import main as litgpt_generate
    from litgpt.scripts.merge_lora import merge_lora
    from litgpt.utils import lazy_load

    checkpoint_dir, _ = embedded
    _train("lora", tmp_path, "--devices", "2", "--strategy", "fsdp")
    final = tmp_path / "out/finetune/lora/final"
    lora = torch.load(final / "lit_model.pth.lora", weights_only=True)["model"]
    assert lora and all("lora_" in k for k in lora) and not (final / "sharded").exists()
    base = lazy_load(checkpoint_dir / "lit_model.pth")
    qkv = "transformer.h.0.attn.qkv.linear.weight"
    a, b = lora["transformer.h.0.attn.qkv.lora_A"], lora["transformer.h.0.attn.qkv.lora_B"]
    assert a.shape[1] == base["transformer.h.0.attn.qkv.weight"].shape[1]  # whole, not a rank's half
    merge_lora(checkpoint_dir=final)
    merged = lazy_load(final / "lit_model.pth")
    assert not any("lora_" in k for k in merged) and qkv not in merged
    assert not torch.equal(merged["transformer.h.0.attn.qkv.weight"], base["transformer.h.0.attn.qkv.weight"])
    assert b.abs().sum() > 0  # trained
    capsys.readouterr()
    litgpt_generate(checkpoint_dir=final, prompt="reverse: a b c", max_new_tokens=4, num_samples=1)
    assert capsys.readouterr().out.strip()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_nodes(tmp_path, script: str, extra: list[str], launch, planted: dict | None = None, devices: int = 1) -> None:
    """Starts the two nodes of one run together (``launch(rank, port)`` gives each node's command and variables;
    ``planted``: ``_planted``'s variables; ``devices``: processes per node)."""
    port = _free_port()
    tmp_path.mkdir(parents=True, exist_ok=True)
    processes = []
    for rank in range(2):
        command, variables = launch(rank, port)
        guard = offline(tmp_path / "network.log", then=(planted or {}).get("PYTHONPATH"))
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(planted or {}), **guard, **variables}
        processes.append(
            subprocess.Popen(
                [
                    *command,
                    str(ROOT / f"finetune/{script}.py"),
                    *COMMON,
                    *("--devices", str(devices), "--num_nodes", "2"),
                    *extra,
                ],
                cwd=tmp_path,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = [p.communicate(timeout=300)[0] for p in processes]
    assert [p.returncode for p in processes] == [0, 0], [o[-3000:] for o in outputs]
    assert not (tmp_path / "network.log").exists()


def _torchrun(rank: int, port: int, processes: int = 1):
    return (
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "2",
            "--node_rank",
            str(rank),
            "--nproc_per_node",
            str(processes),
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(port),
        ],
        {},
    )


def _memfit_torchrun(tmp_path, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", "memfit.torchrun", "--nnodes", "1", "--nproc_per_node", "2"]
    return subprocess.Popen(
        [*command, str(ROOT / "finetune/lora.py"), *COMMON, "--devices", "2", "--strategy", "fsdp", *args],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_torchrun_ends_a_refused_launch_and_a_sigterm_in_one_line_with_the_runs_status(tmp_path, embedded):
    """torchrun reports a rank's refusal (exit 2) as a ChildFailedError traceback and a SIGTERM it passed on (the
    ranks saved) as a SignalException traceback, exit 1 both. ``python -m memfit.torchrun``, torchrun's own run with
    its ending in one line: 2 for the refusal (HSDP with a --num_nodes the launch does not have), 143 for SIGTERM
    with the steps saved."""
    refused = _memfit_torchrun(tmp_path, "--num_nodes", "2", "--fsdp.sharding_strategy", "HYBRID_SHARD")
    _, stderr = refused.communicate(timeout=300)
    assert refused.returncode == 2 and "Traceback" not in stderr, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if line.startswith(("error: ", "torchrun: "))]
    # the first rank to end, either
    assert lines[-1] in [f"torchrun: rank {r} ended with exit 2; the ranks' lines above say why" for r in (0, 1)], lines
    assert lines[0].startswith("error: --num_nodes 2 --devices 2 ask for 4 processes, but torchrun started 2"), lines

    out = tmp_path / "out"
    running = _memfit_torchrun(
        tmp_path, "--out_dir", str(out), "--train.max_steps", "400", "--train.save_interval", "4"
    )
    deadline = time.monotonic() + 240
    while not (out / "step-000004").exists() and running.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    running.send_signal(signal.SIGTERM)
    _, stderr = running.communicate(timeout=120)
    assert running.returncode == 143 and "Traceback" not in stderr, stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == (
        "torchrun: SIGTERM passed on to every rank; the ranks' lines above say what they saved"
    ), stderr[-2000:]
    (saved,) = [line for line in stderr.splitlines() if line.startswith("Preempted by SIGTERM after step")]
    step = int(saved.split("after step ")[1].split(":")[0])
    assert (out / f"step-{step:06d}").is_dir() and not list(out.glob(".*.tmp")), saved


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_torchrun_nodes_train_what_one_process_trains(tmp_path, one_process, strategy):
    """The README's launch: the same command on each node under torchrun, here two nodes on one machine. torchrun
    starts every process itself, and each names the run in setup(): they take rank 0's name, so both ranks' traces
    are in the one profile dir beside the run's summary (profiling changes no weight: test_training.py)."""
    _two_nodes(tmp_path, "full", ["--strategy", strategy, "--profile.enabled", "true"], _torchrun)
    assert _apart_from_reference(one_process / "full", tmp_path, "full") < APART
    assert run_summary(tmp_path / "out" / "profiles")["world_size"] == 2
    (run_dir,) = (tmp_path / "out" / "profiles").iterdir()
    assert sorted(trace.name.split(".")[0] for trace in run_dir.glob("*.pt.trace.json*")) == ["rank0", "rank1"]


def test_hybrid_sharding_on_two_torchrun_nodes_of_two_processes(tmp_path, one_process):
    """HSDP: --fsdp.sharding_strategy HYBRID_SHARD on two torchrun nodes of 2 processes each (4 ranks) shards within
    a node and replicates across nodes: it trains one process's weights, and its sharded step-3 checkpoint says how
    torch holds every weight and AdamW moment: in two halves (a node's two ranks), not four quarters."""
    import torch.distributed.checkpoint as dcp

    hybrid = ["--strategy", "fsdp", "--fsdp.sharding_strategy", "HYBRID_SHARD", "--train.save_interval", "3"]
    _two_nodes(tmp_path, "full", hybrid, partial(_torchrun, processes=2), devices=2)
    assert _apart_from_reference(one_process / "full", tmp_path, "full") < APART
    assert run_summary(tmp_path / "out" / "profiles")["world_size"] == 4
    saved = dcp.FileSystemReader(tmp_path / "out/finetune/full/step-000003/sharded").read_metadata()
    tensors = {key: item for key, item in saved.state_dict_metadata.items() if hasattr(item, "chunks")}
    weights = [key for key in tensors if key.startswith("model.")]
    assert weights and len(tensors) >= 3 * len(weights)  # each weight and its two moments
    for key, item in tensors.items():
        rows = item.size[0] if len(item.size) else 0
        if rows >= 2:  # a rank's share: half the rows of every tensor
            assert sorted(chunk.sizes[0] for chunk in item.chunks) == [rows // 2, rows - rows // 2], (key, item.chunks)


def _srun(rank: int, port: int):
    """The variables srun sets for task ``rank`` of a 2-node, 1-task-per-node job (Fabric's SLURMEnvironment reads
    them), with no srun: each task runs the plain command."""
    return (
        [sys.executable],
        {
            "SLURM_NTASKS": "2",
            "SLURM_NTASKS_PER_NODE": "1",
            "SLURM_NNODES": "2",
            "SLURM_JOB_ID": "4242",
            "SLURM_JOB_NAME": "memfit",
            "SLURM_NODELIST": "127.0.0.1",
            "SLURM_PROCID": str(rank),
            "SLURM_LOCALID": "0",
            "SLURM_NODEID": str(rank),
            "MASTER_PORT": str(port),
        },
    )


def test_two_slurm_tasks_train_what_one_process_trains(tmp_path, one_process):
    _two_nodes(tmp_path, "full", ["--strategy", "fsdp", "--fsdp.cpu_offload", "true"], _srun)
    assert _apart_from_reference(one_process / "full", tmp_path, "full") < APART


def _planted(defect: str) -> dict:
    """The variables of a run with ``defect`` planted (tests/planted_defects/sitecustomize.py says which exist)."""
    return {"PYTHONPATH": str(ROOT / "tests/planted_defects"), "MEMFIT_TEST_DEFECT": defect}


@pytest.mark.parametrize("defect, launcher", [("rank1_loss_twice", "fabric"), ("no_gradient_sync", "torchrun")])
def test_the_comparison_fails_on_a_planted_defect(tmp_path, one_process, defect, launcher):
    """The comparison the exactness tests above make can fail: FSDP on 2 processes started by Fabric with rank 1's
    loss weighted twice, and on two torchrun nodes whose gradients are never reduced across ranks, end far more than
    ``APART`` from one process (measured: 0.18 and 1.0)."""
    if launcher == "fabric":
        _train("full", tmp_path, "--devices", "2", "--strategy", "fsdp", env=_planted(defect))
    else:
        _two_nodes(tmp_path, "full", ["--strategy", "fsdp"], _torchrun, planted=_planted(defect))
    apart = _apart_from_reference(one_process / "full", tmp_path, "full")
    assert apart > 10 * APART, apart


@pytest.mark.parametrize("world_size", [2, 4])
def test_fsdp_estimate_within_three_percent_of_the_measured_rank_peak(tmp_path, fsdp_run, embedded, world_size):
    """--estimate --strategy fsdp --devices N models the second FSDP (sharded weights, gradients and state; unsharded
    gradients under accumulation: 2 micro-batches a rank at N=2, 1 at N=4; gathered blocks and root) against the
    peak rank 0's ledger measures in a run of N CPU processes, nothing taken off: the ledger puts back the frees of
    gloo's buffers that the profiler does not see (memfit.trace_events.with_unrecorded_frees). The measured peak may
    lie above the prediction by the one block the estimate says gloo's all-gather holds while it runs."""
    from litgpt.data import JSON

    from conftest import load_script, tiny_train
    from memfit.args import ProfileArgs

    estimate = load_script("finetune/full.py").setup(
        estimate=True,
        accelerator="cpu",
        precision="32-true",
        devices=world_size,
        strategy="fsdp",
        train=tiny_train(max_steps=6, max_seq_length=32, global_batch_size=8, micro_batch_size=2),
        data=JSON(json_path=embedded[1], val_split_fraction=0.1, mask_prompt=False, num_workers=0),
        profile=ProfileArgs(wait=1, warmup=1, active=1),
        out_dir=tmp_path / "estimate",
        profile_dir=tmp_path / "est",
    )
    # the ledger is the profiled step's: its peak is the step's, not the last save's (a run phase of its own)
    predicted, gloo = estimate.step_peak, estimate.gloo_buffer
    assert gloo > 0  # a block's bytes, said in the estimate's output

    def within(measured: int) -> bool:  # the prediction, or above it by an all-gather gloo is still running
        return predicted - 0.03 * measured <= measured <= predicted + gloo + 0.03 * measured

    measured, found = _rank_peak(_ledger(fsdp_run(world_size)))
    if not within(measured):
        # a process starved of CPU (CI: 2 workers on 2 cores) can keep a block gathered past its use: a run of its
        # own measures again, and the less disturbed of the two (the lower peak) is compared
        again = tmp_path / "again"
        _train("full", again, "--devices", str(world_size), "--strategy", "fsdp", *_measured_args(embedded[1]))
        measured, found = min((measured, found), _rank_peak(_ledger(again)), key=lambda peak: peak[0])
    print(
        f"full x{world_size}: predicted {predicted / 2**20:.2f} (+{gloo / 2**20:.2f}) MiB, measured {measured / 2**20:.2f}"
    )
    assert within(measured), (predicted, gloo, measured, found)


def test_a_large_vocabulary_is_estimated_and_holds_one_copy_of_its_head(tmp_path, embedded):
    """A model whose embedding and head each outweigh a block (a 16,384-token vocabulary: 16 MiB each in float32,
    beside 3 MiB blocks) on 2 CPU processes, measured against --estimate as the test above does. LoRA: the forward's
    peak is the loss, inside the head's unit, and FSDP's all-gather buffer of the head must not stay beside it as a
    second head (with it: 70.9 MiB measured against 61.0 estimated; without it 62.1; the torchtitan-style peer 63.1).
    Full fine-tuning: backward ends with the embedding gathered again, its whole gradient and the reduce-scatter's copy
    of it, which the estimate prices (measured 136.2 MiB, estimated 136.1; the head's gradient, summed in forward, is a
    gradient there, sharded, not a scratch buffer: 128.1 when it was). With two micro-batches a
    rank, backward's peak is the head's reduction as backward starts, with the activations alive and the first
    micro-batch's gradients sharded: the head's whole gradient, the reduce-scatter's copy and output (estimated 136.9
    MiB), and gloo's own copy of its input, which the estimate states as what gloo may add (measured 153.2)."""
    import torch
    from litgpt import Config
    from litgpt.data import JSON

    from conftest import load_script, tiny_train
    from memfit.args import ProfileArgs
    from memfit.training.random_checkpoints import write_random_checkpoint

    vocabulary, width = 16384, 256
    config = Config.from_name(
        "Llama-3.2-1B",
        n_layer=4,
        n_embd=width,
        n_head=8,
        n_query_groups=8,
        head_size=width // 8,
        intermediate_size=688,
        vocab_size=vocabulary,
        padded_vocab_size=vocabulary,
    )
    config.name = "large-vocabulary"
    checkpoint = write_random_checkpoint(config, tmp_path / "checkpoint", dtype=torch.float32)
    for method, global_batch in (("lora", 4), ("full", 4), ("full", 8)):
        estimate = load_script(f"finetune/{method}.py").setup(
            checkpoint_dir=checkpoint,
            estimate=True,
            accelerator="cpu",
            precision="32-true",
            devices=2,
            strategy="fsdp",
            train=tiny_train(max_steps=6, max_seq_length=32, global_batch_size=global_batch, micro_batch_size=2),
            data=JSON(json_path=embedded[1], val_split_fraction=0.1, mask_prompt=False, num_workers=0),
            profile=ProfileArgs(wait=1, warmup=1, active=1),
            out_dir=tmp_path / f"{method}{global_batch}" / "estimate",
            profile_dir=tmp_path / f"{method}{global_batch}" / "est",
        )
        run_dir = tmp_path / f"{method}{global_batch}" / "run"
        _train(
            method,
            run_dir,
            "--checkpoint_dir",
            str(checkpoint),
            "--devices",
            "2",
            "--strategy",
            "fsdp",
            *_measured_args(embedded[1]),
            "--train.global_batch_size",
            str(global_batch),  # one micro-batch a rank, or two
            "--train.max_steps",
            "3",  # the profiled step is the third
        )
        measured, found = _rank_peak(_ledger(run_dir))
        # the ledger is the profiled step's: its peak is the step's, not the last save's (a run phase of its own)
        predicted, gloo = estimate.step_peak, estimate.gloo_buffer
        print(f"{method} x{global_batch // 4}: measured {measured / 2**20:.1f} MiB, predicted {predicted / 2**20:.1f}")
        # the prediction, or above it by the all-gather gloo may still be running (the test above)
        assert predicted - 0.03 * measured <= measured <= predicted + gloo + 0.03 * measured, (
            method,
            global_batch,
            predicted,
            gloo,
            measured,
            found,
        )


def test_a_trained_head_under_fsdp_takes_the_loss_path_one_device_takes(tmp_path):
    """FSDP2 gives each unit a class of its own (the head's ``FSDPLinear``): the loss took it for another kind of
    head and recomputed each chunk's logits in backward. Pretraining pythia-14m's architecture (a 50k-token head,
    24.56 MiB of float32 weights, beside 6 blocks of 0.8 MiB) on 2 CPU processes: each phase of rank 0's step within
    1% of the estimate, which traces one device's path, or above it by what gloo may be copying at the peak (the
    head's all-gather: measured 217.4 MiB in one forward of four, against 192.8 predicted). Before: backward 267.0
    MiB measured against 181.0, the recomputed logits and their gradient."""
    _pretrain_under_fsdp_as_estimated(tmp_path, [])


@pytest.mark.slow
def test_a_tied_head_under_fsdp_is_estimated_as_its_unit_reduces(tmp_path):
    """The same with the head tied to the embedding (``--train.tie_embeddings true``, Gemma's and Llama-3.2's way):
    one parameter in the root's unit, whose two gradients autograd sums in place, and whose shard the reduce-scatter
    writes only after backward's last moment (``memfit.prediction.estimate.fsdp_phases``). Before: backward 120.5
    MiB measured against 133.4 predicted, the weight's second gradient and its shard counted."""
    _pretrain_under_fsdp_as_estimated(tmp_path, ["--train.tie_embeddings", "true"])


def _pretrain_under_fsdp_as_estimated(tmp_path, more: list[str]) -> None:
    from conftest import run_and_estimate

    flags = ["--model_name", "pythia-14m", "--accelerator", "cpu", "--devices", "2", "--strategy", "fsdp"]
    flags += ["--precision", "32-true", "--train.max_seq_length", "128", "--train.micro_batch_size", "2"]
    flags += ["--train.global_batch_size", "4", "--train.max_steps", "3", *more]
    measured, document = run_and_estimate("pretrain/pretrain.py", flags, tmp_path)
    predicted, gloo = document["phases"], document["gloo_buffer_bytes"]
    for phase in ("forward", "backward", "optimizer_step"):
        want, got = predicted[phase]["peak_bytes"], measured[phase]["peak_bytes"]
        assert 0.99 * want <= got <= want + gloo + 0.01 * want, (
            phase,
            got,
            want,
            measured[phase]["found_at_peak_bytes"],
        )


def _rank_peak(ledger: dict) -> tuple[int, dict]:
    """Rank 0's measured peak (the ledger's highest phase) and what was found alive at it, by role."""
    peak = max(ledger["phases"].values(), key=lambda phase: phase["peak_bytes"])
    return peak["peak_bytes"], peak["found_at_peak_bytes"]


@pytest.fixture(scope="module")
def nf4_shaped(tmp_path_factory, embedded):
    """A litgpt checkpoint dir (random weights, the embedded tokenizer) whose every linear weight NF4 can quantize and
    FSDP can split over 2 processes (whole 64 x 256-value blocks per shard), so one process and two quantize the same
    layers: the embedded tiny model's 128-wide layers are too small for that."""
    import shutil

    import yaml
    from litgpt import GPT, Config

    checkpoint_dir, _ = embedded
    out = tmp_path_factory.mktemp("nf4-shaped")
    config = yaml.safe_load((checkpoint_dir / "model_config.yaml").read_text())
    config.update(name="nf4-shaped-llama", n_embd=256, n_head=4, n_query_groups=4, intermediate_size=512, n_layer=2)
    (out / "model_config.yaml").write_text(yaml.safe_dump(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(checkpoint_dir / name, out / name)
    torch.manual_seed(0)
    model = GPT(Config(**config))
    model.apply(model._init_weights)
    torch.save(model.state_dict(), out / "lit_model.pth")
    return out


def test_qlora_on_two_fsdp_processes_with_a_torchao_nf4_base(tmp_path, embedded, nf4_shaped):
    """QLoRA across devices: --quantize torchao.nf4 --strategy fsdp on 2 processes trains the LoRA weights one
    process trains on the same NF4 base, each rank holding half of the 4-bit weights (the ledger's params_quantized,
    from the live tensors); its losses are bitsandbytes' single-device nf4 QLoRA's within 2%. bitsandbytes' own 4-bit
    weights cannot be sharded (benchmarks/qlora_fsdp_routes.py), and are refused (test_methods.py)."""
    import importlib.util
    import json

    if importlib.util.find_spec("torchao") is None:
        pytest.skip("--quantize torchao.nf4 needs torchao (pip install -e '.[torchao]')")
    data = ["--data", "JSON", "--data.json_path", str(embedded[1]), "--data.val_split_fraction", "0.1"]
    base = ["--checkpoint_dir", str(nf4_shaped), *data, "--lora_dropout", "0", "--profile.enabled", "true"]
    _train("lora", tmp_path / "one", *base, "--devices", "1", "--quantize", "torchao.nf4", "--train.save_interval", "1")
    _train("lora", tmp_path / "two", *base, "--devices", "2", "--strategy", "fsdp", "--quantize", "torchao.nf4")
    _train("lora", tmp_path / "bnb", *base, "--devices", "1", "--quantize", "bnb.nf4")
    assert _apart_from_reference(tmp_path / "one", tmp_path / "two", "lora") < APART

    def quantized(run: str) -> int:
        ledger = json.loads(next((tmp_path / run / "out" / "profiles").glob("*/ledger.json")).read_text())
        return ledger["phases"]["zero_grad"]["found_at_peak_bytes"]["params_quantized"]

    assert quantized("one") > 0 and abs(quantized("two") - quantized("one") / 2) < 0.01 * quantized("one")
    two, bnb = step_losses(tmp_path / "two" / "out" / "profiles"), step_losses(tmp_path / "bnb" / "out" / "profiles")
    assert max(abs(a - b) / b for a, b in zip(two, bnb)) < 0.02, (two, bnb)


def _rss_anon(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as status:
            line = next(line for line in status if line.startswith("RssAnon:"))
        return int(line.split()[1]) * 1024
    except (OSError, StopIteration):
        return None


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as children:
            return [int(child) for child in children.read().split()]
    except OSError:
        return []


def _anonymous_memory_of_loading(command: list[str], cwd, ranks: int) -> list[int]:
    """Each rank's anonymous memory (RssAnon, sampled from /proc every 5 ms) at its highest while the model loads and
    is sharded, above its own reading at "Seed set" (printed just before the data and the model): from there to the
    script's first line after loading, when the run is stopped."""
    import threading

    process = subprocess.Popen(
        command,
        cwd=cwd,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "MALLOC_MMAP_THRESHOLD_": "65536", **offline(cwd / "network.log")},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(process.stdout.readline, "")), daemon=True)
    reader.start()
    base: dict[int, int] = {}
    peak: dict[int, int] = {}
    ranks_seen: set[int] = set()
    deadline = time.monotonic() + 240
    try:
        while not any(" trainable / " in line for line in lines) and process.poll() is None:
            assert time.monotonic() < deadline, lines[-20:]
            seeded = sum("Seed set" in line for line in lines)
            for pid in [process.pid, *_children(process.pid)]:
                anon = _rss_anon(pid)
                if anon is None:
                    continue
                if seeded >= ranks and pid not in base:
                    base[pid] = anon
                    if _is_rank(pid, process.pid):
                        ranks_seen.add(pid)
                if pid in base:
                    peak[pid] = max(peak.get(pid, 0), anon)
            time.sleep(0.005)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        reader.join(timeout=10)
    assert any(" trainable / " in line for line in lines), lines[-20:]
    grown = [peak[pid] - base[pid] for pid in ranks_seen]
    assert len(grown) == ranks, (base, peak)
    return grown


def _is_rank(pid: int, launched: int) -> bool:
    """The launched process (rank 0) and the ranks Fabric starts from it (torch's compile workers are not ranks)."""
    if pid == launched:
        return True
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            line = cmdline.read()
            return b"finetune/" in line or b"pretrain/pretrain.py" in line
    except OSError:
        return False


@pytest.fixture(scope="module")
def bf16_and_float32_checkpoints(tmp_path_factory, embedded):
    """The same random Llama (16 blocks of 3.2 M parameters: 200 MiB in float32) saved in bfloat16 and in float32."""
    from litgpt import Config

    from memfit.training.random_checkpoints import write_random_checkpoint

    config = Config.from_name(
        "Llama-3.2-1B",
        n_layer=16,
        n_embd=512,
        n_head=8,
        n_query_groups=8,
        head_size=64,
        intermediate_size=1376,
        vocab_size=1024,
        padded_vocab_size=1024,
        block_size=2048,  # litgpt builds the rope cache for the whole context first: 64 MiB at Llama-3.2's 131072
    )
    config.name = "sharded-loading"
    root = tmp_path_factory.mktemp("sharded-loading")
    return {
        dtype: write_random_checkpoint(config, root / str(dtype).removeprefix("torch."), dtype=dtype)
        for dtype in (torch.bfloat16, torch.float32)
    }


@pytest.mark.parametrize("world_size, dtypes", [(2, ("bfloat16",)), (2, ("float32",)), (4, ("bfloat16",))])
def test_each_rank_loads_its_share_not_the_model(tmp_path, embedded, bf16_and_float32_checkpoints, world_size, dtypes):
    """Loading for FSDP: every rank memory-maps the checkpoint and keeps only its slice of each weight, cast unit by
    unit as it is sharded, so its anonymous memory grows by its share of the float32 model, a unit's cast copy and a
    fixed allowance, with a dtype change (a bfloat16 checkpoint under 32-true) and without. Before, every rank cast
    the whole model first: a float32 copy of all 200 MiB on each rank."""
    from litgpt import GPT, Config

    checkpoint = bf16_and_float32_checkpoints[torch.float32]
    config = Config.from_file(checkpoint / "model_config.yaml")
    with torch.device("meta"):
        model = GPT(config)
    weights = sum(p.numel() for p in model.parameters()) * 4  # float32 bytes
    block = sum(p.numel() for p in model.transformer.h[0].parameters()) * 4
    allowance = 32 * 2**20  # the tokenizer, the data and the Python objects of the first lines of main()
    for dtype, checkpoint in bf16_and_float32_checkpoints.items():
        if str(dtype).removeprefix("torch.") not in dtypes:
            continue
        command = [
            sys.executable,
            str(ROOT / "finetune/full.py"),
            "--checkpoint_dir",
            str(checkpoint),
            *COMMON,
            *("--devices", str(world_size), "--strategy", "fsdp"),
            *("--data", "JSON", "--data.json_path", str(embedded[1]), "--data.val_split_fraction", "0.05"),
            *("--data.num_workers", "0"),
        ]
        grown = _anonymous_memory_of_loading(command, tmp_path, world_size)
        bound = weights / world_size + block + allowance
        print(
            f"{dtype}, {world_size} ranks: grew {[round(g / 2**20, 1) for g in grown]} MiB, bound {bound / 2**20:.1f}"
        )
        assert max(grown) <= bound, (dtype, grown, bound, weights)


def _on_meta(checkpoint) -> tuple[torch.nn.Module, int]:
    """The checkpoint's architecture on the meta device, and its weights' bytes in float32."""
    from litgpt import GPT, Config

    with torch.device("meta"):
        model = GPT(Config.from_file(checkpoint / "model_config.yaml"))
    return model, sum(p.numel() for p in model.parameters()) * 4


def test_pretraining_from_scratch_initialises_a_ranks_share_not_the_model(
    tmp_path, embedded, bf16_and_float32_checkpoints
):
    """Pretraining from scratch on 2 FSDP ranks: each unit is drawn just before it is sharded
    (``memfit.training.loading.init_from_seed``), so a rank's anonymous memory grows by its share of the model, one unit
    and the allowance. Before, every rank initialised the whole model (200 MiB here) and then sharded it."""
    checkpoint = bf16_and_float32_checkpoints[torch.bfloat16]  # its architecture and tokenizer; no weights are read
    model, weights = _on_meta(checkpoint)
    unit = max(sum(p.numel() for p in m.parameters()) * 4 for m in (model.transformer.h[0], model.lm_head))
    command = [
        sys.executable,
        str(ROOT / "pretrain/pretrain.py"),
        "--checkpoint_dir",
        str(checkpoint),
        *COMMON,
        *("--devices", "2", "--strategy", "fsdp"),
        *("--data", "PlainText", "--data.path", str(embedded[1].with_name("corpus.txt"))),
    ]
    grown = _anonymous_memory_of_loading(command, tmp_path, 2)
    bound = weights / 2 + unit + 32 * 2**20
    print(f"from scratch, 2 ranks: grew {[round(g / 2**20, 1) for g in grown]} MiB, bound {bound / 2**20:.1f}")
    assert max(grown) <= bound, (grown, bound, weights)


def test_a_torchao_nf4_base_is_quantized_a_unit_at_a_time_on_each_rank(
    tmp_path, embedded, bf16_and_float32_checkpoints
):
    """QLoRA across devices (--quantize torchao.nf4 --strategy fsdp) from a bfloat16 checkpoint under 32-true: each
    unit is cast and quantized just before it is sharded, so a rank's anonymous memory grows by at most its share of
    the float32 model, a unit, torchao's temporaries for quantizing the largest weight and the allowance. Before,
    every rank cast the whole base to float32 (200 MiB here) and quantized all of it before sharding (measured: 302
    MiB a rank; after: 177-182)."""
    import importlib.util

    if importlib.util.find_spec("torchao") is None:
        pytest.skip("--quantize torchao.nf4 needs torchao (pip install -e '.[torchao]')")
    checkpoint = bf16_and_float32_checkpoints[torch.bfloat16]
    model, weights = _on_meta(checkpoint)
    block = sum(p.numel() for p in model.transformer.h[0].parameters()) * 4
    # torchao's to_nf4 holds about 33 times its float32 input in temporaries (measured: 99 MiB for a 3 MiB weight),
    # one weight at a time
    largest = max(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear)) * 4
    command = [
        sys.executable,
        str(ROOT / "finetune/lora.py"),
        "--checkpoint_dir",
        str(checkpoint),
        *COMMON,
        *("--devices", "2", "--strategy", "fsdp", "--quantize", "torchao.nf4"),
        *("--data", "JSON", "--data.json_path", str(embedded[1]), "--data.val_split_fraction", "0.05"),
        *("--data.num_workers", "0"),
    ]
    grown = _anonymous_memory_of_loading(command, tmp_path, 2)
    bound = weights / 2 + block + 34 * largest + 32 * 2**20
    print(f"torchao.nf4, 2 ranks: grew {[round(g / 2**20, 1) for g in grown]} MiB, bound {bound / 2**20:.1f}")
    assert max(grown) <= bound, (grown, bound, weights)


def test_a_rank_whose_peer_is_killed_ends_in_one_line(tmp_path, embedded):
    """Two SLURM tasks of one FSDP run; task 1 is killed (SIGKILL, as the host's OOM killer would) after the step-2
    checkpoint: task 0's next collective fails, and it ends, status 1, with a line saying another process ended and
    how to continue, not gloo's "Connection reset by peer" traceback."""
    port = _free_port()
    tasks = []
    for rank in range(2):
        command, variables = _srun(rank, port)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **offline(tmp_path / "network.log"), **variables}
        args = [*COMMON, "--devices", "1", "--num_nodes", "2", "--strategy", "fsdp"]
        args += ["--train.max_steps", "200", "--train.save_interval", "2"]
        tasks.append(
            subprocess.Popen(
                [*command, str(ROOT / "finetune/full.py"), *args],
                cwd=tmp_path,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    saved = tmp_path / "out/finetune/full/step-000002"
    deadline = time.monotonic() + 240
    while not saved.is_dir() and tasks[0].poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert saved.is_dir(), tasks[0].poll()
    tasks[1].kill()
    tasks[1].communicate(timeout=60)
    _, stderr = tasks[0].communicate(timeout=120)
    assert tasks[0].returncode == 1, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    assert "error: another process of this run ended (rank 0 lost it in a collective" in stderr, stderr[-3000:]
    assert "continue with the same launch with: python" in stderr, stderr[-3000:]


def test_the_offload_estimate_puts_a_ranks_shards_on_the_host(tmp_path, fsdp_run, embedded):
    """--fsdp.cpu_offload on GPUs moves each rank's shards of the weights, gradients and optimizer state to the host:
    the estimate's host line for 2 GPUs is what a rank of a real 2-process run holds in those roles at its optimizer
    step (on CPU processes nothing moves, so the ledger measures the same shards where they are), and the device's
    peak no longer holds them."""
    from litgpt.data import JSON

    from conftest import load_script, tiny_train
    from memfit.args import FSDPArgs, ProfileArgs

    def estimate(offload: bool):
        return load_script("finetune/full.py").setup(
            estimate=True,
            accelerator="cuda",
            precision="32-true",
            devices=2,
            strategy="fsdp",
            fsdp=FSDPArgs(cpu_offload=offload),
            train=tiny_train(max_steps=6, max_seq_length=32, global_batch_size=8, micro_batch_size=2),
            data=JSON(json_path=embedded[1], val_split_fraction=0.1, mask_prompt=False, num_workers=0),
            profile=ProfileArgs(wait=1, warmup=1, active=1),
            out_dir=tmp_path / "estimate",
            profile_dir=tmp_path / f"est-{offload}",
        )

    offloaded, on_device = estimate(True), estimate(False)
    host = offloaded.host["offloaded_per_rank"]
    held = _ledger(fsdp_run(2))["phases"]["optimizer_step"]["found_at_peak_bytes"]
    measured = sum(held.get(role, 0) for role in ("params_trainable", "params_frozen", "gradients", "optimizer_state"))
    assert abs(host - measured) <= 0.01 * measured, (host, measured, held)
    assert "offloaded_per_rank" not in on_device.host
    assert offloaded.peak <= on_device.peak - 0.9 * host, (offloaded.peak, on_device.peak, host)


def test_an_out_of_memory_on_one_rank_is_explained_by_that_rank(tmp_path, embedded):
    """Rank 1 alone runs out of memory entering a backward (planted: PyTorch's own error where an allocation would
    fail) on 2 FSDP processes: it says which rank it is, writes what it held to oom/ledger-rank1.json (its shards by
    role, the head unit still gathered, the activations of its one forward graph by block), and rank 0 ends in one
    line instead of waiting in a collective. The ledger read DTensors' storages as invalid and gave up."""
    import json

    result = subprocess.run(
        [sys.executable, str(ROOT / "finetune/full.py"), *COMMON, "--devices", "2", "--strategy", "fsdp"],
        cwd=tmp_path,
        env={**os.environ, **_planted("rank1_out_of_memory")},
        capture_output=True,
        text=True,
        timeout=300,
    )
    err = result.stderr
    assert result.returncode != 0 and "Traceback" not in err, err[-3000:]
    assert "Out of memory in backward at step 2 on cpu (rank 1 of 2): simulated allocation failure" in err, err[-3000:]
    assert "could not read what was alive" not in err, err[-3000:]
    assert "error: another process of this run ended" in err  # rank 0's one line
    (path,) = (tmp_path / "out" / "profiles").glob("*/oom/ledger-rank1.json")
    assert not list((tmp_path / "out" / "profiles").glob("*/oom/ledger.json"))  # rank 0 did not run out
    ledger = json.loads(path.read_text())
    held = ledger["bytes_by_role"]
    assert held["params_trainable"] > 0 and held["optimizer_state"] > 0 and held["gathered_params"] > 0, held
    places = ledger["activations_by_place"]
    assert all(places.get(f"block {i}", 0) > 0 for i in range(4)), places
    assert sum(places.values()) == held["activations"] and ledger["forward_graphs_alive"] == 1, ledger
