"""memfit.observatory.picture: the step's memory drawn by role (PNG, and a page that opens with no network). The
signature run's picture and page are checked in test_signature_command.py (a real browser renders the page there)."""


def test_the_names_of_short_phases_do_not_overlap_in_the_picture():
    """A small model's optimizer step and zero_grad last a few ms of a 700 ms step: their names, centred on them,
    were drawn over each other ("optimizerzero_grad")."""
    import matplotlib.pyplot as plt

    from memfit.observatory.picture import _label_phases

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

    from memfit.observatory.picture import thinned

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


def test_a_narrow_spike_that_sets_the_peak_is_drawn_to_its_height(tmp_path):
    """A temporary alive for a microsecond of a 100 ms step sets the peak: the PNG's curve reaches the peak's dot
    (not a sub-pixel-wide line, the dot floating over a curve a tenth of its height), in the full-size picture
    and in TensorBoard's 640-pixel card."""
    import matplotlib.image

    from memfit.observatory.picture import draw_step
    from memfit.observatory.timeline import with_peak

    n, mib = 20_000, 2**20
    ms = [i * 100 / n for i in range(n)]
    spike = n // 2
    ms.insert(spike + 1, ms[spike] + 0.001)  # the spike's end, a microsecond after it began
    unattributed = [0] * (n + 1)
    unattributed[spike] = 9 * mib
    timeline = with_peak(
        {
            "ms": ms,
            "roles": {"params_frozen": [mib] * (n + 1), "unattributed": unattributed},
            "phases": [(0, 50, "forward"), (50, 100, "backward")],
        }
    )
    assert timeline["peak_bytes"] == 10 * mib
    for size in ((11, 5), (6.4, 4.6)):
        out = tmp_path / f"step-{size[0]}.png"
        drawn = draw_step(timeline, "spike", out, figsize=size)
        image = matplotlib.image.imread(out)[..., :3]  # (H, W, RGB) in 0..1
        x, y = (round(v) for v in drawn["peak_pixel"])
        assert (image[y - 1 : y + 2, x - 1 : x + 2] < 0.2).all()  # the dot (#222222) is where it is said to be
        column = image[y + 5 : y + 60, x]  # under the dot, down the spike
        coloured = column.min(axis=-1) < 0.7  # a curve's colour, not white, the faint phase band or a blend of them
        assert coloured.mean() > 0.9, (size, coloured.mean())


def test_no_text_of_the_tensorboard_card_or_the_picture_runs_off_its_edges(tmp_path, monkeypatch):
    """TensorBoard's 640-pixel card and the 1100-pixel picture, with a run's long title, every role in the legend,
    the phases' names and the biggest allocations' list, and the comparison of two runs with their names: each piece
    of text lies inside the saved image."""
    import matplotlib.figure

    from memfit.compare import RUN_AXES
    from memfit.observatory.picture import ROLE_COLOURS, TENSORBOARD_CARD, draw_comparison, draw_step
    from memfit.observatory.timeline import with_peak

    n, mib = 400, 2**20
    roles = {role: [(i % 7 + 1) * mib // 4 for i in range(n)] for role in ROLE_COLOURS}
    timeline = with_peak(
        {
            "ms": [i * 0.5 for i in range(n)],
            "roles": roles,
            "phases": [
                (0, 80, "forward"),
                (80, 190, "backward"),
                (190, 196, "optimizer_step"),
                (196, 200, "zero_grad"),
            ],
        }
    )
    biggest = [
        {
            "bytes": 117 * mib,
            "role": "activations",
            "op": "aten::_log_softmax",
            "source": "memfit/training/loss.py(84)",
        },
        {"bytes": 64 * mib, "role": "unattributed", "op": "aten::nll_loss_backward", "source": "litgpt/model.py(1164)"},
    ]
    title = "lora-embedded-20261129-001550-27579: one optimizer step (CPU tensor memory from profiler events)"
    outside = []
    save = matplotlib.figure.Figure.savefig

    def checked_save(figure, *args, **kwargs):
        # what is drawn, all of it (tick labels beyond the axes' limits are not), against the canvas, in inches
        drawn = figure.get_tightbbox(figure.canvas.get_renderer())
        width, height = figure.get_size_inches()
        if drawn.x0 < -0.01 or drawn.y0 < -0.01 or drawn.x1 > width + 0.01 or drawn.y1 > height + 0.01:
            outside.append((float(width), tuple(round(v, 2) for v in drawn.extents)))
        return save(figure, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", checked_save)
    curve = {"ms": timeline["ms"], "bytes": [sum(r[i] for r in roles.values()) for i in range(n)]}
    curves = {"A": curve | {"phases": timeline["phases"]}, "B": curve | {"bytes": [b // 2 for b in curve["bytes"]]}}
    two_runs = "A: lora-embedded-20261129-001550-27579   B: lora-embedded-20261129-001712-27644"
    for size in ((11, 5), TENSORBOARD_CARD):
        draw_step(timeline, title, tmp_path / f"step-{size[0]}.png", biggest, figsize=size)
        draw_comparison(curves, two_runs, tmp_path / f"compare-{size[0]}.png", RUN_AXES, figsize=size)
    assert len(list(tmp_path.glob("*.png"))) == 4
    assert outside == []


def test_every_phase_of_the_step_has_its_own_colour():
    """A phase added to LEDGER_PHASES without a colour would be drawn in the grey meant for none."""
    from memfit.observatory.phase_names import LEDGER_PHASES, RUN_PHASES
    from memfit.observatory.picture import _PHASE_COLOURS

    phases = {*LEDGER_PHASES, *RUN_PHASES}
    assert phases <= set(_PHASE_COLOURS), phases - set(_PHASE_COLOURS)
    assert len(set(_PHASE_COLOURS.values())) == len(_PHASE_COLOURS)
