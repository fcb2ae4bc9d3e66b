"""``python -m memfit.compare``: two real runs of the embedded default, with and without activation checkpointing,
side by side."""

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, run_script

pytestmark = [pytest.mark.xdist_group("compare"), pytest.mark.slow]

FLAGS = ["--precision", "bf16-true", "--quantize", "bnb.nf4", "--train.max_steps", "4"]  # the README's example


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory, embedded):
    """(run dir without checkpointing, run dir with it)"""
    cwd = tmp_path_factory.mktemp("compare")
    dirs = []
    for name, extra in (("plain", []), ("checkpointed", ["--activation_checkpointing", "true"])):
        profiles = cwd / f"profiles-{name}"
        result = run_script(
            "finetune/lora.py", *FLAGS, *extra, "--out_dir", str(cwd / name), "--profile_dir", str(profiles), cwd=cwd
        )
        assert result.returncode == 0, result.stderr[-2000:]
        (run_dir,) = profiles.iterdir()
        dirs.append(run_dir)
    return cwd, dirs


def _compare(*args, cwd):
    return subprocess.run(
        [sys.executable, "-m", "memfit.compare", *map(str, args)],
        cwd=cwd,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


@pytest.fixture(scope="module")
def compared(two_runs):
    """``python -m memfit.compare`` of the two runs, once: what it printed (and wrote under ``<cwd>/out``)"""
    cwd, (plain, checkpointed) = two_runs
    result = _compare(plain, checkpointed, "--out", cwd / "out", cwd=cwd)
    assert result.returncode == 0, result.stderr
    return result


def test_what_checkpointing_saved_is_the_two_ledgers_difference_and_the_one_setting_that_differs(two_runs, compared):
    cwd, (plain, checkpointed) = two_runs
    result = compared
    lines = result.stdout.splitlines()
    settings = lines[lines.index("Settings that differ:") + 1 : lines.index("Settings that differ:") + 2]
    assert settings == ["  --activation_checkpointing: false -> true"], lines[:6]
    assert not any(line.startswith("  --out_dir") for line in lines)  # where a run wrote is not a setting
    ledgers = [json.loads((d / "ledger.json").read_text())["phases"] for d in (plain, checkpointed)]
    header = next(line for line in lines if line.startswith("B - A"))
    phases = header.split()[3:]
    (row,) = [line for line in lines if line.startswith("activations ")]
    shown = dict(zip(phases, row.split()[1::2], strict=True))
    for phase in ("forward", "backward"):
        saved = [ledger[phase]["found_at_peak_bytes"]["activations"] for ledger in ledgers]
        number, unit = row.split()[1 + 2 * phases.index(phase)], row.split()[2 + 2 * phases.index(phase)]
        printed = float(number) * {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit]
        assert saved[1] < saved[0] and shown[phase].startswith("-"), (saved, shown)
        assert abs(printed - (saved[1] - saved[0])) <= 0.01 * abs(saved[1] - saved[0]), (printed, saved)
    page = (cwd / "out/compare.html").read_text()
    assert "plotly" in page and "<script src=" not in page  # the library inside the page: opens offline
    assert (cwd / "out/compare.png").stat().st_size > 10_000
    assert (cwd / "out/compare.txt").read_text().strip() in result.stdout


def test_a_dir_that_recorded_no_step_is_refused_in_one_line(two_runs, tmp_path):
    _, (plain, _) = two_runs
    result = _compare(plain, tmp_path, "--out", tmp_path / "out", cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        f"error: {tmp_path} has no ledger.json: give the run dirs of two runs that recorded a step (out/profiles/<run>,"
        " with the profiler window on), or an --estimate's dir"
    ]
    assert not (tmp_path / "out").exists()


def test_the_readmes_comparison_is_what_the_command_prints(compared):
    """docs/memory.md's "What did a setting save me?" block: the same settings line and the same table, byte for byte
    (the run dirs' names, made of the time and pid, aside)."""
    result = compared
    readme = (ROOT / "docs/memory.md").read_text()
    start = readme.index("A: out/profiles/lora-embedded-")
    block = readme[start : readme.index("```", start)].rstrip("\n").splitlines()
    printed = result.stdout.rstrip("\n").splitlines()
    assert len(block) == len(printed)
    from memfit.training.precision import sixteen_bit_matmul_instructions

    exact = sixteen_bit_matmul_instructions() == README_CPU
    peak_a = _sizes(next(line for line in block if line.startswith("peak A ")))
    for readme_line, line in zip(block[2:-1], printed[2:-1], strict=True):
        if not exact and line.startswith(("unattributed ", "peak B ")):
            # On a CPU with 16-bit matmul instructions torch's bf16 kernels keep other temporaries: the checkpointed
            # run's backward peak is 3.82 MiB on an AVX512-BF16 EPYC, 3.73 in the README (bitsandbytes' own path
            # forced to the README's gives the same 3.82). Every attributed row is still the README's to the byte.
            ours, theirs = _sizes(line), _sizes(readme_line)
            close = [abs(a - b) <= 0.03 * peak for a, b, peak in zip(ours, theirs, peak_a, strict=True)]
            assert line.split()[0] == readme_line.split()[0] and all(close), (line, readme_line)
            continue
        assert line == readme_line, (line, readme_line)


README_CPU = []
"""The 16-bit matmul instructions (``memfit.training.precision.sixteen_bit_matmul_instructions``) of the CPU the
README's comparison was made on, a 2-core AMD EPYC with AVX2 only: on such a CPU the command prints the README's block
byte for byte"""


def _sizes(row: str) -> list[float]:
    """The sizes of a row of the table (an 18-character name, then 15 characters a phase: ``+19.75 KiB``), in bytes."""
    units = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
    cells = [row[i : i + 15].split() for i in range(18, len(row), 15)]
    return [float(number) * units[unit] for number, unit in cells]


def test_a_checkpointed_blocks_recomputed_activations_have_their_role(two_runs, embedded):
    """Backward runs a checkpointed block's forward again: what that keeps for the block's backward is activations
    in the ledger (not unattributed), about one block's share of what the plain run's forward saved, and the
    checkpointed run's backward peak holds little that no role explains."""
    import yaml

    _, (plain, checkpointed) = two_runs
    blocks = yaml.safe_load((embedded[0] / "model_config.yaml").read_text())["n_layer"]
    plain_forward = json.loads((plain / "ledger.json").read_text())["phases"]["forward"]["found_at_peak_bytes"]
    backward = json.loads((checkpointed / "ledger.json").read_text())["phases"]["backward"]["found_at_peak_bytes"]
    one_block = plain_forward["activations"] / blocks
    assert backward["activations"] >= 0.8 * one_block, (backward, one_block)
    assert backward["unattributed"] < backward["activations"], backward


def test_the_comparison_is_in_tensorboard_beside_the_runs(two_runs, compared):
    """TensorBoard, read with its own event reader from the comparison's dir: the picture in the Images tab, the
    table (with the activations' row) in the Text tab."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cwd, _ = two_runs
    assert "TensorBoard's Images and Text tabs" in compared.stdout.splitlines()[-1]
    events = EventAccumulator(str(cwd / "out"), size_guidance={"tensors": 0, "images": 0}).Reload()
    (image,) = events.Images("comparison")
    # drawn for TensorBoard's 640-pixel card, as a run's own picture is, not the 1100-pixel PNG shrunk
    assert image.width == 640 and abs(image.height - 460) <= 1, (image.width, image.height)
    (text,) = events.Tensors("comparison/text_summary")
    assert b"activations" in text.tensor_proto.string_val[0]


def test_a_run_beside_the_estimate_of_its_settings(two_runs):
    """A profile dir and an --estimate's dir: the estimate of the plain run's own settings, set beside its measured
    ledger, differs from it in the --estimate flag alone, says which column is predicted, and its peaks are the
    measured ones within the estimate's 10%."""
    cwd, (plain, _) = two_runs
    result = run_script(
        "finetune/lora.py",
        *FLAGS,
        "--estimate",
        "true",
        "--accelerator",
        "cpu",
        "--profile_dir",
        str(cwd / "est"),
        cwd=cwd,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    (predicted,) = (cwd / "est").glob("lora-estimate-*")
    compared = _compare(plain, predicted, "--out", cwd / "with-estimate", cwd=cwd)
    assert compared.returncode == 0, compared.stderr
    lines = compared.stdout.splitlines()
    table = next(i for i, line in enumerate(lines) if line.startswith("Memory of B against A"))
    settings = lines[lines.index("Settings that differ:") + 1 : table]
    # the run's "auto" found the CPU; the estimate is asked for it by name (an estimate's default is a GPU)
    assert settings == ['  --accelerator: "auto" -> "cpu"'], lines[:7]
    assert "B: predicted for the CPU" in next(line for line in lines if line.startswith("Memory of B against A"))
    row = next(i for i, line in enumerate(lines) if line.startswith("peak A"))
    peak_a, peak_b = lines[row], lines[row + 1]  # then "peak B", then "peak B - A"
    units = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
    measured = [float(v) * units[u] for v, u in zip(peak_a.split()[2::2], peak_a.split()[3::2], strict=True)]
    estimated = [float(v) * units[u] for v, u in zip(peak_b.split()[2::2], peak_b.split()[3::2], strict=True)]
    assert abs(estimated[0] - measured[0]) <= 0.1 * measured[0], (peak_a, peak_b)  # the forward peak, the step's
    # the picture sets the predicted step's curve beside the run's, phase by phase from the last forward (the
    # estimate's axis counts allocations, not ms): what each allocated above its level there agrees too
    from memfit.compare import last_micro_batch_by_phase, read_run, step_curve

    run, prediction = (last_micro_batch_by_phase(step_curve(read_run(d))) for d in (plain, predicted))
    assert [name for *_, name in run["phases"]] == [name for *_, name in prediction["phases"]], (run, prediction)
    assert abs(max(prediction["bytes"]) - max(run["bytes"])) <= 0.1 * max(run["bytes"]), (
        max(prediction["bytes"]),
        max(run["bytes"]),
    )
    page = (cwd / "with-estimate" / "compare.html").read_text()
    assert "an estimate has no clock" in page and (cwd / "with-estimate" / "compare.png").is_file()


def _damaged(run_dir, into, name: str, content: bytes):
    import shutil

    copy = into / f"{run_dir.name}-{name.replace('.', '_')}-{len(content)}"
    shutil.copytree(run_dir, copy)
    target = copy / name if name != "trace" else max(copy.glob("rank0.*.pt.trace.json*"))
    target.write_bytes(content)
    return copy


@pytest.mark.parametrize(
    "name, content, says",
    [
        ("ledger.json", b'{"phases": {"forw', "ledger.json cannot be read as JSON (Unterminated string"),
        ("ledger.json", b"", "ledger.json cannot be read as JSON (Expecting value"),
        ("ledger.json", b"{}", "ledger.json is not a ledger Memfit wrote (no 'measures')"),
        ("ledger.json", b"[1]", "ledger.json holds a JSON list, not the object a Memfit run writes"),
        ("summary.json", b'{"settings": ', "summary.json cannot be read as JSON (Expecting value"),
        ("trace", b"\x1f\x8b\x08\x00", "cannot be read as a profiler trace ("),
    ],
)
def test_a_damaged_ledger_summary_or_trace_is_one_line(two_runs, tmp_path, capsys, name, content, says):
    """A run stopped while writing, or a file damaged since: one line naming the file and what is wrong, no
    traceback, exit 2."""
    from memfit.compare import main

    _, (plain, checkpointed) = two_runs
    damaged = _damaged(checkpointed, tmp_path, name, content)
    code = main([str(plain), str(damaged), "--out", str(tmp_path / "out")])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], lines


def test_an_out_that_is_a_file_or_read_only_is_one_line(two_runs, tmp_path, capsys, disk):
    import subprocess as sp

    from memfit.compare import main

    _, (plain, checkpointed) = two_runs
    (tmp_path / "taken").write_text("mine")
    assert main([str(plain), str(checkpointed), "--out", str(tmp_path / "taken")]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: --out {str(tmp_path / 'taken')!r} is a file; give a directory (compare.png, .html and .txt go in it)"
    ]
    assert (tmp_path / "taken").read_text() == "mine"
    sp.run(["mount", "-o", "remount,ro", str(disk)], check=True)
    assert main([str(plain), str(checkpointed), "--out", str(disk / "out")]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: cannot write the comparison into {str(disk / 'out')!r} (Read-only file system); give --out a"
        " writable directory"
    ]


def test_the_out_dirs_a_user_knows_compare_as_their_run_dirs(two_runs, compared, tmp_path):
    """``python -m memfit.compare out/plain out/checkpointed``: the training --out_dirs (where the checkpoints are)
    find the run dirs that wrote them, through the checkpoint's --profile_dir, and print the same comparison."""
    cwd, _ = two_runs
    result = _compare(cwd / "plain", cwd / "checkpointed", "--out", tmp_path / "out", cwd=cwd)
    assert result.returncode == 0, result.stderr
    # the same comparison; only the lines naming where it was written differ
    ours, theirs = ([line for line in r.stdout.splitlines() if "/out/compare" not in line] for r in (result, compared))
    assert ours == theirs and len(ours) > 10
    elsewhere = tmp_path / "moved"
    (elsewhere / "final").mkdir(parents=True)
    (elsewhere / "final" / "hyperparameters.yaml").write_text(f"profile_dir: {cwd / 'profiles-plain'}\n")
    refused = _compare(elsewhere, cwd / "checkpointed", cwd=cwd)
    lines = refused.stderr.strip().splitlines()
    assert refused.returncode == 2 and len(lines) == 1, refused.stderr
    assert "is a training --out_dir, and no run dir in its --profile_dir" in lines[0]
