"""Profile probes that measure what a decode step pays in place: experts streamed from DRAM layer after
layer, the layer glue between the kernels, the host's passes over the logits."""

import pytest

from moelight.profiling.layer_glue import glue_line


def test_glue_line_through_two_points():
    # 1 ms fixed + bytes at 2 GB/s: 32 tokens move 2 MB, 256 tokens 16 MB
    overhead, rate = glue_line((1e-3 + 2e6 / 2e9, 1e-3 + 16e6 / 2e9), (2e6, 16e6), 5e-4)
    assert overhead == pytest.approx(1e-3) and rate == pytest.approx(2e9)


def test_glue_line_on_a_noisy_host_keeps_a_rate():
    overhead, rate = glue_line((3e-3, 2e-3), (2e6, 16e6), 5e-4)  # the larger count "faster"
    assert overhead == 5e-4 and rate == pytest.approx(16e6 / 1.5e-3)  # all of it element-wise, never free


def test_the_expert_probe_cycles_layer_copies(monkeypatch):
    """One layer's experts multiplied again and again stay in a large last-level cache; a decode step reads
    every layer's from DRAM. The probe cycles through copies, each a distinct pack."""
    pytest.importorskip("torch")
    import cpu_kernels
    from cpu_kernels import kernel_backend
    from moelight.profiling import expert_kernel_curve as ec

    if kernel_backend() == "torch":
        pytest.skip("no fused expert kernel here")
    seen: dict[str, set[int]] = {}
    real = cpu_kernels.expert_mix

    def recording(x, ids, w, packed, *a):
        seen.setdefault(packed.fmt13, set()).add(packed.w13.data_ptr())
        return real(x, ids, w, packed, *a)

    monkeypatch.setattr(cpu_kernels, "expert_mix", recording)
    monkeypatch.setattr(ec, "EXPERT_ROWS_QUICK", (1,))
    curves = ec.measure_expert_curve(quick=True, stream_bytes=1)  # at least two layers whatever the size
    assert set(curves) == {"bfloat16", "int8", "uint4", "mxfp4"}
    assert len(seen) == 4 and all(len(ptrs) >= 2 for ptrs in seen.values())  # two distinct packs a format at least
    packed = ec.layer_copies(type("P", (), {"nbytes": lambda self: 100})(), stream_bytes=1000)
    assert len(packed) == 10


def test_a_curve_samples_each_point_a_round_apart(monkeypatch):
    """A slow phase that covers three consecutive passes cannot take every sample of one point: the
    points are timed in rounds (one warm-up first), each point's fastest kept. Back to back, the three
    slow passes here would be all of the middle point's samples (4.0, not 1.0)."""
    import time

    from moelight.profiling.timing import fastest_in_rounds

    clock, order = [0.0], []
    costs = iter([9.0, 1.0, 1.0, 1.0, 4.0, 4.0, 4.0, 1.0, 1.0, 1.0])  # warm-up, then the 4th-6th passes slow

    def point(i):
        def run():
            order.append(i)
            clock[0] += next(costs)
        return run

    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    assert fastest_in_rounds([point(0), point(1), point(2)], rounds=3) == [1.0, 1.0, 1.0]
    assert order == [0, 0, 1, 2, 0, 1, 2, 0, 1, 2]


def test_the_logits_passes_are_measured():
    pytest.importorskip("torch")
    from moelight.profiling.machine_profile import measure_logits_passes

    assert 1e8 < measure_logits_passes(quick=True) < 1e13


def test_the_layer_glue_is_measured_in_place():
    torch = pytest.importorskip("torch")
    from moelight.profiling.layer_glue import measure_layer_glue
    from moelight.runtime.cpu_linear import packing_supported, upcast_bf16_linears

    overhead, rate = measure_layer_glue(torch.bfloat16, quick=True, fallback_overhead=1e-4)
    if packing_supported(torch.bfloat16) or upcast_bf16_linears():
        assert 0.0 <= overhead < 0.1 and 1e8 < rate < 1e13
    else:
        assert (overhead, rate) == (1e-4, 0.0)


def test_the_layer_glue_is_the_median_step_less_its_kernels_and_gemms(monkeypatch):
    """The warm-up step is dropped, the kernels timed in place are subtracted, and each step's rest less
    the GEMMs timed alone right after it (the same phase of the host) gives one sample; the glue is
    their median (a job pays the typical step, not the best). A fake clock makes each able to fail:
    the difference of the medians would be 2, not 1."""
    torch = pytest.importorskip("torch")
    import time
    from dataclasses import replace
    from types import SimpleNamespace

    import moelight.runtime.forward as forward
    from moelight.loading.presets import PRESETS
    from moelight.profiling import layer_glue

    clock = [0.0]
    kernel_s = 0.5
    step_rests = iter([100.0, 1.0, 5.0, 2.0, 9.0, 3.0])  # the warm-up, then five samples
    gemms_alone = iter([50.0, 0.5, 4.0, 1.0, 1.0, 2.0])  # rest less GEMMs: 0.5, 1, 1, 8, 1 (median 1)

    class Experts:
        def fused_mix(self):
            clock[0] += kernel_s

    experts = Experts()
    model = SimpleNamespace(layers=[SimpleNamespace(mlp=SimpleNamespace(gate_up_proj=experts))])

    def fake_step(model, cache, ids, offsets, pos):
        clock[0] += next(step_rests)
        model.layers[0].mlp.gate_up_proj.fused_mix()

    monkeypatch.setattr(forward, "decode_step", fake_step)
    monkeypatch.setattr(layer_glue, "_gemms_alone_seconds", lambda model, tokens, dtype: next(gemms_alone))
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    cfg = replace(PRESETS["bench-1b"], num_layers=4, vocab_size=256)
    glue = layer_glue._glue_seconds(model, cfg, torch.bfloat16, tokens=2, samples=5)
    assert glue == pytest.approx(1.0 / 4)
    assert "fused_mix" not in vars(experts)  # the timing wrapper is removed afterwards


def test_the_gemms_alone_are_the_layers_own(monkeypatch):
    """The GEMMs timed alone are every layer's q/k/v, o and router products at the step's row count."""
    torch = pytest.importorskip("torch")
    from dataclasses import replace

    from moelight.loading.presets import PRESETS
    from moelight.loading.weights import build_model
    from moelight.models import moe
    from moelight.profiling import layer_glue

    cfg = replace(PRESETS["bench-1b"], num_layers=2, vocab_size=256, hidden_size=64, intermediate_size=64,
                  num_heads=4, num_kv_heads=2, head_dim=16, num_experts=4)
    model = build_model(cfg, torch.float32, None, 0)
    calls = []
    for i, layer in enumerate(model.layers):
        layer.self_attn.qkv = lambda h, i=i: calls.append(("qkv", i, tuple(h.shape)))
        layer.self_attn.o_proj.forward = lambda a, i=i: calls.append(("o", i, tuple(a.shape)))
    monkeypatch.setattr(moe, "router_logits", lambda h, w: calls.append(("router", tuple(w.shape), tuple(h.shape))))
    assert layer_glue._gemms_alone_seconds(model, 3, torch.float32) >= 0.0
    assert calls == [("qkv", 0, (3, 64)), ("o", 0, (3, 64)), ("router", (4, 64), (3, 64)),
                     ("qkv", 1, (3, 64)), ("o", 1, (3, 64)), ("router", (4, 64), (3, 64))]
