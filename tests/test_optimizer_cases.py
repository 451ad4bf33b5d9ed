"""Random small planning problems shared by the optimizer tests (plus a check of their variety)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from hrm.hardware import HardwareSpec, Level, Link
from hrm.model import ModelSpec
from hrm.workload import WorkloadSpec

DTYPE = "bfloat16"


def random_case(seed: int) -> tuple[HardwareSpec, ModelSpec, WorkloadSpec]:
    """A small model on hardware whose GPU holds only part of it (or no GPU at all)."""
    rng = np.random.default_rng(seed)
    heads = int(rng.choice([4, 8]))
    e = int(rng.choice([4, 8]))
    m = ModelSpec(f"rand{seed}", vocab_size=int(rng.choice([256, 1024])),
                  hidden_size=int(rng.choice([64, 128])),
                  intermediate_size=int(rng.choice([128, 256, 512])), num_layers=int(rng.choice([2, 4, 8])),
                  num_experts=e, top_k=int(rng.choice([1, 2])), num_heads=heads,
                  num_kv_heads=int(rng.choice([1, 2, heads])), head_dim=16)
    b = 2.0
    w_e = m.num_layers * m.layer_expert_params() * b
    non_exp = m.non_expert_params() * b
    wl = WorkloadSpec(prompt_len=float(rng.integers(4, 64)), gen_len=int(rng.integers(2, 40)),
                      max_prompt_len=80, padded=bool(rng.random() < 0.3))
    kv_seq = 2 * m.kv_dim * b * m.num_layers * wl.max_context
    cpu = Level("cpu", (w_e + non_exp + kv_seq * rng.uniform(5, 60)) / 0.9 * rng.uniform(0.9, 1.5),
                rng.uniform(2e10, 2e11), {"bfloat16": rng.uniform(1e11, 2e12)})
    if rng.random() < 0.15:
        return HardwareSpec("cpu-only", cpu), m, wl
    gpu = Level("gpu", (non_exp + w_e * rng.uniform(0.2, 1.2)) / 0.9, rng.uniform(1e11, 1e12),
                {"bfloat16": rng.uniform(1e12, 1e14)})
    link = Link(rng.uniform(5e9, 6e10), rng.uniform(5e9, 6e10))
    count = int(rng.choice([1, 1, 2]))
    if count == 2 and m.num_kv_heads == 1:  # two GPUs split the KV heads: give them two
        m = replace(m, num_kv_heads=2)
    return HardwareSpec(f"rand{seed}", cpu, gpu, count, link), m, wl


def test_cases_cover_gpu_and_cpu_only_hosts():
    """The random problems must exercise both kinds of host, or the brute-force test proves little."""
    hosts = [random_case(s)[0] for s in range(52)]
    assert sum(h.has_gpu for h in hosts) >= 30
    assert sum(not h.has_gpu for h in hosts) >= 3
    assert any(h.gpu_count == 2 for h in hosts)
