"""The GPU's cost per layer pass as `moelight profile` measures it: through the CGOPipe runtime itself
(here on the emulated device), so what a layer pass of the runtime costs beyond its kernels is in it."""

from __future__ import annotations

import time

from moelight.pipeline.pipeline_executor import PipelineExecutor
from moelight.profiling.runtime_pass import measure_runtime_layer_pass


def test_the_probe_runs_the_runtime_and_measures_its_cost_per_layer_pass(monkeypatch):
    post = PipelineExecutor.post_attention

    def slow_post_attention(self, *args, **kwargs):  # 20 ms more in every layer pass
        time.sleep(0.02)
        return post(self, *args, **kwargs)

    plain, slowed = [], []
    for _ in range(2):  # alternated, the least of each: another process's burst inflates one probe, not both
        monkeypatch.setattr(PipelineExecutor, "post_attention", post)
        plain.append(measure_runtime_layer_pass("emulated", quick=True))
        monkeypatch.setattr(PipelineExecutor, "post_attention", slow_post_attention)
        slowed.append(measure_runtime_layer_pass("emulated", quick=True))
    assert min(plain) > 0
    assert 0.015 < min(slowed) - min(plain) < 0.06, (plain, slowed)


def test_a_cached_gpu_profile_without_the_runtime_s_cost_is_retaken(tmp_path):
    import json

    from hrm import Level, Link
    from moelight.planning.hardware_choice import _profile_is_stale
    from tests.current_profile import save_current_profile

    gpu = Level("g", 1e10, 1e11, {"bfloat16": 1e13}, gemm_bandwidth=5e10, layer_overhead_s=5e-4,
                runtime_layer_s=4e-3)
    path = save_current_profile(tmp_path / "hardware.json", gpu=gpu, gpu_count=1, link=Link(h2d=1e10, d2h=1e10))
    assert not _profile_is_stale(path)
    d = json.loads(path.read_text())
    del d["gpu"]["runtime_layer_s"]  # written before moelight profile measured it
    path.write_text(json.dumps(d))
    assert _profile_is_stale(path)
