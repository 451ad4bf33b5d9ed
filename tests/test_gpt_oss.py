"""GPT-OSS specifics: MXFP4 expert weights (dequantised at load) against transformers, and the
attention sinks and sliding windows of the attention kernels against a float64 computation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from cpu_kernels import decode_attention, prefill_attention
from cpu_kernels.reference import decode_attention_torch
from moelight.models.mxfp4 import dequantize_mxfp4


def test_mxfp4_dequantisation_by_hand():
    blocks = torch.zeros(1, 16, dtype=torch.uint8)
    blocks[0, 0] = 0x2F  # low nibble 0xF = -6.0 (first value), high nibble 0x2 = 1.0 (second)
    blocks[0, 1] = 0x91  # low 0x1 = 0.5, high 0x9 = -0.5
    scales = torch.tensor([128], dtype=torch.uint8)  # 2^(128 - 127) = 2
    out = dequantize_mxfp4(blocks, scales)
    assert out.shape == (32,)
    assert out[:4].tolist() == [-12.0, 2.0, 1.0, -1.0] and not out[4:].any()
    with pytest.raises(ValueError, match="do not pair"):
        dequantize_mxfp4(blocks, torch.zeros(2, dtype=torch.uint8))


def _spec_dequant(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The OCP MX spec, value by value (independent of the loader's vectorised version)."""
    e2m1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    flat_b, flat_s = blocks.reshape(-1, 16).tolist(), scales.reshape(-1).tolist()
    rows = []
    for bytes_, s in zip(flat_b, flat_s, strict=True):
        for byte in bytes_:
            for nib in (byte & 0xF, byte >> 4):
                rows.append((-1.0 if nib & 8 else 1.0) * e2m1[nib & 7] * 2.0 ** (s - 127))
    return torch.tensor(rows, dtype=torch.float32).reshape(*blocks.shape[:-2], -1)


def test_mxfp4_checkpoint_matches_transformers(tmp_path):
    pytest.importorskip("transformers")
    from moelight import LLM, SamplingParams
    from tests.test_model_families import N_NEW, PROMPTS, hf_greedy, make_hf

    kw = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
              intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, sliding_window=5)
    hf = make_hf("GptOssConfig", kw, seed=11)
    g = torch.Generator().manual_seed(0)
    quantised = {}
    with torch.no_grad():
        for i, layer in enumerate(hf.model.layers):
            ex = layer.mlp.experts
            for name, (rows, cols) in (("gate_up_proj", (64, 32)), ("down_proj", (32, 32))):
                blocks = torch.randint(0, 256, (4, rows, cols // 32, 16), generator=g, dtype=torch.uint8)
                scales = torch.randint(121, 125, (4, rows, cols // 32), generator=g, dtype=torch.uint8)
                getattr(ex, name).copy_(_spec_dequant(blocks, scales).transpose(1, 2))  # HF keeps [E, in, out]
                prefix = f"model.layers.{i}.mlp.experts.{name}"
                quantised[prefix + "_blocks"], quantised[prefix + "_scales"] = blocks, scales
    folder = tmp_path / "gpt_oss_mxfp4"
    hf.save_pretrained(folder)
    path = folder / "model.safetensors"
    with safe_open(str(path), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys() if not k.endswith(("experts.gate_up_proj",
                                                                           "experts.down_proj"))}
    save_file(tensors | quantised, str(path), metadata={"format": "pt"})
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (folder / "config.json").write_text(json.dumps(cfg))
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "ByteTokenizer"}))

    llm = LLM(str(folder), dtype="float32", hardware="cpu-server")
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=N_NEW, temperature=0.0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p) for p in PROMPTS]
    # a scales tensor gone: the blocks name what they need
    save_file({k: v for k, v in (tensors | quantised).items() if not k.endswith("0.mlp.experts.down_proj_scales")},
              str(path))
    from moelight.errors import WeightsError

    with pytest.raises(WeightsError, match=r"down_proj_blocks needs .*down_proj_scales"):
        LLM(str(folder), dtype="float32", hardware="cpu-server")


# ----------------------------------------------------------------------------- attention


def _f64_attention(q, k, v, scale, sinks=None):
    """One query row over keys: softmax with an optional sink logit, float64."""
    s = (k.double() @ q.double()) * scale
    if sinks is not None:
        m = max(s.max(), sinks)
        w = torch.exp(s - m)
        return (w @ v.double()) / (w.sum() + torch.exp(sinks - m))
    return torch.softmax(s, 0) @ v.double()


@pytest.mark.usefixtures("backend")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window, with_sinks", [(None, True), (5, False), (5, True), (64, True)])
def test_decode_attention_sinks_and_window_against_float64(dtype, window, with_sinks):
    """Every path (torch, each C++ ISA the CPU has: sinks ride on the C++ split-K merge)."""
    g = torch.Generator().manual_seed(1)
    hq, hkv, d, lens = 8, 2, 64, [1, 3, 9, 40, 700]  # 700 keys: split into chunks by the C++ kernel
    caps = [n + 2 for n in lens]
    total = sum(caps)
    k = torch.randn(hkv, total, d, generator=g).to(dtype)
    v = torch.randn(hkv, total, d, generator=g).to(dtype)
    q = torch.randn(len(lens), hq, d, generator=g).to(dtype)
    sinks = torch.randn(hq, generator=g) if with_sinks else None
    offsets = torch.tensor([sum(caps[:i]) for i in range(len(caps))])
    lengths = torch.tensor(lens)
    out = decode_attention(q, k, v, offsets, lengths, 0.125, window=window, sinks=sinks)
    for b, n in enumerate(lens):
        first = offsets[b] + max(0, n - window) if window else offsets[b]
        last = offsets[b] + n
        for h in range(hq):
            kv = h // (hq // hkv)
            want = _f64_attention(q[b, h], k[kv, first:last], v[kv, first:last], 0.125,
                                  None if sinks is None else sinks[h].double())
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(out[b, h].double(), want, rtol=tol, atol=tol)


@pytest.mark.usefixtures("backend")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window, with_sinks", [(3, False), (None, True), (4, True), (200, True)])
def test_prefill_attention_sinks_and_window_against_float64(dtype, window, with_sinks):
    """Sequences shorter and longer than the window (C++: causal tiles, or one query per tile)."""
    g = torch.Generator().manual_seed(2)
    hq, hkv, d, lens = 4, 2, 64, [1, 6, 11, 70]
    T = sum(lens)
    q, k, v = (torch.randn(T, h, d, generator=g).to(dtype) for h in (hq, hkv, hkv))
    sinks = torch.randn(hq, generator=g) if with_sinks else None
    cu = torch.tensor([0, 1, 7, 18, 88])
    out = prefill_attention(q, k, v, cu, 0.2, window=window, sinks=sinks)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        for t in range(s, e):
            first = max(s, t - window + 1) if window else s
            for h in range(hq):
                kv = h // (hq // hkv)
                want = _f64_attention(q[t, h], k[first : t + 1, kv], v[first : t + 1, kv], 0.2,
                                      None if sinks is None else sinks[h].double())
                torch.testing.assert_close(out[t, h].double(), want, rtol=tol, atol=tol)


def test_window_without_sinks_keeps_the_cpp_kernel_exactly():
    """A window only narrows each block, so the fast path computes what the reference computes."""
    g = torch.Generator().manual_seed(3)
    k = torch.randn(2, 100, 64, generator=g)
    v = torch.randn(2, 100, 64, generator=g)
    q = torch.randn(2, 4, 64, generator=g)
    offsets, lengths = torch.tensor([0, 50]), torch.tensor([30, 47])
    fast = decode_attention(q, k, v, offsets, lengths, 0.1, window=8)
    ref = decode_attention_torch(q, k, v, offsets + lengths - 8, torch.tensor([8, 8]), 0.1)
    torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("schedule", ["cgopipe", "flexgen"])
def test_gpt_oss_on_the_emulated_cgopipe_runtime(tmp_path, schedule):
    """Sinks and sliding windows through the pipeline: CPU attention (cgopipe) and attention
    next to the device's KV buffer (flexgen), with the experts' biases resident beside the router."""
    pytest.importorskip("transformers")
    from moelight import LLM, SamplingParams
    from optimizer import Policy
    from tests.test_model_families import PROMPTS, VARIANTS, make_hf, save

    config_class, kwargs, _, _ = VARIANTS["gpt_oss-sinks-window4-yarn"]
    folder = save(make_hf(config_class, kwargs, seed=1), Path(tmp_path) / "g", "saved", None)
    attn_on_gpu = schedule == "flexgen"  # the placement each schedule runs
    pol = str(Policy(4, 2, 2, attn_on_gpu, True, 0.5, 0.0, "float32").save(tmp_path / "gpu.json"))
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    cpu = LLM(str(folder), dtype="float32", device="cpu", hardware="cpu-server")
    piped = LLM(str(folder), dtype="float32", device="emulated", hardware="t4", policy=pol, schedule=schedule)
    try:
        assert [o.outputs[0].token_ids for o in piped.generate(PROMPTS, greedy)] == \
            [o.outputs[0].token_ids for o in cpu.generate(PROMPTS, greedy)]
    finally:
        piped.close()
