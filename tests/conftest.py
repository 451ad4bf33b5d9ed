"""Suite-wide guards: no test profiles this machine or writes its profile cache by accident."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def fixed_hardware_profile(tmp_path_factory, monkeypatch):
    """Point the cached-profile path at a fixed CPU spec, so `--hardware profile` (the default of
    `moelight run` and `LLM`) plans against the same numbers on every host and takes no profile.
    Tests of the profiling itself monkeypatch the path again."""
    from hrm import hardware_presets

    path = tmp_path_factory.getbasetemp() / "hardware.json"
    if not path.is_file():
        hardware_presets.HARDWARE_PRESETS["cpu-server"].save(path)
    monkeypatch.setattr(hardware_presets, "DEFAULT_PROFILE_PATH", path)
