"""Packing a layer's routed experts at load holds one expert, not one layer, above the weights it keeps
(runtime/expert_sources.py), never touches arrays a caller still holds, and the memory check counts what it
holds (planning/memory_check.expert_pack_transient_bytes)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cpu_kernels import dispatch
from moelight.loading.expert_storage import with_expert_format
from moelight.loading.hf_config import config_from_hf_dict
from moelight.loading.presets import PRESETS
from moelight.loading.weights import build_model
from moelight.planning import memory_check
from moelight.planning.memory_check import peak_rss_bytes, reset_peak_rss
from moelight.runtime import expert_sources
from moelight.runtime.fused_experts import pack_moe

MIB = 2**20
# one MoE layer of 32 experts, 6 MiB each in bf16 (192 MiB a layer; int4: ~1.7 and ~54 MiB), a small vocabulary
SHAPE = {"model_type": "mixtral", "vocab_size": 512, "hidden_size": 1024, "intermediate_size": 1024,
         "num_hidden_layers": 1, "num_attention_heads": 8, "num_key_value_heads": 2, "num_local_experts": 32,
         "num_experts_per_tok": 2, "max_position_embeddings": 256, "rope_theta": 1e6}

needs_packer = pytest.mark.skipif(not dispatch.packs_expert_by_expert(), reason="the C++ packer does not load here")


def _config(quantize: str):
    cfg = config_from_hf_dict(SHAPE)
    return with_expert_format(cfg, torch.bfloat16, "cpu", quantize) if quantize != "none" else cfg


def _model(quantize: str):
    return build_model(_config(quantize), torch.bfloat16, None, seed=0)


@needs_packer
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="no /proc/self/clear_refs to reset the peak")
@pytest.mark.parametrize("quantize", ["none", "int4"])
def test_packing_a_layer_peaks_one_expert_above_the_held_weights(quantize):
    cfg = _config(quantize)
    model = _model(quantize)
    layer = memory_check.layer_expert_bytes(cfg, torch.bfloat16)
    counted = memory_check.expert_pack_transient_bytes(cfg, torch.bfloat16)
    before = reset_peak_rss()
    pack_moe(model.layers[0].mlp, quantize, 128)
    rise = peak_rss_bytes() - before
    # packing the layer beside its loaded arrays rose by the whole layer (192 / 54 MiB)
    assert rise <= counted, f"peak {rise / MIB:.1f} MiB above the loaded model; counted {counted / MIB:.1f} MiB"
    assert counted < layer / 2


def _source_bytes(moe) -> int:
    return sum(w.nbytes() if hasattr(w, "codes") else w.numel() * w.element_size()
               for w in (moe.gate_up_proj, moe.down_proj))


@needs_packer
@pytest.mark.parametrize("quantize", ["none", "int4"])
def test_released_experts_pack_to_the_same_bytes(quantize, monkeypatch):
    """The pages of experts already packed are handed back, expert after expert (most of the layer), and the
    packed arrays are those of a pack that released nothing (a held reference keeps every page)."""
    made = []

    class Recording(expert_sources.ExpertSources):
        def __init__(self, arrays):
            super().__init__(arrays)
            self.calls = []
            made.append(self)

        def __call__(self, i):
            super().__call__(i)
            self.calls.append(i)

    monkeypatch.setattr("moelight.runtime.fused_experts.ExpertSources", Recording)
    released, kept = _model(quantize), _model(quantize)
    total = _source_bytes(released.layers[0].mlp)
    a = pack_moe(released.layers[0].mlp, quantize, 128).packed
    assert len(made) == 1 and made[0].calls == list(range(32))
    assert made[0].released_bytes() > 0.9 * total
    holder = kept.layers[0].mlp.gate_up_proj  # noqa: F841  (held: nothing of this layer is released)
    b = pack_moe(kept.layers[0].mlp, quantize, 128).packed
    assert len(made) == 1
    for name in ("w13", "s13", "z13", "w2", "s2", "z2"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), name


@pytest.mark.parametrize("quantize", ["none", "int4"])
@pytest.mark.parametrize("hold", ["parameter", "view"])
def test_arrays_a_caller_holds_keep_their_values(quantize, hold):
    model = _model(quantize)
    moe = model.layers[0].mlp
    experts = moe.gate_up_proj
    source = experts if quantize == "none" else experts.codes
    held = source if hold == "parameter" else source.detach()[1:]
    copy = held.clone()
    del experts, source
    pack_moe(moe, quantize, 128)
    assert torch.equal(held, copy)


@pytest.mark.parametrize("quantize", ["none", "int4"])
def test_only_arrays_the_model_alone_holds_are_released(quantize):
    model = _model(quantize)
    moe = model.layers[0].mlp
    assert expert_sources.sole_expert_arrays(moe) is not None
    held = moe.down_proj  # a parameter, or the QuantizedExperts holding the codes
    assert expert_sources.sole_expert_arrays(moe) is None
    del held
    view = moe.gate_up_proj[0] if quantize == "none" else moe.gate_up_proj.scales[0]
    assert expert_sources.sole_expert_arrays(moe) is None
    del view
    assert expert_sources.sole_expert_arrays(moe) is not None


@pytest.mark.parametrize("quantize", ["none", "int4"])
def test_memory_check_counts_one_expert_where_the_packer_releases(quantize, monkeypatch):
    cfg = _config(quantize)
    layer = memory_check.layer_expert_bytes(cfg, torch.bfloat16)
    monkeypatch.setattr(memory_check, "packs_expert_by_expert", lambda: True)
    assert memory_check.expert_pack_transient_bytes(cfg, torch.bfloat16) == (
        layer // 32 + memory_check.EXPERT_PACK_SLACK)
    tiny = PRESETS["tiny"]  # a layer smaller than the slack: never counted above the layer
    assert memory_check.expert_pack_transient_bytes(tiny, torch.bfloat16) == memory_check.layer_expert_bytes(
        tiny, torch.bfloat16)
    monkeypatch.setattr(memory_check, "packs_expert_by_expert", lambda: False)  # the torch reference packer
    assert memory_check.expert_pack_transient_bytes(cfg, torch.bfloat16) == layer
    monkeypatch.setattr(memory_check, "packs_expert_by_expert", lambda: True)
    if quantize == "none":  # the float32 loop packs a layer beside its loaded copy
        assert memory_check.expert_pack_transient_bytes(cfg, torch.float32) == memory_check.layer_expert_bytes(
            cfg, torch.float32)
        monkeypatch.setenv("MOELIGHT_EXPERTS", "loop")
        assert memory_check.expert_pack_transient_bytes(cfg, torch.bfloat16) == layer
