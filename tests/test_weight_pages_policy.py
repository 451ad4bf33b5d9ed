"""Weights on huge pages only where a decode step streams them (cpu_linear.weights_on_huge_pages): a job's
batch decides at load, and pack_model(huge_pages=False) keeps every weight on ordinary pages."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from moelight.engine import session
from moelight.loading.presets import PRESETS
from moelight.loading.weights import build_model
from moelight.runtime import cpu_linear, host_memory
from tests.test_host_memory import _mapping_of
from tests.test_run_policy import _hardware, _run

THP = host_memory.huge_pages_available()
KERNELS = cpu_linear.packing_supported(torch.bfloat16)


def test_rows_per_expert_decide():
    assert cpu_linear.weights_on_huge_pages(None, 2, 8)  # batch unknown: as before, huge pages
    assert cpu_linear.weights_on_huge_pages(1, 2, 8) and cpu_linear.weights_on_huge_pages(64, 2, 8)
    assert not cpu_linear.weights_on_huge_pages(256, 2, 8)  # the README job: 64 rows per expert
    assert cpu_linear.weights_on_huge_pages(256, 8, 128)  # Qwen3-30B-A3B at batch 256: 16 rows per expert


def _streamed(model) -> list[torch.Tensor]:
    layer = model.layers[0]
    experts = layer.mlp.gate_up_proj.packed
    return [experts.w13, experts.w2, layer.self_attn.o_proj.weight_bf16, layer.self_attn.fused_qkv.weight]


@pytest.mark.skipif(not (THP and KERNELS), reason="needs transparent huge pages and oneDNN's bf16 packing")
@pytest.mark.parametrize("huge", [True, False])
def test_pack_model_places_streamed_weights_by_the_flag(huge):
    wide = replace(PRESETS["tiny"], hidden_size=1024, intermediate_size=1024, num_layers=1, vocab_size=512,
                   num_heads=16, num_kv_heads=4, head_dim=64, num_experts=2, top_k=2)
    model = build_model(wide, torch.bfloat16, None, seed=0)
    cpu_linear.pack_model(model, huge_pages=huge)
    for t in _streamed(model):
        # an empty_huge mapping holds a huge page more than its tensor; the VMA's own flag is checked only
        # where huge pages were asked for (a newer kernel may merge a plain mapping into an advised neighbour)
        assert (t.untyped_storage().nbytes() >= t.numel() * t.element_size() + host_memory.HUGE_PAGE) == huge
        assert not huge or "hg" in _mapping_of(t.data_ptr())["VmFlags"].split()


@pytest.mark.parametrize(("batch", "huge"), [(1, True), (40, False)])  # tiny: 4 experts, top 2
def test_a_job_loads_for_its_batch(tmp_path, monkeypatch, batch, huge):
    """Its huge pages (weights_on_huge_pages) and its plain bf16 copies (keeps_plain_weights: batch <= 4)."""
    seen = []
    real = session.pack_model

    def spy(*a, **k):
        seen.append((k.get("huge_pages"), k.get("plain_weights")))
        return real(*a, **k)

    monkeypatch.setattr(session, "pack_model", spy)
    r, rep, _ = _run(tmp_path, "--hardware", _hardware(tmp_path), "--batch-size", str(batch), n=batch)
    assert r.exit_code == 0, r.output
    assert rep["batch_size"] == batch and seen == [(huge, batch == 1)]
