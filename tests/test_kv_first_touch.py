"""The KV cache pool's first touch: prefill pays for faulting in the batch's fresh pool (the HRM's term and the
profile's probe of its rate)."""

import pytest

from hrm import HardwareSpec, Level, WorkloadSpec, costs, get_model
from hrm.hardware_checks import spec_problems
from optimizer import Policy, build_point_model, predict_job


def _level(**kw) -> Level:
    base = dict(name="c", memory_bytes=64 * 2**30, bandwidth=1e12, flops={"bfloat16": 256e9, "float32": 128e9})
    return Level(**(base | kw))


def test_prefill_pays_for_faulting_in_the_batchs_kv_pool_and_decode_does_not():
    m, wl = get_model("bench-1b"), WorkloadSpec(85, 64, 130, shared_prefix=80)
    free = HardwareSpec("h", _level())
    paid = HardwareSpec("h", _level(kv_first_touch_bandwidth=1e9))
    pool = costs.kv_cache_bytes(m, 256, wl.max_context, layers=m.num_layers)  # the engine's pool: ~312 MB
    assert costs.kv_first_touch_time(free, pool) == 0.0  # unmeasured (datasheet presets): free
    assert costs.kv_first_touch_time(paid, pool) == pytest.approx(pool / 1e9)
    a = build_point_model(free, m, wl, "bfloat16", 256, 1, 0, 0)
    b = build_point_model(paid, m, wl, "bfloat16", 256, 1, 0, 0)
    assert float(b.prefill_time(0, 0) - a.prefill_time(0, 0)) == pytest.approx(pool / 1e9)
    assert float(b.decode_step_time(0, 0)) == pytest.approx(float(a.decode_step_time(0, 0)))
    policy = Policy(256, 256, 1, False, False, 0.0, 0.0, "bfloat16")
    slow, fast = (predict_job(hw, m, wl, policy, 256) for hw in (paid, free))
    assert slow["prefill_seconds"] - fast["prefill_seconds"] == pytest.approx(pool / 1e9)
    assert slow["decode_seconds"] == pytest.approx(fast["decode_seconds"])


def test_the_first_touch_rate_roundtrips_scales_and_is_checked(tmp_path):
    hw = HardwareSpec("p", _level(kv_first_touch_bandwidth=2e9))
    assert HardwareSpec.load(hw.save(tmp_path / "p.json")).cpu.kv_first_touch_bandwidth == 2e9
    assert hw.cpu.scaled(2).kv_first_touch_bandwidth == 4e9
    bad = HardwareSpec("p", _level(kv_first_touch_bandwidth=-1.0))
    assert any("kv_first_touch_bandwidth" in p for p in spec_problems(bad))


def test_the_probe_faults_in_fresh_pools_of_the_engines_kv_cache(monkeypatch):
    from moelight.profiling import kv_first_touch
    from moelight.runtime import kv_cache

    caches, writes = [], []
    write = kv_cache.RaggedKVCache.write

    def counted_write(self, layer, k, v, slots):
        if not any(c is self for c in caches):
            caches.append(self)
        writes.append((len(caches), layer, int(slots[1] - slots[0]) if len(slots) > 1 else 0))
        return write(self, layer, k, v, slots)

    monkeypatch.setattr(kv_cache.RaggedKVCache, "write", counted_write)
    rate = kv_first_touch.measure_kv_first_touch(pool_bytes=4 * 2**20, pools=3)
    assert rate > 0
    assert len(caches) == 3  # a fresh pool each time: a touched one would measure a plain write
    assert sorted((w[0], w[1]) for w in writes) == [(p, j) for p in (1, 2, 3) for j in range(8)]  # all layers
    assert {w[2] for w in writes} == {16}  # one row a page: every page of the pool is touched once
