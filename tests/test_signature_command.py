"""The README's main job, as a user runs it: `python finetune/lora.py --precision bf16-true --quantize bnb.nf4`."""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
import torch
import yaml

from conftest import run_script, run_summary

pytestmark = pytest.mark.xdist_group("signature_run")  # one worker makes the module's run once, for all its tests


def test_the_modules_tests_share_one_worker(request):
    """The run below is made once only if pytest-xdist keeps this module's tests on one worker (``--dist loadgroup``;
    pytest 9.2 stopped that silently, pytest-xdist issue 1386: the run was made twice, 75 s more)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        assert request.node.nodeid.endswith("@signature_run"), request.node.nodeid


@pytest.fixture(scope="module")
def signature_run(tmp_path_factory, embedded):
    cwd = tmp_path_factory.mktemp("signature")
    result = run_script("finetune/lora.py", "--precision", "bf16-true", "--quantize", "bnb.nf4", cwd=cwd)  # offline
    assert result.returncode == 0, result.stderr[-3000:]
    return cwd, result


def test_trains_embedded_nf4_model_and_loss_falls(signature_run):
    cwd, result = signature_run
    summary = run_summary(cwd / "profiles")
    assert summary["steps"] == 80
    # The loss is on answers only: a clear fall, not noise.
    assert summary["last_loss"] < summary["first_loss"] - 1.5, summary
    assert summary["val_loss"] < summary["first_loss"] - 1.5, summary
    assert summary["tokens_per_s"] > 0
    assert set(summary["memory"]["peak_bytes"]) >= {"load", "forward", "backward", "optimizer_step"}
    assert summary["memory"]["measures"] == "cpu_rss"
    out = result.stdout
    assert "Peak memory by phase (process RSS)" in out and "optimizer_step" in out
    assert "Profile:" in out and "Checkpoint:" in out
    assert "kernels-community" not in result.stderr  # bitsandbytes is not let near the Hub (test_trust.py)


def _nf4_bytes(checkpoint_dir) -> tuple[int, int]:
    """What the linear weights of the checkpoint take packed as nf4 (4 bits each plus one float32 absmax per block
    of 64), and in bf16: computed from the config alone, not from Memfit's tensors."""
    from litgpt import Config

    c = Config.from_file(checkpoint_dir / "model_config.yaml")
    qkv = (c.n_head + 2 * c.n_query_groups) * c.head_size
    per_block = c.n_embd * qkv + c.head_size * c.n_head * c.n_embd + 3 * c.n_embd * c.intermediate_size
    n = c.n_layer * per_block + c.n_embd * c.padded_vocab_size  # and the head
    return n // 2 + n // 64 * 4, 2 * n


def test_base_is_really_4bit(signature_run, embedded):
    """The frozen base was quantized: the ledger's quantized parameters, measured from the run's real tensors, take
    the nf4 size of every linear weight, a quarter of their bf16 size."""
    cwd, _ = signature_run
    (run_dir,) = (cwd / "profiles").iterdir()
    ledger = json.loads((run_dir / "ledger.json").read_text())
    quantized = ledger["phases"]["forward"]["found_at_peak_bytes"]["params_quantized"]
    nf4, bf16 = _nf4_bytes(embedded[0])
    assert abs(quantized - nf4) <= 0.02 * nf4, (quantized, nf4, bf16)


def test_checkpoints_are_lora_only_with_hyperparameters(signature_run):
    cwd, _ = signature_run
    out_dir = cwd / "out" / "finetune" / "lora"
    assert sorted(p.name for p in out_dir.iterdir()) == ["final", "step-000040"]
    for ckpt in out_dir.iterdir():
        weights = torch.load(ckpt / "lit_model.pth.lora", weights_only=True)["model"]
        assert weights and all("lora_" in k for k in weights), list(weights)[:5]
        hparams = yaml.safe_load((ckpt / "hyperparameters.yaml").read_text())
        assert hparams["quantize"] == "bnb.nf4" and hparams["precision"] == "bf16-true"
        assert (ckpt / "model_config.yaml").is_file() and (ckpt / "tokenizer.json").is_file()


def test_scalars_logged_per_step(signature_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cwd, _ = signature_run
    (run_dir,) = (cwd / "profiles").iterdir()
    events = EventAccumulator(str(run_dir)).Reload()
    tags = set(events.Tags()["scalars"])
    assert {
        "loss",
        "learning_rate",
        "tokens_per_s",
        "memory/cpu_rss_gib",
        "memory/cpu_peak_rss_gib",
        "memory/step_peak_gib",
    } <= tags
    assert len(events.Scalars("loss")) == 80
    lrs = [e.value for e in events.Scalars("learning_rate")]
    assert lrs[0] < max(lrs) and lrs[-1] < max(lrs)  # warm-up, then decay


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get_json(url: str):
    request = urllib.request.Request(url, headers={"Accept-Encoding": "identity"})
    with urllib.request.urlopen(request, timeout=10) as response:
        body = response.read()
        if response.headers.get("Content-Encoding") == "gzip":
            import gzip

            body = gzip.decompress(body)
        return json.loads(body)


def test_memory_view_in_a_real_tensorboard_server(signature_run):
    """Starts TensorBoard on a loopback port and reads the PyTorch Profiler plugin's Memory view over HTTP."""
    cwd, _ = signature_run
    port = _free_port()
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tensorboard.main",
            "--logdir",
            str(cwd / "profiles"),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}/data/plugin/pytorch_profiler"
    try:
        deadline, runs = time.monotonic() + 90, []
        while time.monotonic() < deadline:
            try:
                data = _get_json(f"{base}/runs")
                runs = data["runs"]
                if runs and not data["loading"]:
                    break
            except OSError:
                pass
            time.sleep(1)
        (run,) = runs
        assert run.startswith("lora-embedded-")
        assert "Memory" in _get_json(f"{base}/views?run={run}")
        (worker,) = _get_json(f"{base}/workers?run={run}&view=Memory")
        span = _get_json(f"{base}/spans?run={run}&worker={worker}")[0]
        memory = _get_json(f"{base}/memory?run={run}&worker={worker}&span={span}")
        rows = memory["rows"]["CPU"]
        columns = [c["name"] for c in memory["columns"]]
        size = columns.index("Size Increase (KB)")
        allocations = columns.index("Allocation Size (KB)")
        ops = {row[0] for row in rows}
        assert {"aten::mm", "aten::empty"} & ops, sorted(ops)[:20]
        assert any(row[allocations] > 0 for row in rows)
        assert any(abs(row[size]) > 0 for row in rows)
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_ledger_attributes_the_allocations_alive_at_each_peak(signature_run, embedded):
    """ledger.json: at each phase's peak, the live allocations attributed by address to a role or unattributed;
    what was found is set against the measured peak (not made to add up); TensorBoard has it."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from memfit.roles import ROLES

    cwd, result = signature_run
    (run_dir,) = (cwd / "profiles").iterdir()
    ledger = json.loads((run_dir / "ledger.json").read_text())
    assert ledger["complete"] and ledger["measures"] == "CPU tensor memory from profiler events"
    phases = ledger["phases"]
    assert set(phases) == {"forward", "backward", "optimizer_step", "zero_grad"}
    for name, phase in phases.items():
        assert set(phase["found_at_peak_bytes"]) == set(ROLES) | {"unattributed"}, name
        assert abs(phase["not_found_bytes"]) <= 0.01 * phase["peak_bytes"], name
        assert phase["biggest_at_peak"], name
    forward = phases["forward"]["found_at_peak_bytes"]
    assert forward["activations"] > 0 and forward["unattributed"] > 0  # the logits chunks are nobody's
    assert forward["params_quantized"] >= 0.98 * _nf4_bytes(embedded[0])[0]
    assert phases["optimizer_step"]["found_at_peak_bytes"]["optimizer_state"] > 0
    assert phases["zero_grad"]["end_bytes"] < phases["optimizer_step"]["end_bytes"]  # gradients freed
    made_in_step = [a for a in phases["forward"]["biggest_at_peak"] if a["op"] != "allocated before the step"]
    assert made_in_step and all(a["op"].startswith("aten::") and ".py(" in a["source"] for a in made_in_step)
    assert "Memory ledger of one optimizer step" in result.stdout and "Biggest allocations alive" in result.stdout
    events = EventAccumulator(str(run_dir)).Reload()
    assert "ledger/forward/activations_gib" in events.Tags()["scalars"]
    assert any("memory_ledger" in tag for tag in events.Tags()["tensors"])


def test_an_allocation_no_role_owns_is_unattributed_and_named(tmp_path, embedded, monkeypatch):
    """The ledger can be wrong, and says so: a buffer the loss keeps alive (no parameter, gradient, optimizer
    state or saved activation) is found as unattributed, named by its operator and source line."""
    import torch

    from conftest import load_script, tiny_train
    from memfit.profiling import ProfileArgs

    lora = load_script("finetune/lora.py")
    kept, original = [], lora.loss_fn

    def loss_fn_keeping_a_buffer(model, batch):
        kept.append(torch.ones(2**21))  # 8 MiB, alive to the end of the run
        return original(model, batch)

    monkeypatch.setattr(lora, "loss_fn", loss_fn_keeping_a_buffer)
    lora.setup(
        out_dir=tmp_path / "out",
        profile_dir=tmp_path / "profiles",
        logger_name="csv",
        train=tiny_train(max_steps=4),
        profile=ProfileArgs(wait=1, warmup=1, active=1),
    )
    (run_dir,) = (tmp_path / "profiles").iterdir()
    forward = json.loads((run_dir / "ledger.json").read_text())["phases"]["forward"]
    # both micro-batches of the recorded step kept one; the ones from earlier steps predate the trace
    assert forward["found_at_peak_bytes"]["unattributed"] >= 2 * 2**23
    top = forward["biggest_at_peak"][:2]
    assert all(a["bytes"] == 2**23 and a["role"] == "unattributed" and a["op"] == "aten::ones" for a in top), top
    assert all("loss_fn_keeping_a_buffer" in a["source"] for a in top), top
    (trace,) = run_dir.glob("*.pt.trace.json")
    assert '"Input Dims"' not in trace.read_text()  # shapes are recorded only when asked for


def test_record_shapes_puts_input_shapes_in_the_trace(tmp_path):
    from conftest import load_script, tiny_train
    from memfit.profiling import ProfileArgs

    load_script("finetune/lora.py").setup(
        out_dir=tmp_path / "out",
        profile_dir=tmp_path / "profiles",
        logger_name="csv",
        train=tiny_train(max_steps=2),
        profile=ProfileArgs(wait=1, warmup=0, active=1, record_shapes=True),
    )
    (trace,) = (tmp_path / "profiles").glob("*/*.pt.trace.json")
    assert '"Input Dims"' in trace.read_text()


def test_the_step_is_drawn_as_a_picture_that_needs_no_network(signature_run):
    """memory_step.png: the profiled step's tensor memory over time with the phases, drawn from the trace with
    matplotlib (no web resources), stating the ledger's peak; also in TensorBoard's Images tab."""
    import matplotlib.image
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cwd, result = signature_run
    (run_dir,) = (cwd / "profiles").iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    picture = summary["memory_picture"]
    image = matplotlib.image.imread(run_dir / "memory_step.png")
    assert image.shape[0] >= 300 and image.shape[1] >= 800 and image[..., :3].std() > 0.05  # drawn, not blank
    ledger = json.loads((run_dir / "ledger.json").read_text())
    highest = ledger["phases"][ledger["peak_phase"]]
    assert picture["peak_phase"] == ledger["peak_phase"]
    assert abs(picture["peak_bytes"] - highest["peak_bytes"]) <= 0.01 * highest["peak_bytes"]
    assert "Picture:" in result.stdout
    assert "memory_step" in EventAccumulator(str(run_dir)).Reload().Tags()["images"]


def test_allocator_blocks_alive_before_the_step_that_hold_no_role_are_listed():
    """On CUDA the ledger reads the allocator's snapshot when the step begins: live blocks at no role tensor's address
    (PyTorch's cuBLAS workspaces, say) are listed with their sizes; free blocks and the roles' own are not. The
    segments are in ``torch.cuda.memory_snapshot()``'s shape (blocks laid out one after another from the segment's
    address); this machine has no CUDA allocator to take one from."""
    from memfit.allocator_snapshot import blocks_without_role
    from memfit.ledger import Ledger, PhaseRecord

    mib = 2**20
    segments = [
        {
            "device": 0,
            "address": 0x1000_0000,
            "total_size": 96 * mib,
            "blocks": [
                {"state": "active_allocated", "size": 32 * mib, "requested_size": 32 * mib},  # at 0x1000_0000: a weight
                {"state": "inactive", "size": 16 * mib},
                {"state": "active_allocated", "size": 32 * mib, "requested_size": 32 * mib - 512},  # a workspace
                {"state": "active_pending_free", "size": 16 * mib},
            ],
        },
        {
            "device": 0,
            "address": 0x2000_0000,
            "total_size": 2 * mib,
            "blocks": [{"state": "active_allocated", "size": 2 * mib, "requested_size": 1 * mib}],
        },  # an RNG state, say
    ]
    known = {0x1000_0000: ("params_frozen", 32 * mib)}
    assert sorted(blocks_without_role(segments, known).values(), reverse=True) == [32 * mib - 512, 1 * mib]
    assert list(blocks_without_role(segments, {**known, 0x1000_0000 + 48 * mib: ("gradients", 32 * mib)}).values()) == [
        1 * mib
    ]

    ledger = Ledger(device="cuda", measures="CUDA allocated", roleless_before_step={0x1: 32 * mib, 0x2: 32 * mib})
    ledger.phases["forward"] = PhaseRecord(start=0, end=0, peak=75 * mib, reserved=0, roles_at_end={}, activations=0)
    ledger.complete = True
    assert (
        "Alive since before the step and no parameter, gradient or optimizer state (CUDA allocator blocks):"
        " 64.00 MiB in 32.00 MiB, 32.00 MiB" in ledger.table()
    )
    assert ledger.as_dict()["before_step_without_role_bytes"] == [32 * mib, 32 * mib]


def test_the_ledger_explains_the_step_with_the_longest_sample(signature_run):
    """The profiled step holds the run's longest sample (in its last micro-batch), so the ledger's step is the peak."""
    cwd, result = signature_run
    (run_dir,) = (cwd / "profiles").iterdir()
    ledger = json.loads((run_dir / "ledger.json").read_text())
    longest = int(result.stdout.split("(longest sample ")[1].split(",")[0])
    assert ledger["sequence_length"] == longest
    assert "at step 3)" in result.stdout  # wait 1 + warmup 1: the third optimizer step is recorded


def test_the_page_renders_in_a_real_browser_with_the_network_off(signature_run, tmp_path):
    """memory_step.html is one self-contained file: headless Chromium, with every network request refused, draws its
    stacked role chart and the bar chart of the allocations alive at the peak."""
    import shutil
    import subprocess

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("Debian's chromium is not installed (apt-get install chromium; .ci/run installs it)")
    cwd, result = signature_run
    (run_dir,) = (cwd / "profiles").iterdir()
    page = run_dir / "memory_step.html"
    assert "Page:" in result.stdout and page.is_file()
    html = page.read_text()
    assert "<script src=" not in html.replace('<script src="data:', "")  # nothing to fetch
    dom = subprocess.run(
        [
            chromium,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            f"--user-data-dir={tmp_path / 'profile'}",
            # the network is off: no proxy answers, and no name resolves
            "--proxy-server=127.0.0.1:9",
            "--host-resolver-rules=MAP * ~NOTFOUND",
            "--window-size=1200,800",
            "--virtual-time-budget=15000",
            "--dump-dom",
            page.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=180,
    ).stdout
    assert 'class="main-svg"' in dom, dom[-2000:]  # plotly drew the figure
    assert dom.count('class="trace scatter') >= 3  # a filled area per role that holds memory
    assert 'class="trace bars"' in dom and dom.count('class="point"') >= 3  # the allocations alive at the peak
    # each bar named on the chart by its operator and source line, its size written on it, its axis in a unit
    import re as _re

    assert _re.search(r'data-unformatted="1\. aten::\w+', dom) and _re.search(r">[0-9.]+ (KiB|MiB|GiB)<", dom)
    assert "size (MiB)" in dom or "size (GiB)" in dom
    assert "unattributed" in dom and "activations" in dom  # the legend names the roles
    # the phases' names, as the browser measured them, do not cover each other (the optimizer step and zero_grad
    # are a few ms of the step)
    import re

    labels = [
        (name, float(x), float(y), float(w), float(h))
        for x, y, w, h, name in re.findall(
            r'class="annotation" data-index="\d+".*?translate\(([\d.]+),\s*([\d.]+)\).*?width="([\d.]+)"'
            r' height="([\d.]+)".*?data-unformatted="([^"]*)"',
            dom,
        )
    ]
    phases = [label for label in labels if label[0] in ("forward", "backward", "optimizer_step", "zero_grad")]
    assert {"optimizer_step", "zero_grad"} <= {name for name, *_ in phases}, labels
    for i, (name, x, y, w, h) in enumerate(phases):
        for other, x2, y2, w2, h2 in phases[i + 1 :]:
            assert x + w <= x2 or x2 + w2 <= x or y + h <= y2 or y2 + h2 <= y, (name, other, labels)


def test_the_names_of_short_phases_do_not_overlap_in_the_picture():
    """A small model's optimizer step and zero_grad last a few ms of a 700 ms step: their names, centred on them,
    were drawn over each other ("optimizerzero_grad")."""
    import matplotlib.pyplot as plt

    from memfit.picture import _label_phases

    phases = [
        (0, 90, "forward"),
        (90, 350, "backward"),
        (350, 435, "forward"),
        (435, 670, "backward"),
        (670, 676, "optimizer_step"),
        (676, 682, "zero_grad"),
    ]
    figure, axes = plt.subplots(figsize=(11, 5), dpi=100)
    axes.set_xlim(0, 700)
    rows = _label_phases(figure, axes, phases)
    renderer = figure.canvas.get_renderer()
    boxes = [(text.get_text(), text.get_window_extent(renderer)) for text in axes.texts]
    plt.close(figure)
    assert [name for name, _ in boxes] == [name for *_, name in phases] and rows == 2
    for i, (name, box) in enumerate(boxes):
        for other, other_box in boxes[i + 1 :]:
            assert not box.overlaps(other_box), (name, other)


def test_the_page_keeps_the_peak_when_it_thins_the_curve():
    """A real model's step has tens of thousands of allocations; the page keeps at most ``points`` of them, and
    the peak among them, wherever it falls."""
    import random

    from memfit.picture import thinned

    rng = random.Random(0)
    for n, peak_at in ((50_000, 31_337), (50_000, 0), (50_000, 49_999), (100, 57)):
        roles = {"activations": [rng.randrange(1000) for _ in range(n)], "params_frozen": [500] * n}
        roles["activations"][peak_at] = 5000
        timeline = {"ms": [i * 0.01 for i in range(n)], "roles": roles, "peak_ms": peak_at * 0.01, "phases": []}
        thin = thinned(timeline, 2000)
        assert len(thin["ms"]) <= 2002 and len(thin["roles"]["activations"]) == len(thin["ms"])
        i = thin["ms"].index(peak_at * 0.01)  # the peak's sample is kept, with its values
        assert thin["roles"]["activations"][i] == 5000 and thin["roles"]["params_frozen"][i] == 500
        assert thin["ms"] == sorted(thin["ms"]) and thin["ms"][0] == 0 and thin["ms"][-1] == (n - 1) * 0.01


def test_a_batch_from_a_dataloader_worker_is_not_found_where_the_cpu_allocator_does_not_count_it(tmp_path):
    """DataLoader workers hand each batch over in shared memory (PyTorch's ``MapAllocator``), whose profiler events
    carry a running total of 0: the CPU allocator's total, which is the measured peak, does not hold the batch. A
    batch received during the step (the next one, prefetched) must not be found alive at the peak either, or found
    and measured disagree by its size (seen in one run of three as a negative "not found")."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from memfit.ledger import Ledger, complete_from_trace

    data = torch.utils.data.TensorDataset(torch.arange(2048))
    batches = iter(torch.utils.data.DataLoader(data, batch_size=2048, num_workers=1))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with record_function("memfit::forward"):
            (batch,) = next(batches)  # unpickled here: the worker's shared memory is mapped into this process
            kept = torch.ones(2**16)  # the CPU allocator's
    trace = tmp_path / "trace.json"
    prof.export_chrome_trace(str(trace))
    memory = [e["args"] for e in json.loads(trace.read_text())["traceEvents"] if e.get("name") == "[memory]"]
    mapped = [m for m in memory if m["Bytes"] >= batch.nbytes and m["Total Allocated"] == 0]
    assert mapped, memory  # the batch's shared memory, with no total
    ledger = Ledger(device="cpu", measures="CPU tensor memory from profiler events")
    ledger.record_phase("forward", start=0, end=0, peak=0, reserved=0, roles={}, addresses={})
    complete_from_trace(ledger, trace)
    forward = ledger.phases["forward"]
    assert forward.peak >= kept.nbytes and forward.found["unattributed"] >= kept.nbytes
    assert forward.not_found == 0, (forward.peak, forward.found)
    assert all(a["bytes"] != mapped[0]["Bytes"] for a in forward.biggest)
    del batch, batches


def test_an_allocation_is_named_by_its_own_threads_source_line_not_anothers(tmp_path):
    """A logger's writer thread waits in ``queue.get`` the whole step, and its Python frames cover every moment of
    it: the biggest allocations of a pretraining run's backward were named "queue.py(154): get". Each allocation is
    named from its own thread's frames."""
    import queue
    import threading

    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from memfit.ledger import Ledger, complete_from_trace

    inbox, stop = queue.Queue(), threading.Event()

    def writer_waiting_for_events():
        while not stop.is_set():
            try:
                inbox.get(timeout=0.0005)
            except queue.Empty:
                pass

    def make_the_big_tensor():  # slower than the writer's waits, so that on its own it would not be the innermost
        tensor = torch.ones(2**18)
        time.sleep(0.01)
        return tensor

    writer = threading.Thread(target=writer_waiting_for_events)
    writer.start()
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True, with_stack=True) as prof:
            with record_function("memfit::forward"):
                kept = [make_the_big_tensor() for _ in range(8)]
    finally:
        stop.set()
        writer.join()
    trace = tmp_path / "trace.json"
    prof.export_chrome_trace(str(trace))
    frames = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("cat") == "python_function"]
    assert any("queue.py" in e["name"] for e in frames)  # the writer's frames are in the trace
    ledger = Ledger(device="cpu", measures="CPU tensor memory from profiler events")
    ledger.record_phase("forward", start=0, end=0, peak=0, reserved=0, roles={}, addresses={})
    complete_from_trace(ledger, trace)
    biggest = ledger.phases["forward"].biggest
    assert len(biggest) == 6 and all(a["bytes"] == kept[0].nbytes for a in biggest), biggest
    assert all("make_the_big_tensor" in a["source"] and a["op"] == "aten::ones" for a in biggest), biggest


def test_cublas_workspaces_measured_by_freeing_them_are_found_at_every_peak(tmp_path):
    """On CUDA the ledger measures PyTorch's cuBLAS workspaces after training by freeing them (the blocks a clear
    frees, between two allocator snapshots) and finds them at each peak by address, alive since before the step; an
    allocation the step makes is counted once. Without the measurement the same bytes show as "not found". The trace
    is in the profiler's shape (a ``memfit::forward`` range, ``[memory]`` events of device type 1); this machine has
    no CUDA allocator to take one from."""
    from memfit.allocator_snapshot import freed_between
    from memfit.ledger import Ledger, complete_from_trace
    from memfit.timeline import stack_by_role

    kib = 1024
    before = [
        {
            "address": 0x1000,
            "blocks": [
                {"state": "active_allocated", "size": 64 * kib, "requested_size": 64 * kib},  # a weight
                {"state": "active_allocated", "size": 32 * kib, "requested_size": 32 * kib},  # workspace, main thread
                {"state": "active_allocated", "size": 32 * kib, "requested_size": 32 * kib},
            ],
        },  # autograd's device thread
        {"address": 0x90000, "blocks": [{"state": "active_allocated", "size": 2 * kib, "requested_size": 1 * kib}]},
    ]
    after = [{**before[0], "blocks": [before[0]["blocks"][0], {"state": "inactive", "size": 64 * kib}]}, before[1]]
    workspaces = freed_between(before, after)
    assert workspaces == {0x1000 + 64 * kib: 32 * kib, 0x1000 + 96 * kib: 32 * kib}

    step = 5 * kib  # made in the step at 0x50000, alive at the peak
    total = 64 * kib + 1 * kib + 64 * kib + step  # the allocator's running total counts every live block
    trace = tmp_path / "trace.json"
    events = [
        {"ph": "X", "cat": "user_annotation", "name": "memfit::forward", "ts": 0, "dur": 100},
        {
            "ph": "i",
            "name": "[memory]",
            "ts": 10,
            "args": {"Device Type": 1, "Bytes": step, "Addr": 0x50000, "Total Allocated": total},
        },
        {
            "ph": "i",
            "name": "[memory]",
            "ts": 60,
            "args": {"Device Type": 1, "Bytes": -step, "Addr": 0x50000, "Total Allocated": total - step},
        },
    ]
    trace.write_text(json.dumps({"traceEvents": events}))

    def ledger(measured: dict) -> Ledger:
        result = Ledger(
            device="cuda",
            measures="CUDA allocated",
            cublas_workspaces=measured,
            baseline_addresses={0x1000: ("params_frozen", 64 * kib)},
        )
        result.record_phase("forward", start=0, end=0, peak=total, reserved=0, roles={}, addresses={})
        return result

    with_workspaces, without = ledger(workspaces), ledger({})
    complete_from_trace(with_workspaces, trace)
    complete_from_trace(without, trace)
    found = with_workspaces.phases["forward"].found
    assert found["cublas_workspaces"] == 64 * kib and found["params_frozen"] == 64 * kib
    assert found["unattributed"] == step
    assert with_workspaces.phases["forward"].not_found == 1 * kib  # the small block no role explains
    assert without.phases["forward"].not_found == 65 * kib
    assert "cublas_workspaces" in with_workspaces.table() and "cublas_workspaces" not in without.table()
    with_workspaces.roleless_before_step = {0x1000 + 64 * kib: 32 * kib, 0x1000 + 96 * kib: 32 * kib, 0x90000: 1 * kib}
    assert (
        "65.00 KiB in 32.00 KiB, 32.00 KiB, 1.00 KiB; of these, cuBLAS workspaces (freed after training to measure"
        " them): 2 of 64.00 KiB" in with_workspaces.table()
    )
    assert with_workspaces.as_dict()["cublas_workspaces_bytes"] == [32 * kib, 32 * kib]

    # a workspace the step itself allocates (a new thread's, kept) is counted from when it is made, not from the start
    new_thread = dict(workspaces) | {0x50000: step}
    timeline = stack_by_role(
        ledger(new_thread),
        [(10, 0, 2 * kib, 0x60000, None), (20, 0, step, 0x50000, None), (30, 0, -2 * kib, 0x60000, None)],
        [(0, 100, "forward")],
        per_ms=1,
    )
    assert timeline["roles"]["cublas_workspaces"] == [64 * kib, 64 * kib + step, 64 * kib + step]
    assert timeline["roles"]["unattributed"] == [2 * kib, 2 * kib, 0]


def test_the_estimate_counts_two_cublas_workspaces_on_cuda(monkeypatch, capsys):
    """One workspace per thread that runs matmuls: forward's and backward's. CUBLAS_WORKSPACE_CONFIG sizes them as
    PyTorch reads it; on CPU there are none. The script's --estimate for CUDA adds exactly them to every phase."""
    from conftest import load_script, tiny_train
    from memfit.estimate import cublas_workspace_bytes

    mib = 2**20
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    assert cublas_workspace_bytes("cpu") == 0
    assert cublas_workspace_bytes("cuda") == 2 * (8 * mib + 128 * 1024)  # no GPU here: the default off sm90
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    assert cublas_workspace_bytes("gpu") == 64 * mib  # what an H100 uses by default
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")  # the deterministic-algorithms setting
    assert cublas_workspace_bytes("cuda") == 2 * 128 * 1024

    lora = load_script("finetune/lora.py")
    common = dict(estimate=True, precision="bf16-true", train=tiny_train(micro_batch_size=1, global_batch_size=1))
    on_cuda = lora.setup(accelerator="cuda", **common)
    assert "(max_memory_allocated; add about 512.00 MiB of CUDA context" in capsys.readouterr().out
    on_cpu = lora.setup(accelerator="cpu", **common)  # says what it is to be compared with on CPU
    assert "(CPU tensor memory, what a run's ledger measures; the process's RSS adds" in capsys.readouterr().out
    for phase in on_cpu.phases:
        assert on_cuda.phases[phase]["peak"] - on_cpu.phases[phase]["peak"] == 2 * 128 * 1024, phase
        assert on_cuda.phases[phase]["roles"]["cublas_workspaces"] == 2 * 128 * 1024
    assert "cublas_workspaces" in on_cuda.table() and "cublas_workspaces" not in on_cpu.table()
