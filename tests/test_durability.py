"""A job killed at any moment loses nothing: SIGKILL at a random point of `moelight run` (ten seeds:
while starting, loading, generating, writing), then `--resume` -> every id exactly once, no partial
line, the job record intact, the dataset byte-identical. The killed job is a process of its own; the
resume runs the same command in this process (nothing of the killed job's state can reach it)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from moelight.cli import app

ROOT = Path(__file__).resolve().parents[1]
N = 24


def _args(data: Path, out: Path, *extra: str) -> list[str]:
    """`moelight run`'s arguments for the job."""
    return ["run", "--dataset", str(data), "--output", str(out), "--model", "tiny", "--load-format", "dummy",
            "--gen-len", "6", "--batch-size", "3", "--hardware", "cpu-server", "--no-progress", *extra]


def _command(data: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "moelight", *_args(data, out)]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("durable") / "d.jsonl"
    path.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"question {i} " * (1 + i % 4)}) + "\n"
                            for i in range(N)))
    return path


@pytest.fixture(scope="module")
def job_seconds(data, tmp_path_factory) -> float:
    """How long one whole job takes here: the kills land anywhere within it."""
    out = tmp_path_factory.mktemp("timing") / "o.jsonl"
    t0 = time.perf_counter()
    subprocess.run(_command(data, out), check=True, capture_output=True, cwd=ROOT, env=_env())
    return time.perf_counter() - t0


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


@pytest.mark.parametrize("seed", range(10))
def test_sigkill_anywhere_then_resume_writes_every_id_once(data, job_seconds, tmp_path, seed):
    before = data.read_bytes()
    out = tmp_path / "o.jsonl"
    proc = subprocess.Popen(_command(data, out), cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    time.sleep(random.Random(seed).uniform(0.05, 1.0) * job_seconds)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    resumed = CliRunner().invoke(app, _args(data, out, "--resume"))
    assert resumed.exit_code == 0, (resumed.output[-2000:], resumed.exception)
    lines = out.read_text().splitlines()
    assert all(line.strip() for line in lines)
    records = [json.loads(line) for line in lines]  # no partial line survives
    assert sorted(r["id"] for r in records) == sorted(f"q{i}" for i in range(N))  # each exactly once
    assert json.loads((tmp_path / "o.jsonl.job.json").read_text())["requests"].keys() == {r["id"] for r in records}
    assert data.read_bytes() == before
