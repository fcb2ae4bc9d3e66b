"""What was alive at an out-of-memory (``memfit.failure.failure_ledger``), written by the run that failed."""

import contextlib
import json

import pytest

pytestmark = pytest.mark.slow  # every test here runs a recipe


def test_a_planted_leak_is_named_among_what_was_alive_at_the_failure(tmp_path, embedded, monkeypatch, capsys):
    """A loss that keeps one 8 MiB tensor per micro-batch (a leak) and, once, the output of a forward pass of its own
    (a graph kept past its backward: a second leak), and the run out of memory entering backward: the failure's
    ledger holds the weights by role, the activations the forward's graph still saves, by the block (or the
    embedding or head) whose backward needs them, the two forward graphs alive, and the leaked tensors named by
    shape and holder as the largest, with the name that keeps each alive (the list, in this test's frame); the closing
    lines name the largest holders and the kept graph."""
    import torch

    from conftest import load_script, tiny_train
    from memfit.args import ProfileArgs
    from memfit.memory import MemoryProbe
    from memfit.observatory.phases import PhaseMemory

    lora = load_script("finetune/lora.py")
    kept, kept_graph, original, model_seen = [], [], lora.loss_fn, []

    def loss_fn_keeping_a_buffer(model, batch):
        if not model_seen:
            model_seen.append(model)  # the run's (the explanation's planner traces fake models after the failure)
        if model is model_seen[0]:
            kept.append(torch.ones(2**21))  # 8 MiB, alive to the end of the run
            if len(kept) == 1:
                kept_graph.append(model(batch["input_ids"]))  # its graph, never backwarded
        return original(model, batch)

    monkeypatch.setattr(lora, "loss_fn", loss_fn_keeping_a_buffer)
    unchanged, backwards = PhaseMemory.phase, []

    @contextlib.contextmanager
    def fifth_backward_fails(self, name):
        if name == "backward" and isinstance(self.probe, MemoryProbe):  # the run's, not the planner's fake steps
            backwards.append(name)
            if len(backwards) == 5:  # where an allocation would have failed: several leaked tensors alive by then
                self.current = name
                raise torch.OutOfMemoryError("simulated allocation failure in backward")
        with unchanged(self, name):
            yield

    monkeypatch.setattr(PhaseMemory, "phase", fifth_backward_fails)
    with pytest.raises(SystemExit) as ended:
        lora.setup(
            out_dir=tmp_path / "out",
            profile_dir=tmp_path / "profiles",
            logger_name="tensorboard",
            train=tiny_train(max_steps=4, micro_batch_size=2, global_batch_size=4),
            profile=ProfileArgs(enabled=False),
        )
    assert ended.value.code == 3
    err = capsys.readouterr().err
    (path,) = (tmp_path / "profiles").glob("*/oom/ledger.json")
    ledger = json.loads(path.read_text())
    assert f"What was alive at the failure, tensor by tensor: {path}" in err, err[-2000:]
    assert "Largest holders at the failure: " in err
    held = next(line for line in err.splitlines() if line.startswith("Held when it failed: "))
    assert "activations " in held and "other_tensors " in held, held  # what the next line names is in it too
    holders = next(line for line in err.splitlines() if line.startswith("Largest holders at the failure: "))
    assert "held by Python (not saved for backward), as `kept`[" in holders, holders
    (model,) = model_seen
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    assert ledger["bytes_by_role"]["params_trainable"] == trainable > 0
    assert ledger["bytes_by_role"]["activations"] > 0  # the forward's graph, waiting for the backward that failed
    leaks = [t for t in ledger["largest"] if t["shape"] == [2**21] and t["held_by"].startswith("held by Python")]
    assert len(leaks) == len(kept) >= 3, (ledger["largest"], len(kept))
    # made outside any recorded step (the profiler is off): each named by what keeps it alive, this test's list
    assert {leak["held_at"].split(" ")[0] for leak in leaks} == {f"`kept`[{i}]" for i in range(len(kept))}, leaks
    assert all("(a local of test_a_planted_leak" in leak["held_at"] for leak in leaks), leaks
    assert all("tests/test_failure_ledger.py:" in leak["held_at"] for leak in leaks), leaks
    assert ledger["bytes_by_role"]["other_tensors"] >= len(kept) * 2**23
    # where the activations are needed: each of the model's blocks, in the one place or another, summing to them all
    places = ledger["activations_by_place"]
    print("activations by place:", {place: size // 1024 for place, size in places.items()}, "KiB")
    blocks = [f"block {i}" for i in range(model.config.n_layer)]
    assert set(blocks) <= set(places) and all(places[block] > 0 for block in blocks), places
    assert sum(places.values()) == ledger["bytes_by_role"]["activations"], places
    assert ledger["forward_graphs_alive"] == 2  # the step's, waiting for its backward, and the kept one
    # by forward pass, the newest first: the fifth backward is the third step's first micro-batch (two of 2 samples a
    # step), then the graph the loss kept at the first step
    current, kept_one = ledger["activations_by_forward"]
    assert current["forward"] == "micro-batch 1 of the failed step", current
    assert kept_one["forward"] == "an earlier forward, kept past its backward" and kept_one["bytes"] > 0
    assert current["bytes"] + kept_one["bytes"] == ledger["bytes_by_role"]["activations"]
    assert "Activations by where backward needs them: block " in err, err[-2000:]
    assert "2 forward passes' graphs were alive at once" in err, err[-2000:]
    # drawn, offline: the roles with the failure marked, the activations by block, the leaked tensors listed
    import matplotlib.image

    image = matplotlib.image.imread(path.with_suffix(".png"))
    assert image.shape[1] >= 800 and image[..., :3].std() > 0.05, image.shape
    page = path.with_suffix(".html").read_text()
    assert "Out of memory on cpu" in page and "block 0" in page and "[2097152]" in page
    assert "https://" not in page.split("<body>", 1)[1].split("<table>", 1)[1]  # the table links nothing
    assert f"Picture: {path.with_suffix('.png')}" in err
    # and in TensorBoard, read with its own event reader: the picture at the card's width, the holders as text
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events_file,) = path.parent.parent.rglob("events.out.tfevents.*")
    events = EventAccumulator(str(events_file.parent), size_guidance={"tensors": 0, "images": 0}).Reload()
    (card,) = events.Images("memory_failure")
    assert card.width == 640 and card.step == 3, (card.width, card.step)
    (text,) = events.Tensors("memory_failure/text_summary")
    assert b"Largest holders at the failure: " in text.tensor_proto.string_val[0]


def test_what_was_alive_is_read_past_fake_tensors_and_dead_proxies():
    """After torch.compile, the process holds fake tensors (shapes only, no data) and weakref proxies of objects
    that are gone; the failure's ledger skips both, where reading them raised (no ledger for an out-of-memory in a
    run that compiled)."""
    import weakref

    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memfit.failure.failure_ledger import alive_at_failure

    class Gone:
        pass

    with FakeTensorMode():
        fake = torch.empty(1024, 1024)
    gone = Gone()
    proxy = weakref.proxy(gone)
    del gone
    kept = torch.ones(2**20)  # 4 MiB, held here
    model = torch.nn.Linear(8, 8)
    ledger = alive_at_failure(RuntimeError("out of memory"), model, None, torch.device("cpu"))
    assert ledger["bytes_by_role"]["other_tensors"] >= kept.numel() * 4
    assert all(entry["shape"] != list(fake.shape) for entry in ledger["largest"])
    assert proxy is not None
