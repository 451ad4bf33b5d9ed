"""The GPU's cost per layer pass as `moelight profile` measures it: through the CGOPipe runtime itself
(here on the emulated device), so what a layer pass of the runtime costs beyond its kernels is in it."""

from __future__ import annotations

import time

from moelight.pipeline.pipeline_executor import PipelineExecutor
from moelight.profiling.runtime_pass import measure_runtime_layer_pass


def test_the_probe_runs_the_runtime_and_measures_its_cost_per_layer_pass(monkeypatch):
    plain = measure_runtime_layer_pass("emulated", quick=True)
    assert plain > 0
    post = PipelineExecutor.post_attention

    def slow_post_attention(self, *args, **kwargs):  # 20 ms more in every layer pass
        time.sleep(0.02)
        return post(self, *args, **kwargs)

    monkeypatch.setattr(PipelineExecutor, "post_attention", slow_post_attention)
    slowed = measure_runtime_layer_pass("emulated", quick=True)
    assert 0.015 < slowed - plain < 0.06, (plain, slowed)
