"""A picture of the profiled optimizer step's memory, that opens with no network.

torch-tb-profiler's Memory view loads its charts from the web, so on an air-gapped GPU cluster it never renders.
This draws the same step from the profiler's own trace with matplotlib: tensor memory over time (the trace's
``[memory]`` events), each phase (``memfit::forward``, ``backward``, ...) shaded and named, the memory held
before the step began (weights, gradients, optimizer state) as a band, and the peak marked with its phase and size.
The PNG lands in the run dir and in TensorBoard's Images tab, which works offline.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on a training node
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)

from memfit.memory import fmt_bytes  # noqa: E402
from memfit.profiling import read_trace_events  # noqa: E402

_PHASE_COLOURS = {"forward": "#4c72b0", "backward": "#dd8452", "optimizer_step": "#55a868", "zero_grad": "#8172b3"}


def step_timeline(trace: Path, device_type: int, baseline: int) -> dict:
    """Times (ms from the step's start) and bytes allocated, and the phase ranges, from a profiler trace.

    On CPU the trace counts only what was allocated after the profiler started, so ``baseline`` (what was alive
    before) is added; on CUDA the allocator's totals are absolute and ``baseline`` is 0.
    """
    events = read_trace_events(trace)
    memory = sorted((e["ts"], e["args"]["Total Allocated"]) for e in events
                    if e.get("name") == "[memory]" and e.get("args", {}).get("Device Type") == device_type)
    phases = sorted((e["ts"], e["ts"] + e["dur"], e["name"].split("::", 1)[1]) for e in events
                    if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith("memfit::"))
    if not memory or not phases:
        raise ValueError(f"{trace} has no memory events or no memfit phases to draw")
    start = phases[0][0]
    return {
        "ms": [(ts - start) / 1e3 for ts, _ in memory],
        "bytes": [baseline + total for _, total in memory],
        "phases": [((a - start) / 1e3, (b - start) / 1e3, name) for a, b, name in phases],
        "baseline": baseline,
    }


def draw_step(timeline: dict, title: str, out: Path) -> dict:
    """Draws the timeline into ``out`` (PNG); returns what the picture states (peak, its phase, its time)."""
    ms, allocated = timeline["ms"], timeline["bytes"]
    peak_index = max(range(len(allocated)), key=allocated.__getitem__)
    peak_ms, peak = ms[peak_index], allocated[peak_index]
    peak_phase = next((name for a, b, name in timeline["phases"] if a <= peak_ms <= b), "between phases")
    unit, scale = ("GiB", 2**30) if peak >= 2**30 else ("MiB", 2**20)

    figure, axes = plt.subplots(figsize=(11, 4.5), dpi=100)
    seen = set()
    for a, b, name in timeline["phases"]:
        axes.axvspan(a, b, color=_PHASE_COLOURS.get(name, "#999999"), alpha=0.15,
                     label=None if name in seen else name)
        seen.add(name)
    if timeline["baseline"]:
        axes.axhspan(0, timeline["baseline"] / scale, color="#999999", alpha=0.35,
                     label=f"alive before the step ({fmt_bytes(timeline['baseline'])})")
    axes.step(ms, [b / scale for b in allocated], where="post", color="#222222", linewidth=1.2,
              label="tensor memory allocated")
    axes.plot([peak_ms], [peak / scale], "o", color="#c44e52")
    axes.annotate(f"peak {fmt_bytes(peak)} in {peak_phase}", (peak_ms, peak / scale), textcoords="offset points",
                  xytext=(8, 6), color="#c44e52")
    axes.set_xlabel("time in the profiled optimizer step (ms)")
    axes.set_ylabel(f"allocated ({unit})")
    axes.set_ylim(0, peak / scale * 1.15)
    axes.set_title(title)
    axes.legend(loc="upper right", fontsize=8)
    figure.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out)
    plt.close(figure)
    return {"peak_bytes": peak, "peak_phase": peak_phase, "peak_ms": peak_ms, "png": str(out)}
