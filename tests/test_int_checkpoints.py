"""GPTQ, AWQ, compressed-tensors and block-scaled FP8 checkpoints read as they ship
(loading/int_checkpoints.py).

Each case quantizes every linear layer of a small Mixtral (attention and experts; router and LM head
stay dense, as quantizers leave them) round-to-nearest into integer codes, scales and zero points,
packs them in the format's layout (GPTQ: values along K in int32 rows, zero points along N, the
original format storing each zero less one; AWQ GEMM: K rows of N packed in its interleaved nibble
order; compressed-tensors: a bit stream along K, signed values offset, zero points packed down the
rows), and writes the same values dequantised as a plain checkpoint (the dequantize-then-matmul
reference):
- float32: every weight loads to exactly the reference's value, and greedy tokens are the same;
- bfloat16 on the CPU: routed experts stay quantized (the kernel's uint4 / int8 / fp8), logits
  within the kernel's rounding of the reference's.
The compressed-tensors packer here is checked against the library's own where it is installed.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from moelight.errors import ConfigError, WeightsError
from moelight.loading.expert_storage import with_expert_format
from moelight.loading.hf_config import config_from_hf_dict, load_config
from moelight.loading.presets import PRESETS
from moelight.loading.weights import build_model
from moelight.models.quantized_experts import QuantizedExperts
from moelight.runtime.cpu_linear import pack_model
from tests.test_fused_experts_engine import _logits, _prompts, _rel

TINY = PRESETS["tiny"]
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _rtn(w: torch.Tensor, bits: int, group: int, sym: bool):
    """[N, K] -> unsigned codes u [N, K], zero [N, G] (integers), scale [N, G]; w ~ (u - zero) * scale."""
    n, k = w.shape
    g = k if group == -1 else group
    wg = w.float().view(n, k // g, g)
    top = (1 << bits) - 1
    if sym:
        scale = wg.abs().amax(-1) / (top // 2) + 1e-8
        zero = torch.full_like(scale, float(1 << (bits - 1)))
    else:
        lo, hi = wg.amin(-1), wg.amax(-1)
        scale = (hi - lo) / top + 1e-8
        zero = torch.round(-lo / scale).clamp(0, top)
    u = torch.round(wg / scale.unsqueeze(-1) + zero.unsqueeze(-1)).clamp(0, top)
    return u.view(n, k).to(torch.int32), zero.to(torch.int32), scale.half().float()


def _pack(values: torch.Tensor, bits: int, dim: int, order=None) -> torch.Tensor:
    """int32 words of 32 / bits values along `dim`, value i at bits * i (or at nibble order.index(i))."""
    per = 32 // bits
    v = values.movedim(dim, -1)
    v = v.reshape(*v.shape[:-1], -1, per).to(torch.int64)
    out = torch.zeros(v.shape[:-1], dtype=torch.int64)
    for i in range(per):
        col = i if order is None else order[i]
        out |= (v[..., col] & ((1 << bits) - 1)) << (bits * i)
    out = torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)
    return out.movedim(-1, dim)


def _gptq(w, bits, group, sym, v1, act_order):
    n, k = w.shape
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(n + k)) if act_order else torch.arange(k)
    g = k if group == -1 else group
    u_sorted, zero, scale = _rtn(w[:, perm], bits, group, sym)  # act order: groups over the permuted columns
    u = torch.empty_like(u_sorted)
    u[:, perm] = u_sorted
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[perm] = (torch.arange(k) // g).to(torch.int32)
    parts = {"qweight": _pack(u.t(), bits, 0), "qzeros": _pack((zero - (1 if v1 else 0)).t(), bits, 1),
             "scales": scale.t().half().contiguous(), "g_idx": g_idx}
    dense = (u.float() - zero.float()[:, g_idx.long()]) * scale[:, g_idx.long()]
    return parts, dense


def _awq(w, bits, group, sym, v1, act_order):
    u, zero, scale = _rtn(w, bits, group, False)
    order = AWQ_ORDER
    parts = {"qweight": _pack(u.t(), bits, 1, order), "qzeros": _pack(zero.t(), bits, 1, order),
             "scales": scale.t().half().contiguous()}
    g = w.shape[1] // zero.shape[1]
    return parts, (u.float() - zero.float().repeat_interleave(g, 1)) * scale.repeat_interleave(g, 1)


def _compressed(w, bits, group, sym, v1, act_order):
    u, zero, scale = _rtn(w, bits, group, sym)
    parts = {"weight_packed": _pack(u, bits, 1), "weight_scale": scale.half(),
             "weight_shape": torch.tensor(list(w.shape))}
    if not sym:
        parts["weight_zero_point"] = _pack(zero, bits, 0)
    g = w.shape[1] // zero.shape[1]
    return parts, (u.float() - zero.float().repeat_interleave(g, 1)) * scale.repeat_interleave(g, 1)


def _fp8(w, bits, group, sym, v1, act_order):
    scale = w.abs().amax(1, keepdim=True) / 448.0
    q = (w / scale).to(torch.float8_e4m3fn)
    return {"weight": q, "weight_scale": scale}, q.float() * scale


def _fp8_block(w, bits, group, sym, v1, act_order):
    from moelight.models.fp8 import dequantize_fp8_blocks, quantize_fp8_blocks

    q, s = quantize_fp8_blocks(w, (32, 32))
    return {"weight": q, "weight_scale_inv": s}, dequantize_fp8_blocks(q, s, (32, 32))


CASES = {  # name: (packer, bits, group, sym, GPTQ v1 zeros, act order, quantization_config)
    "gptq-int4-sym": (_gptq, 4, 32, True, True, False,
                      {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True, "desc_act": False}),
    "gptq-int4-asym-v2": (_gptq, 4, 32, False, False, False,
                          {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": False, "desc_act": False,
                           "checkpoint_format": "gptq_v2"}),
    "gptq-int4-desc-act": (_gptq, 4, 32, True, True, True,
                           {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True, "desc_act": True}),
    "gptq-int8-asym": (_gptq, 8, -1, False, True, False,
                       {"quant_method": "gptq", "bits": 8, "group_size": -1, "sym": False, "desc_act": False}),
    "awq-gemm": (_awq, 4, 32, False, False, False,
                 {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}),
    "ct-w4a16-sym": (_compressed, 4, 32, True, False, False, {"format": "pack-quantized", "weights": {
        "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}}),
    "ct-w4a16-asym": (_compressed, 4, 64, False, False, False, {"format": "pack-quantized", "weights": {
        "num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": 64}}),
    "ct-w8a16": (_compressed, 8, -1, True, False, False, {"format": "pack-quantized", "weights": {
        "num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}}),
    "ct-fp8": (_fp8, 8, -1, True, False, False, {"format": "float-quantized", "weights": {
        "num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"}}),
    "fp8-block": (_fp8_block, 8, 32, True, False, False,  # Qwen3-FP8 style
                  {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [32, 32]}),
}
KEPT = {"gptq-int4-sym": "uint4", "gptq-int4-asym-v2": "uint4", "gptq-int4-desc-act": None, "gptq-int8-asym": "int8",
        "awq-gemm": "uint4", "ct-w4a16-sym": "uint4", "ct-w4a16-asym": "uint4", "ct-w8a16": "int8", "ct-fp8": "fp8",
        "fp8-block": "fp8"}


def _quant_config(raw: dict) -> dict:
    if "format" not in raw:
        return raw
    return {"quant_method": "compressed-tensors", "format": raw["format"], "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": raw["weights"]}}, "ignore": ["lm_head"]}


def _hf_linears(model) -> dict[str, torch.Tensor]:
    """Every linear weight of the model under Mixtral's checkpoint names (experts one by one)."""
    out, f = {}, TINY.intermediate_size
    for n, p in model.named_parameters():
        if n.endswith("mlp.gate_up_proj"):
            base = "model." + n.replace("mlp.gate_up_proj", "block_sparse_moe.experts")
            for e in range(p.shape[0]):
                out[f"{base}.{e}.w1.weight"], out[f"{base}.{e}.w3.weight"] = p[e, :f], p[e, f:]
        elif n.endswith("mlp.down_proj"):
            base = "model." + n.replace("mlp.down_proj", "block_sparse_moe.experts")
            for e in range(p.shape[0]):
                out[f"{base}.{e}.w2.weight"] = p[e]
        elif n.endswith("mlp.gate.weight"):
            out["model." + n.replace("mlp.gate", "block_sparse_moe.gate")] = p
        else:
            out[n if n.startswith("lm_head") else "model." + n] = p
    return {k: v.detach().contiguous() for k, v in out.items()}


def _write(folder, tensors: dict, quant: dict | None) -> None:
    folder.mkdir()
    save_file(tensors, str(folder / "model.safetensors"))
    cfg = TINY.to_hf_dict() | ({"quantization_config": quant} if quant else {})
    (folder / "config.json").write_text(json.dumps(cfg))


def _checkpoints(tmp_path, case: str):
    pack, bits, group, sym, v1, act, quant = CASES[case]
    dense = _hf_linears(build_model(TINY, torch.float32, None, seed=5))
    quantized, plain = {}, {}
    for name, w in dense.items():
        if name.endswith("proj.weight") or ".experts." in name:
            parts, values = pack(w, bits, group, sym, v1, act)
            module = name.removesuffix(".weight")
            quantized |= {f"{module}.{p}": t.contiguous() for p, t in parts.items()}
            plain[name] = values.contiguous()
        else:
            quantized[name] = plain[name] = w
    _write(tmp_path / "quantized", quantized, _quant_config(quant))
    _write(tmp_path / "plain", plain, None)
    return tmp_path / "quantized", tmp_path / "plain"


@pytest.mark.parametrize("case", list(CASES))
def test_float32_loads_exactly_the_dequantized_values(tmp_path, case):
    quantized, plain = _checkpoints(tmp_path, case)
    ours = build_model(load_config(quantized), torch.float32, quantized)
    reference = build_model(load_config(plain), torch.float32, plain)
    for (n, a), b in zip(ours.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=n)
    from moelight import LLM, SamplingParams

    prompts = _prompts(TINY.vocab_size)
    greedy = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    tokens = [[o.outputs[0].token_ids for o in LLM(str(d), dtype="float32", tokenizer="none").generate(
        [{"prompt_token_ids": p} for p in prompts], greedy)] for d in (quantized, plain)]
    assert tokens[0] == tokens[1]


@pytest.mark.parametrize("case", list(CASES))
def test_bfloat16_keeps_experts_quantized(tmp_path, case):
    quantized, plain = _checkpoints(tmp_path, case)
    cfg = with_expert_format(load_config(quantized), torch.bfloat16, "cpu", "none")
    kept = build_model(cfg, torch.bfloat16, quantized)
    if KEPT[case] is None:  # act order: groups not contiguous, dequantised at load
        assert cfg.expert_format is None and not isinstance(kept.layers[0].mlp.gate_up_proj, QuantizedExperts)
    else:
        assert cfg.expert_format.fmt == KEPT[case]
        assert isinstance(kept.layers[0].mlp.gate_up_proj, QuantizedExperts)
    reference = build_model(load_config(plain), torch.bfloat16, plain)
    pack_model(kept)
    pack_model(reference)
    prompts = _prompts(TINY.vocab_size)
    assert _rel(_logits(kept, prompts), _logits(reference, prompts)) < 3e-2


@pytest.mark.parametrize("bits", [4, 8])
def test_compressed_tensors_packer_is_the_library_s(bits):
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    g = torch.Generator().manual_seed(0)
    q = torch.randint(-(1 << (bits - 1)), 1 << (bits - 1), (6, 64), generator=g, dtype=torch.int32)
    offset = 1 << (bits - 1)
    assert torch.equal(helpers.pack_to_int32(q.to(torch.int8), bits), _pack(q + offset, bits, 1))
    assert torch.equal(helpers.pack_to_int32(q.to(torch.int8).t().contiguous(), bits, packed_dim=0),
                       _pack((q + offset).t(), bits, 0))


@pytest.mark.parametrize("quant, match", [
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "3-bit weights"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 48}, "group size 48"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "GEMM layout only"),
    ({"quant_method": "bitsandbytes"}, "'bitsandbytes'-quantised mixtral checkpoint"),
    ({"quant_method": "compressed-tensors", "format": "marlin-24", "config_groups": {}}, "format 'marlin-24'"),
])
def test_unsupported_schemes_are_named_before_loading(quant, match):
    with pytest.raises(ConfigError, match=match):
        config_from_hf_dict(TINY.to_hf_dict() | {"quantization_config": quant}, "config.json")


def test_a_missing_scale_is_named(tmp_path):
    quantized, _ = _checkpoints(tmp_path, "gptq-int4-sym")
    from safetensors import safe_open

    with safe_open(str(quantized / "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys() if k != "model.layers.1.self_attn.o_proj.scales"}
    save_file(tensors, str(quantized / "model.safetensors"))
    with pytest.raises(WeightsError, match=r"layers\.1\.self_attn\.o_proj is gptq-quantized but has no scales"):
        build_model(load_config(quantized), torch.float32, quantized)


def test_tensors_that_do_not_fit_the_configs_bits_are_named(tmp_path):
    quantized, _ = _checkpoints(tmp_path, "gptq-int4-sym")
    cfg = json.loads((quantized / "config.json").read_text())
    cfg["quantization_config"]["bits"] = 8
    (quantized / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(WeightsError, match=r"'s tensors \(.*qweight.*\) do not fit config.json's 8-bit gptq"):
        build_model(load_config(quantized), torch.float32, quantized)


@pytest.mark.parametrize("case", [c for c in CASES if KEPT[c]])
def test_tensor_parallel_ranks_hold_their_part_of_the_codes_as_shipped(tmp_path, case):
    """Split over 2 GPUs in bf16, each rank loads its part of the checkpoint's experts as shipped (gate/up
    rows, the down projection's columns with their groups), and those codes expand to exactly that
    part of the one-device float32 values."""
    from dataclasses import replace

    from cpu_kernels.expert_pack import dequantize
    from moelight.loading.model_source import resolve_model
    from moelight.parallel.shard_loader import load_shard
    from moelight.parallel.sharding import part_of

    quantized, plain = _checkpoints(tmp_path, case)
    src = resolve_model(str(quantized), "auto", "bfloat16")
    src = replace(src, config=with_expert_format(src.config, torch.bfloat16, "emulated", "none", ranks=2))
    assert src.config.expert_format.fmt == KEPT[case]
    reference = build_model(load_config(plain), torch.float32, plain)
    for r in range(2):
        part = load_shard(src, r, 2, lambda t: t)
        for j, layer in enumerate(part.layers):
            for name in ("gate_up_proj", "down_proj"):
                held = getattr(layer.mlp, name)
                assert isinstance(held, QuantizedExperts)
                whole = getattr(reference.layers[j].mlp, name).detach()
                want = part_of(f"layers.{j}.mlp.{name}", whole, reference.config, r, 2)
                torch.testing.assert_close(dequantize(held.matrix()), want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("method", ["gptq", "compressed-tensors"])
def test_a_last_group_cut_short_dequantizes_by_its_own_group(method):
    """K = 96 with groups of 64: both formats keep ceil(K / group) = 2 groups, the second 32 wide."""
    from moelight.loading.int_checkpoints import dequantized, read_module, scheme_of

    n, k, group = 16, 96, 64
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(3)) * 0.05
    u, zero, scale = _rtn(torch.cat([w, torch.zeros(n, 128 - k)], 1), 4, group, True)
    u, cols = u[:, :k], torch.arange(k) // group
    want = (u.float() - zero.float()[:, cols]) * scale[:, cols]
    if method == "gptq":
        quant = {"quant_method": "gptq", "bits": 4, "group_size": group, "sym": True, "desc_act": False}
        parts = {"qweight": _pack(u.t(), 4, 0), "qzeros": _pack((zero - 1).t(), 4, 1),
                 "scales": scale.t().half().contiguous(), "g_idx": cols.to(torch.int32)}
    else:
        quant = _quant_config({"format": "pack-quantized", "weights": {
            "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": group}})
        parts = {"weight_packed": _pack(u, 4, 1), "weight_scale": scale.half(), "weight_shape": torch.tensor([n, k])}
    got = dequantized(read_module(scheme_of(quant, "config.json"), parts))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
