"""A profile taken while other processes use the CPUs says so: in its saved notes, in `moelight
profile`'s output, and in the log of every plan that reads it. The load average before it does not
count (after `pip install` builds the kernels it is high on an idle host)."""

from __future__ import annotations

import json
import os
import time
from types import SimpleNamespace

import pytest

from hrm import hardware_presets
from moelight.planning.hardware_choice import resolve_hardware
from moelight.profiling import gpu_profile, host_load, machine_profile
from moelight.profiling.host_load import BUSY_SHARE, OtherWork, busy_note, busy_warning, host_busy_seconds


def test_busy_note_names_the_share_and_what_to_do():
    assert busy_note(0.1, 2) == "" and busy_note(BUSY_SHARE, 4) == ""
    note = busy_note(0.6, 2)
    assert "busy" in note and "60%" in note and "2 CPUs" in note and "moelight profile" in note
    assert busy_warning(f"measured by moelight profile; {note}") == "warning: " + note
    assert busy_warning("measured by moelight profile (no CUDA)") == ""


def test_other_work_counts_other_processes_not_this_one(monkeypatch):
    # A host whose other processes keep 0.3 of a CPU busy, read through a fake /proc/stat: on a real
    # one, other work that this process's spinning displaces would hide the count under test.
    start = time.perf_counter()
    monkeypatch.setattr(host_load, "host_busy_seconds",
                        lambda: time.process_time() + 0.3 * (time.perf_counter() - start))
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    with OtherWork() as own:  # this process busy: not other work
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 0.3:
            pass
    assert abs(own.other_share() - 0.15) < 0.03, own.other_share()
    assert own.note() == ""


def test_host_busy_seconds_reads_a_growing_count():
    first = host_busy_seconds()
    if first is None:
        pytest.skip("no /proc/stat here")
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 0.2:  # this process busy: the host's count moves
        pass
    assert host_busy_seconds() > first


def _fake_measurements(monkeypatch, load: float) -> None:
    """profile_machine without its measurements (a preset's CPU level stands in), while the host
    spends `load` CPU-seconds busy in one second of its two CPUs."""
    cpu = hardware_presets.get_hardware("t4").cpu
    monkeypatch.setattr(machine_profile, "measure_cpu", lambda quick=False: cpu)
    monkeypatch.setattr(machine_profile, "measure_gpu", lambda quick=False: None)
    monkeypatch.setattr(gpu_profile, "measure_staging", lambda quick=False: 1e9)
    busy = iter([0.0, load])  # CPU-seconds the host spent busy before and after the profile
    monkeypatch.setattr(host_load, "host_busy_seconds", lambda: next(busy))
    clock = SimpleNamespace(perf_counter=iter([0.0, 1.0]).__next__, process_time=lambda: 0.0)
    monkeypatch.setattr(host_load, "time", clock)  # a 1-second profile that took no CPU of its own
    monkeypatch.setattr(os, "cpu_count", lambda: 2)


def test_a_busy_profile_says_so_when_saved_and_when_a_plan_reads_it(monkeypatch, tmp_path):
    _fake_measurements(monkeypatch, 0.1)
    assert busy_warning(machine_profile.profile_machine(quick=True).notes) == ""
    _fake_measurements(monkeypatch, 1.2)
    hw = machine_profile.profile_machine(quick=True)
    assert "busy" in busy_warning(hw.notes)
    path = hw.save(tmp_path / "hw.json")
    logged: list[str] = []
    resolve_hardware(str(path), logged.append)
    assert any(line.startswith("warning: the host was busy") for line in logged), logged
    logged.clear()
    resolve_hardware("t4", logged.append)  # a preset carries no such note
    assert logged == []


def test_a_first_run_profile_taken_beside_other_work_warns(monkeypatch, tmp_path):
    _fake_measurements(monkeypatch, 1.2)
    monkeypatch.setattr(hardware_presets, "DEFAULT_PROFILE_PATH", tmp_path / "hardware.json")
    logged: list[str] = []
    hw = resolve_hardware(None, logged.append)
    assert (tmp_path / "hardware.json").is_file() and "busy" in hw.notes
    assert any("took a quick one" in line for line in logged)
    assert any(line.startswith("warning: the host was busy") for line in logged), logged


def test_a_cached_profile_cut_short_is_taken_again_and_saves_are_atomic(monkeypatch, tmp_path):
    """A kill or a full disk mid-write left half a JSON file, and every later run failed on it."""
    _fake_measurements(monkeypatch, 0.0)
    cached = tmp_path / "hardware.json"
    monkeypatch.setattr(hardware_presets, "DEFAULT_PROFILE_PATH", cached)
    cached.write_text('{"name": "prof')
    logged: list[str] = []
    hw = resolve_hardware(None, logged.append)
    assert any("damaged profile: took a quick one" in line for line in logged), logged
    assert json.loads(cached.read_text())["name"] == hw.name
    assert [p.name for p in tmp_path.iterdir()] == ["hardware.json"]  # no temporary left beside it
