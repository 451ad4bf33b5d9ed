"""Whether other work ran while the host was profiled. Every rate a profile measures is shared with
whatever else runs, so a profile taken beside other work under-rates the machine, and the cached
profile then prices every later plan (a job's first run takes one on its own when none is cached).

The load average cannot tell: right after `pip install` builds the C++ kernels it is high while the
host is idle again. So `OtherWork` counts the CPU time the whole host spent busy during the profile
(/proc/stat, steal included) less this process's own.
"""

from __future__ import annotations

import os
import time

BUSY_SHARE = 0.25  # other work's share of all CPUs during the profile above which it says so
_BUSY = "the host was busy when profiled"  # how the note starts, and how busy_warning finds it


def host_busy_seconds() -> float | None:
    """CPU-seconds all CPUs have spent busy since boot (steal included), None where unreadable."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
        return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):  # no /proc (macOS, Windows)
        return None


def busy_note(other_share: float, cpus: int) -> str:
    """'' where other work took at most BUSY_SHARE of the CPUs; else a sentence that says what to do."""
    if other_share <= BUSY_SHARE:
        return ""
    return (f"{_BUSY} (other work used {other_share:.0%} of its {cpus} CPUs), so "
            "its rates are under-rated and plans from them pessimistic; run `moelight profile` again on "
            "an idle host")


class OtherWork:
    """`with OtherWork() as w: <profile>` then `w.note()`: busy_note of the CPU time other processes
    took while the block ran."""

    def __enter__(self) -> OtherWork:
        self.host0, self.own0, self.wall0 = host_busy_seconds(), time.process_time(), time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.host1, self.own1, self.wall1 = host_busy_seconds(), time.process_time(), time.perf_counter()

    def other_share(self) -> float | None:
        """Other processes' share of all CPUs while the block ran; None where /proc/stat is unreadable."""
        if self.host0 is None or self.host1 is None:
            return None
        other = (self.host1 - self.host0) - (self.own1 - self.own0)
        return max(0.0, other) / (max(self.wall1 - self.wall0, 1e-9) * (os.cpu_count() or 1))

    def note(self) -> str:
        share = self.other_share()
        return "" if share is None else busy_note(share, os.cpu_count() or 1)


def busy_warning(notes: str) -> str:
    """The busy sentence of a profile's notes ('' where it has none), for the CLI and the job log."""
    start = notes.find(_BUSY)
    return "" if start < 0 else "warning: " + notes[start:]
