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

from conftest import offline_dom, run_script, run_summary

pytestmark = pytest.mark.xdist_group("signature_run")  # one worker makes the module's run once, for all its tests


def test_the_modules_tests_share_one_worker(request):
    """The run below is made once only if pytest-xdist keeps this module's tests on one worker (``--dist loadgroup``;
    pytest 9.2 stopped that silently, pytest-xdist issue 1386: the run was made twice, 75 s more)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        assert request.node.nodeid.endswith("@signature_run"), request.node.nodeid


@pytest.fixture(scope="module")
def signature_run(tmp_path_factory, embedded):
    cwd = tmp_path_factory.mktemp("signature")
    result = run_script(
        "finetune/lora.py", "--precision", "bf16-true", "--quantize", "bnb.nf4", cwd=cwd, fresh=True
    )  # offline
    assert result.returncode == 0, result.stderr[-3000:]
    return cwd, result


@pytest.mark.slow
def test_trains_embedded_nf4_model_and_loss_falls(signature_run):
    cwd, result = signature_run
    summary = run_summary(cwd / "out" / "profiles")
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
    assert "kernels-community" not in result.stderr  # bitsandbytes is not let near the Hub (test_quantize.py)


def _nf4_bytes(checkpoint_dir) -> tuple[int, int]:
    """What the linear weights of the checkpoint take packed as nf4 (4 bits each plus one float32 absmax per block
    of 64), and in bf16: computed from the config alone, not from Memfit's tensors."""
    from litgpt import Config

    c = Config.from_file(checkpoint_dir / "model_config.yaml")
    qkv = (c.n_head + 2 * c.n_query_groups) * c.head_size
    per_block = c.n_embd * qkv + c.head_size * c.n_head * c.n_embd + 3 * c.n_embd * c.intermediate_size
    n = c.n_layer * per_block + c.n_embd * c.padded_vocab_size  # and the head
    return n // 2 + n // 64 * 4, 2 * n


@pytest.mark.slow
def test_base_is_really_4bit(signature_run, embedded):
    """The frozen base was quantized: the ledger's quantized parameters, measured from the run's real tensors, take
    the nf4 size of every linear weight, a quarter of their bf16 size."""
    cwd, _ = signature_run
    (run_dir,) = (cwd / "out" / "profiles").iterdir()
    ledger = json.loads((run_dir / "ledger.json").read_text())
    quantized = ledger["phases"]["forward"]["found_at_peak_bytes"]["params_quantized"]
    nf4, bf16 = _nf4_bytes(embedded[0])
    assert abs(quantized - nf4) <= 0.02 * nf4, (quantized, nf4, bf16)


@pytest.mark.slow
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


@pytest.mark.slow
def test_scalars_logged_per_step(signature_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cwd, _ = signature_run
    (run_dir,) = (cwd / "out" / "profiles").iterdir()
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
    # the run's peak so far, not the last phase's (each phase resets the process's high-water mark): it never falls
    peaks = [e.value for e in events.Scalars("memory/cpu_peak_rss_gib")]
    assert peaks == sorted(peaks)


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


@pytest.mark.slow
def test_memory_view_in_a_real_tensorboard_server(signature_run):
    """Starts TensorBoard on a loopback port and reads the PyTorch Profiler plugin's Memory view over HTTP, from the
    gzipped trace the run wrote (and no other)."""
    cwd, _ = signature_run
    traces = [p.name for p in (cwd / "out" / "profiles").glob("*/*.pt.trace.json*")]
    assert len(traces) == 1 and traces[0].endswith(".pt.trace.json.gz"), traces
    port = _free_port()
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tensorboard.main",
            "--logdir",
            str(cwd / "out" / "profiles"),
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
        # TensorBoard starts, finds the plugin's runs and parses the trace in threads of its own: 12 s alone, over
        # 90 s once in CI with the suite's other workers on the same 2 cores
        deadline, runs, data = time.monotonic() + 240, [], None
        while time.monotonic() < deadline:
            try:
                data = _get_json(f"{base}/runs")
                runs = data["runs"]
                if runs and not data["loading"]:
                    break
            except OSError:
                pass
            time.sleep(1)
        assert len(runs) == 1, (data, server.poll())
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


@pytest.mark.slow
def test_ledger_attributes_the_allocations_alive_at_each_peak(signature_run, embedded):
    """ledger.json: at each phase's peak, the live allocations attributed by address to a role or unattributed;
    what was found is set against the measured peak (not made to add up); TensorBoard has it."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from memfit.observatory.roles import LOSS, ROLES

    cwd, result = signature_run
    (run_dir,) = (cwd / "out" / "profiles").iterdir()
    ledger = json.loads((run_dir / "ledger.json").read_text())
    assert ledger["complete"] and ledger["measures"] == "CPU tensor memory from profiler events"
    phases = ledger["phases"]
    assert set(phases) == {"forward", "backward", "optimizer_step", "zero_grad"}
    for name, phase in phases.items():
        assert set(phase["found_at_peak_bytes"]) == set(ROLES) | {LOSS, "unattributed"}, name
        assert abs(phase["not_found_bytes"]) <= 0.01 * phase["peak_bytes"], name
        assert phase["biggest_at_peak"], name
    forward = phases["forward"]["found_at_peak_bytes"]
    assert forward["activations"] > 0 and forward["unattributed"] > 0  # the logits chunks are nobody's
    assert forward["params_quantized"] >= 0.98 * _nf4_bytes(embedded[0])[0]
    assert phases["optimizer_step"]["found_at_peak_bytes"]["optimizer_state"] > 0
    assert phases["zero_grad"]["end_bytes"] < phases["optimizer_step"]["end_bytes"]  # gradients freed
    made_in_step = [a for a in phases["forward"]["biggest_at_peak"] if a["op"] != "allocated before the step"]
    # named by operator; the source line too with --profile.with_stack true (off by default: test_profiling.py)
    assert made_in_step and all(a["op"].startswith("aten::") for a in made_in_step)
    assert "Memory ledger of one optimizer step" in result.stdout and "Biggest allocations alive" in result.stdout
    events = EventAccumulator(str(run_dir)).Reload()
    assert "ledger/forward/activations_mib" in events.Tags()["scalars"]
    # logged at the step the ledger describes, not at the run's last
    assert [e.step for e in events.Scalars("ledger/forward/activations_mib")] == [ledger["step"]] == [3]
    # in MiB, the unit a small run reads as a number (in GiB its roles read like 5e-05)
    (logged,) = events.Scalars("ledger/forward/activations_mib")
    activations = ledger["phases"]["forward"]["found_at_peak_bytes"]["activations"]
    assert logged.value == pytest.approx(activations / 2**20, rel=1e-6) and logged.value > 1
    assert any("memory_ledger" in tag for tag in events.Tags()["tensors"])


@pytest.mark.slow
def test_the_step_is_drawn_as_a_picture_that_needs_no_network(signature_run):
    """memory_step.png: the profiled step's tensor memory over time with the phases, drawn from the trace with
    matplotlib (no web resources), stating the ledger's peak; also in TensorBoard's Images tab, at a width its card
    shows without shrinking the text away."""
    import matplotlib.image
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cwd, result = signature_run
    (run_dir,) = (cwd / "out" / "profiles").iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    picture = summary["memory_picture"]
    image = matplotlib.image.imread(run_dir / "memory_step.png")
    assert image.shape[0] >= 300 and image.shape[1] >= 800 and image[..., :3].std() > 0.05  # drawn, not blank
    ledger = json.loads((run_dir / "ledger.json").read_text())
    highest = ledger["phases"][ledger["peak_phase"]]
    assert picture["peak_phase"] == ledger["peak_phase"]
    assert abs(picture["peak_bytes"] - highest["peak_bytes"]) <= 0.01 * highest["peak_bytes"]
    assert "Picture:" in result.stdout
    # drawn again for TensorBoard's card, which shrinks a wider picture until its text cannot be read
    (card,) = EventAccumulator(str(run_dir), size_guidance={"images": 0}).Reload().Images("memory_step")
    assert card.width <= 700 and card.height >= 300, (card.width, card.height)


@pytest.mark.slow
def test_the_ledger_explains_the_step_with_the_longest_sample(signature_run):
    """The profiled step holds the run's longest sample (in its last micro-batch), so the ledger's step is the peak."""
    cwd, result = signature_run
    (run_dir,) = (cwd / "out" / "profiles").iterdir()
    ledger = json.loads((run_dir / "ledger.json").read_text())
    longest = int(result.stdout.split("(longest sample ")[1].split(",")[0])
    assert ledger["sequence_length"] == longest
    assert "at step 3)" in result.stdout  # wait 1 + warmup 1: the third optimizer step is recorded


@pytest.mark.slow
def test_the_page_renders_in_a_real_browser_with_the_network_off(signature_run, tmp_path):
    """memory_step.html is one self-contained file: headless Chromium, with every network request refused, draws its
    stacked role chart and the bar chart of the allocations alive at the peak."""
    cwd, result = signature_run
    (run_dir,) = (cwd / "out" / "profiles").iterdir()
    page = run_dir / "memory_step.html"
    assert "Page:" in result.stdout and page.is_file()
    html = page.read_text()
    assert "<script src=" not in html.replace('<script src="data:', "")  # nothing to fetch
    dom = offline_dom(page, tmp_path / "profile")
    assert 'class="main-svg"' in dom, dom[-2000:]  # plotly drew the figure
    assert dom.count('class="trace scatter') >= 3  # a filled area per role that holds memory
    assert 'class="trace bars"' in dom and dom.count('class="point"') >= 3  # the allocations alive at the peak
    # each bar named on the chart by its operator and source line, its size written on it, its axis in a unit
    import re as _re

    assert _re.search(r'data-unformatted="1\. aten::\w+', dom) and _re.search(r">[0-9.]+ (KiB|MiB|GiB)<", dom)
    assert "size (MiB)" in dom or "size (GiB)" in dom
    assert "unattributed" in dom and "activations" in dom  # the legend names the roles
    # what TensorBoard's Profiler tab would show and cannot offline: memory by operator, and the allocations
    assert "Memory by operator" in dom and "<td>aten::mm</td>" in dom
    assert _re.search(r"Allocations \(the \d+ largest, of [\d,]+", dom)
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


def _readme_block(starts: str, page: str = "README.md") -> list[str]:
    from conftest import ROOT

    text = (ROOT / page).read_text()
    start = text.index(starts)
    return text[start : text.index("```", start)].rstrip("\n").splitlines()


@pytest.mark.slow
def test_the_readmes_example_output_is_what_the_command_prints(signature_run):
    """The README's summary block and docs/memory.md's ledger are this command's output:
    the same lines, the same deterministic sizes (parameters, optimizer state, saved activations, nothing not
    found); and on a CPU of the README's kind (no AVX512-BF16 or AMX: bf16 emulated, as on the CI machine) the same
    losses to the printed digit."""
    from memfit.training.precision import sixteen_bit_matmul_instructions

    _, result = signature_run
    out = result.stdout.splitlines()
    summary = _readme_block("Done: ")
    printed = [line for line in out if line.split(":")[0] in {s.split(":")[0] for s in summary}]
    assert [line.split(":")[0] for line in printed] == [line.split(":")[0] for line in summary], printed
    if sixteen_bit_matmul_instructions() == []:
        losses = summary[0].split(" tokens/s")[0].rsplit(", ", 1)[0]  # "Done: 80 steps, loss a -> b (val c)"
        assert printed[0].startswith(losses + ", "), (printed[0], summary[0])
    for page in ("docs/memory.md",):
        ledger = _readme_block("Memory ledger of one optimizer step", page)
        run_ledger = out[out.index(ledger[0]) : out.index(ledger[0]) + len(ledger)]
        exact = ("role", "params_", "optimizer_state", "activations", "not found")
        for quoted, run_line in zip(ledger, run_ledger):
            if quoted.startswith(exact):
                assert run_line == quoted, (page, run_line, quoted)
        assert [line.split()[0] for line in run_ledger[:12]] == [line.split()[0] for line in ledger[:12]], page


@pytest.mark.slow
def test_the_readmes_picture_is_the_one_this_command_draws(signature_run):
    """The README's first picture (docs/memory_step.png, from a run of this command on a CPU) is still what this
    command draws: a memory_step.png of the same size in pixels (the figure's layout unchanged)."""
    import re

    from matplotlib import image

    from conftest import ROOT

    cwd, _ = signature_run
    (run_dir,) = (cwd / "out" / "profiles").iterdir()
    readme = (ROOT / "README.md").read_text()
    picture = re.findall(r"!\[[^\]]*\]\((docs/[^)]+\.png)\)", readme)[0]  # the first: the run's step
    assert picture.endswith("memory_step.png"), picture
    shown, drawn = image.imread(ROOT / picture), image.imread(run_dir / "memory_step.png")
    assert shown.shape == drawn.shape, (shown.shape, drawn.shape)


@pytest.mark.slow
def test_the_losss_buffers_have_a_role_of_their_own(signature_run):
    """What the loss's head makes (its chunks' logits and log-softmax, the gradients a frozen head takes in forward) is
    the ledger's ``loss``, found by the loss's profiler range: none of it is left unattributed."""
    cwd, _ = signature_run
    (run_dir,) = (cwd / "out" / "profiles").iterdir()
    forward = json.loads((run_dir / "ledger.json").read_text())["phases"]["forward"]
    found = forward["found_at_peak_bytes"]
    assert found["loss"] > 10 * found["unattributed"], found
    made_by_the_loss = [a for a in forward["biggest_at_peak"] if "softmax" in a["op"] or "nll_loss" in a["op"]]
    assert made_by_the_loss and all(a["role"] == "loss" for a in made_by_the_loss), forward["biggest_at_peak"]


_BOXES = """<script>
setTimeout(function () {
  var boxes = [];
  document.querySelectorAll("h1, h2, h3, .gtitle, .legend, .annotation, .g-xtitle, .g-ytitle").forEach(function (e) {
    var r = e.getBoundingClientRect();
    if (r.width > 0) boxes.push({what: (e.getAttribute("class") || e.tagName) + " " + e.textContent.slice(0, 40),
                                 x: r.left, y: r.top, w: r.width, h: r.height});
  });
  var out = document.createElement("pre");
  out.id = "boxes";
  out.textContent = JSON.stringify(boxes);
  document.body.appendChild(out);
}, 3000);
</script></body>"""


@pytest.mark.slow
@pytest.mark.parametrize("width", [1400, 1200])
def test_the_pages_titles_and_labels_do_not_overlap_in_a_browser(signature_run, tmp_path, width):
    """The run's page as Chromium lays it out at 1400 and 1200 pixels: its title, the plots' titles, the phases'
    labels, the legend and the axes' titles each have a box of their own (a user saw the title over a plot's title)."""
    import html
    import re

    from conftest import offline_dom

    cwd, _ = signature_run
    (run_dir,) = (cwd / "out" / "profiles").iterdir()
    probe = run_dir / f"boxes-{width}.html"
    probe.write_text((run_dir / "memory_step.html").read_text().replace("</body>", _BOXES))
    try:
        dom = offline_dom(probe, tmp_path / "browser", width=width)
    finally:
        probe.unlink()
    found = re.search(r'<pre id="boxes">(.*?)</pre>', dom, re.S)
    assert found, dom[-2000:]
    boxes = json.loads(html.unescape(found.group(1)))
    assert sum("gtitle" in b["what"] for b in boxes) == 1 and len(boxes) >= 6, boxes
    overlapping = [
        (a["what"], b["what"])
        for i, a in enumerate(boxes)
        for b in boxes[i + 1 :]
        if a["x"] < b["x"] + b["w"]
        and b["x"] < a["x"] + a["w"]
        and a["y"] < b["y"] + b["h"]
        and b["y"] < a["y"] + a["h"]
    ]
    assert not overlapping, overlapping
