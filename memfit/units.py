"""Byte counts as text: what every report, page and picture prints. Kept apart from ``memfit.memory`` (which reads
the device's and the process's memory, and imports torch) so that a tool that only reads a run's files
(``python -m memfit.compare``) starts without torch."""


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"
