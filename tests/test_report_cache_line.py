"""The summary's expert-cache line counts every miss: those run on the CPU (CoServe, combined) and
the experts DuoServe's prefill streams are served without a fetch, so a 0% hit rate with nothing
moved must say where they went."""

from __future__ import annotations

from moelight.jobs.report import RunReport

CACHE = {"accesses": 136, "hits": 0, "misses": 136, "prefetch_issued": 0, "prefetch_used": 0, "prefetch_late": 0,
         "prefetch_wasted": 0, "cpu_executed": 0, "streamed": 0, "fetched_bytes": 0.0, "hit_rate": 0.0,
         "prefetch_recall": 0.0, "slots": 8, "policy": "coserve"}


def cache_line(**counts) -> str:
    report = RunReport(model="m", dtype="float32", requests=4, batch_size=4, micro_batch_size=4,
                       cache=CACHE | counts)
    return next(line for line in report.summary().splitlines() if line.startswith("expert cache"))


def test_cpu_run_and_streamed_misses_are_in_the_summary():
    line = cache_line(cpu_executed=136, streamed=24)
    assert "0.0 MiB moved, 136 of 136 misses run on the CPU, 24 experts streamed through prefill's own slots" in line


def test_a_cache_without_them_keeps_the_short_line():
    line = cache_line()
    assert line.endswith("0.0 MiB moved") and "CPU" not in line and "streamed" not in line
