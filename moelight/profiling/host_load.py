"""Whether the host was busy when it was profiled. Every rate a profile measures is shared with
whatever else runs, so a profile taken beside other work under-rates the machine, and the cached
profile then prices every later plan (a job's first run takes one on its own when none is cached)."""

from __future__ import annotations

import os

BUSY_LOAD_PER_CPU = 0.5  # 1-minute load average per CPU above which the host counts as busy


def busy_note(load_1min: float | None = None, cpus: int | None = None) -> str:
    """'' on a quiet host; else a sentence that says the host was busy and what to do. Read before
    the profile runs, so the load is other work's, not the profile's own."""
    if load_1min is None:
        try:
            load_1min = os.getloadavg()[0]
        except (OSError, AttributeError):  # not measurable here (no /proc/loadavg, Windows)
            return ""
    n = cpus or os.cpu_count() or 1
    if load_1min <= BUSY_LOAD_PER_CPU * n:
        return ""
    return (f"the host was busy when profiled (1-minute load average {load_1min:.1f} on {n} CPUs), so "
            "its rates are under-rated and plans from them pessimistic; run `moelight profile` again on "
            "an idle host")


def busy_warning(notes: str) -> str:
    """The busy sentence of a profile's notes ('' where it has none), for the CLI and the job log."""
    start = notes.find("the host was busy when profiled")
    return "" if start < 0 else "warning: " + notes[start:]
