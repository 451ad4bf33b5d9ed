"""benchmarks/gpu_smoke.py, the README's first command on a GPU, runs its steps on the emulated
device: every schedule and latency mode give the CPU engine's sequences, with the runtime's figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from moelight.pipeline.schedule import SCHEDULES

SMOKE = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_smoke.py"


def test_the_smoke_benchmark_dry_run(tmp_path):
    out = tmp_path / "rows.json"
    res = subprocess.run([sys.executable, str(SMOKE), "--device", "emulated", "--requests", "4", "--gen-len", "4",
                          "--json", str(out)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = json.loads(out.read_text())
    assert [r["run"] for r in rows] == [*SCHEDULES, "latency"]
    for r in rows:
        assert r["equal"] == r["requests"] == 4, r
        assert r["measured"] > 0 and r["predicted"] > 0 and r["peak"] > 0 and r["launches"] > 0, r
    assert all(r["syncs"] == 0 for r in rows if r["run"] != "latency")  # decode issues no host sync on CGOPipe
