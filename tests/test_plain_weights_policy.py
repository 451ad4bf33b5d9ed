"""Plain bf16 copies of the packed linears only for small-batch jobs (cpu_linear.keeps_plain_weights): a
large batch's job does not pay their memory, and the check before loading counts what the load keeps (a job's
batch reaching the loader: tests/test_weight_pages_policy.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from cpu_kernels import dispatch
from moelight.loading.presets import PRESETS
from moelight.loading.weights import build_model
from moelight.planning import memory_check
from moelight.runtime import cpu_linear

PLAIN = (cpu_linear.extra_linear_bytes(torch.bfloat16, 1024)
         > cpu_linear.extra_linear_bytes(torch.bfloat16, 1024, plain=False))


def test_small_batches_keep_them():
    rows = dispatch.SMALL_LINEAR_ROWS
    assert cpu_linear.keeps_plain_weights(None) and cpu_linear.keeps_plain_weights(1)
    assert cpu_linear.keeps_plain_weights(rows) and not cpu_linear.keeps_plain_weights(rows + 1)


@pytest.mark.skipif(not PLAIN, reason="this CPU keeps no plain bf16 weights beside packed ones")
def test_the_memory_check_counts_them_only_where_kept():
    cfg = PRESETS["bench-1b"]
    with_plain = memory_check.weight_bytes(cfg, torch.bfloat16, on_cpu=True)
    without = memory_check.weight_bytes(cfg, torch.bfloat16, on_cpu=True, plain_weights=False)
    assert with_plain - without == 2 * sum(n for _, n, _ in memory_check.packed_linear_sizes(cfg))


@pytest.mark.skipif(not PLAIN, reason="this CPU keeps no plain bf16 weights beside packed ones")
def test_pack_model_without_them_gives_the_same_outputs():
    cfg = replace(PRESETS["tiny"], num_layers=1)
    kept, dropped = (build_model(cfg, torch.bfloat16, None, seed=0) for _ in range(2))
    cpu_linear.pack_model(kept)
    cpu_linear.pack_model(dropped, plain_weights=False)
    assert kept.lm_head.weight_bf16 is not None and dropped.lm_head.weight_bf16 is None
    x = torch.randn(1, cfg.hidden_size).to(torch.bfloat16)  # one row: small_linear against oneDNN's packed
    torch.testing.assert_close(kept.lm_head(x).float(), dropped.lm_head(x).float(), rtol=1e-2, atol=1e-2)

