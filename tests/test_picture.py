"""memfit.picture: the step's memory drawn by role (PNG, and a page that opens with no network). The signature run's
picture and page are checked in test_signature_command.py (a real browser renders the page there)."""


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
