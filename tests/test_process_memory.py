"""The host memory a job's own process needs beside the model (torch, the tokenizer, the engine's runtime:
~330 MiB for a tiny model) counts against a hardware file's host memory: a DeepSeek-V2 tiny job planned for
a 400 MiB host counted 25.7 MiB and peaked at 402 MiB; a host below the process's own memory ran anyway.
Planning for this machine, MemAvailable already leaves the process out: it is not counted twice."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from moelight.cli import app
from moelight.planning import memory_check
from moelight.planning.hardware_choice import PlanError
from moelight.sampling.params import SamplingParams
from tests.test_durability import ROOT, _env

MIB = 2**20


def _host_file(tmp_path: Path, mib: int) -> Path:
    from hrm import hardware_presets

    hw = hardware_presets.get_hardware("cpu-server")
    path = tmp_path / f"host_{mib}m.json"
    replace(hw, name=f"host{mib}m", cpu=replace(hw.cpu, memory_bytes=mib * MIB)).save(path)
    return path


def _plan(monkeypatch, hardware: str | None, process: int, available: int = 64 * 2**30, n: int = 8):
    """The session's plan of n tiny-model requests (nothing loads) with this process holding `process` bytes."""
    from moelight.engine import session
    from moelight.engine.options import EngineOptions

    monkeypatch.setattr(memory_check, "process_bytes", lambda: process)
    monkeypatch.setattr(session, "available_bytes", lambda: available)
    s = session.EngineSession(EngineOptions(model="tiny", load_format="dummy", device="cpu", hardware=hardware))
    prompts = [[1 + i % 50] * (10 + i % 20) for i in range(n)]
    return s.plan(prompts, [SamplingParams(max_tokens=3)] * n)


def test_a_hardware_files_host_memory_is_net_of_this_process(monkeypatch, tmp_path):
    plan = _plan(monkeypatch, str(_host_file(tmp_path, 1024)), 300 * MIB)
    held = 300 * MIB + memory_check.RUNTIME_GROWTH
    assert plan.hardware.cpu.memory_bytes == 1024 * MIB - held and plan.info["host_in_use"] == held


def test_a_hardware_file_below_this_process_memory_is_refused_before_loading(monkeypatch, tmp_path):
    refused = r"declares 0.20 GiB of host memory, but this process needs 0.36 GiB .*no job fits"
    with pytest.raises(PlanError, match=refused):
        _plan(monkeypatch, str(_host_file(tmp_path, 200)), 300 * MIB)


def test_the_cli_refuses_it_with_exit_2_and_no_traceback(monkeypatch, tmp_path):
    monkeypatch.setattr(memory_check, "process_bytes", lambda: 300 * MIB)
    data, out = tmp_path / "d.jsonl", tmp_path / "o.jsonl"
    data.write_text(json.dumps({"id": "q0", "prompt": "hello"}) + "\n")
    res = CliRunner().invoke(app, ["run", "--dataset", str(data), "--output", str(out), "--model", "tiny",
                                   "--load-format", "dummy", "--device", "cpu", "--no-progress",
                                   "--hardware", str(_host_file(tmp_path, 200))])
    assert res.exit_code == 2 and "Traceback" not in res.output and "no job fits" in res.output, res.output
    assert not out.exists() or not out.read_text()


def test_this_machines_plan_counts_the_process_once(monkeypatch):
    """MemAvailable (+ the model held) already excludes this process's memory: not cut again."""
    plan = _plan(monkeypatch, None, 300 * MIB, available=900 * MIB)
    assert plan.hardware.cpu.memory_bytes == 900 * MIB


def test_a_tiny_jobs_peak_stays_within_what_the_plan_counted(tmp_path):
    """RUNTIME_GROWTH measured: a one-request job's peak resident memory is no more than the process's memory
    at its plan plus RUNTIME_GROWTH (the tiny model's weights, KV cache and activations are a few MiB)."""
    data, out = tmp_path / "d.jsonl", tmp_path / "o.jsonl"
    data.write_text(json.dumps({"id": "q0", "prompt": "hello there"}) + "\n")
    subprocess.run([sys.executable, "-m", "moelight", "run", "--dataset", str(data), "--output", str(out),
                    "--model", "tiny", "--load-format", "dummy", "--device", "cpu", "--gen-len", "4",
                    "--hardware", "cpu-server", "--no-progress"], cwd=ROOT, env=_env(), check=True,
                   capture_output=True, timeout=120)
    report = json.loads(Path(f"{out}.report.json").read_text())
    assert report["peak_memory_bytes"] <= report["policy"]["host_in_use"] + 4 * MIB, report["policy"]


def test_a_job_started_from_a_large_process_reports_its_own_peak(tmp_path):
    """getrusage's ru_maxrss survives exec: a job run from a process holding 300 MiB reported at least
    that as its peak (7 GB under a full test run). The peak is the process's own (VmHWM)."""
    held = bytearray(300 * MIB)
    held[::4096] = b"\x01" * len(held[::4096])  # touch every page: resident in this (the parent) process
    code = "from moelight.planning.memory_check import peak_rss_bytes; print(peak_rss_bytes())"
    child = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(), check=True, capture_output=True,
                           text=True, timeout=120)
    assert int(child.stdout) < 250 * MIB, (int(child.stdout) / MIB, len(held))
