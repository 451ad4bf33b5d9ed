"""Resident memory of a `moelight run` job, phase by phase (planning, loading, packing, prefill, decode).

Runs the CLI in this process with hooks at the phase boundaries. At each boundary it reads VmRSS and VmHWM
(/proc/self/status) and resets the peak (/proc/self/clear_refs "5"), so each phase's peak is its own; glibc's
free-but-retained bytes (mallinfo2) say how much of the RSS the allocator keeps. The table goes to stderr and,
with --json PATH, to a file. Usage (benchmarks/results/memory_check.md):

    python benchmarks/memory_phases.py [--json out.json] -- run --model ... (the `moelight` arguments)
"""

from __future__ import annotations

import ctypes
import json
import sys
import time

GIB = 2**30


def _status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[key] = int(rest.split()[0]) * 1024
    return out


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]


def _malloc_free() -> int | None:
    """Bytes glibc holds free in its arenas (returned to it, not to the OS)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
        return int(libc.mallinfo2().fordblks)
    except (OSError, AttributeError):
        return None


class Phases:
    def __init__(self) -> None:
        self.rows: list[dict] = []
        self.name, self.t0, self.start = "start-up", time.perf_counter(), _status()["VmRSS"]

    def mark(self, name: str) -> None:
        if name == self.name:
            return
        s = _status()
        self.rows.append({"phase": self.name, "rss_start": self.start, "peak": s["VmHWM"], "rss_end": s["VmRSS"],
                          "anon_end": s["RssAnon"], "malloc_free_end": _malloc_free(),
                          "seconds": time.perf_counter() - self.t0})
        from moelight.planning.memory_check import reset_peak_rss  # imported by the job already

        reset_peak_rss()  # VmHWM := VmRSS: the next phase's peak is its own
        self.name, self.t0, self.start = name, time.perf_counter(), s["VmRSS"]

    def table(self) -> str:
        lines = ["| phase | RSS at start GiB | peak GiB | RSS at end GiB | glibc free at end GiB | s |",
                 "|---|---|---|---|---|---|"]
        for r in self.rows:
            free = "" if r["malloc_free_end"] is None else f"{r['malloc_free_end'] / GIB:.2f}"
            lines.append(f"| {r['phase']} | {r['rss_start'] / GIB:.2f} | {r['peak'] / GIB:.2f} | "
                         f"{r['rss_end'] / GIB:.2f} | {free} | {r['seconds']:.1f} |")
        return "\n".join(lines)


def _wrap(owner, attr: str, phases: Phases, before: str, after: str | None = None) -> None:
    fn = getattr(owner, attr)

    def wrapped(*a, **k):
        phases.mark(before)
        try:
            return fn(*a, **k)
        finally:
            if after:
                phases.mark(after)

    setattr(owner, attr, wrapped)


def _hook(phases: Phases, checks: list) -> None:
    from moelight.engine import generation, session
    from moelight.planning import memory_check

    _wrap(session, "load_model", phases, "load (build, draw)", "after load")
    _wrap(session, "pack_model", phases, "pack", "after pack")
    _wrap(generation._Run, "_prefill", phases, "prefill", "after prefill")
    _wrap(generation._Run, "_decode_step", phases, "decode")
    check = memory_check.check_fits

    def recorded(*a, **k):
        out = check(*a, **k)
        checks.append({key: v for key, v in out.items()})
        return out

    session.check_fits = recorded


def main() -> None:
    argv = sys.argv[1:]
    out = None
    if argv[:1] == ["--json"]:
        out, argv = argv[1], argv[2:]
    if argv[:1] == ["--"]:
        argv = argv[1:]
    phases, checks = Phases(), []
    from moelight.cli import main as cli_main

    phases.mark("plan")
    _hook(phases, checks)
    code = 0
    try:
        cli_main(argv)
    except SystemExit as e:
        code = e.code or 0
    phases.mark("end")
    print(phases.table(), file=sys.stderr)
    print("memory checks:", json.dumps(checks), file=sys.stderr)
    if out:
        with open(out, "w") as f:
            json.dump({"argv": argv, "phases": phases.rows, "checks": checks, "exit": code}, f, indent=1)


if __name__ == "__main__":
    main()
