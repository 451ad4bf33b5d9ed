"""DeepSeek-V2 / V2-Lite, DeepSeek-V3 / R1 and the models built like them (Kimi-K2, Moonlight):
multi-head latent attention (moelight/models/latent_attention.py), a grouped router (softmax with
group-limited top-k in V2, sigmoid with a selection-only bias in V3: grouped_routing.py), shared
experts beside the routed ones, the first `first_k_dense_replace` layers dense, YaRN with DeepSeek's
`mscale`, and V3's FP8 e4m3 weights with 128x128 block scales, dequantised at load (fp8.py).

The decoder layer is the common one; attention differs only in what the KV cache keeps (one row of
latent and RoPE key per token) and in its two forms: prefill expanded, decode absorbed.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from moelight.errors import ConfigError
from moelight.models.config import ModelConfig, check_act, eos_ids_of, require, rope_scaling_of, rope_theta_of
from moelight.models.fp8 import dequantize_fp8_blocks, fp8_piece
from moelight.models.grouped_routing import METHODS, GroupRouter, GroupRouting
from moelight.models.latent_attention import MultiHeadLatentAttention
from moelight.models.layers import DecoderLayerBase, RMSNorm, SwiGLU
from moelight.models.mla_config import LatentAttention
from moelight.models.moe import expert_mix, swiglu
from moelight.models.rope import yarn_mscale
from moelight.models.targets import Target, hf_style_targets, strip_model_prefix


class DeepseekMoE(nn.Module):
    """Routed experts (packed [E, 2f, h] / [E, h, f]) chosen by the grouped router, plus the shared
    experts (one SwiGLU of n_shared_experts x the expert width) that every token runs."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        e, h, f = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
        self.gate = GroupRouter(h, e, cfg.top_k, cfg.group_routing, cfg.norm_topk_prob)
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * f, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, f))
        self.linear = F.linear  # cpu_linear.pack_model swaps in pre-packed weights and their matmul
        self.shared_expert = SwiGLU(h, cfg.shared_expert_size) if cfg.shared_expert_size else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_with(x, self.gate_up_proj, self.down_proj, self.linear)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.gate(x)

    def expert_terms(self):
        return swiglu, None, None

    def forward_with(self, x: torch.Tensor, gate_up_proj, down_proj, linear, routing=None,
                     compute_order=None, counts=None, ready=None) -> torch.Tensor:
        """As SparseMoE.forward_with: the runtime may supply the expert weights, routing, order and counts."""
        weights, experts = self.route(x) if routing is None else routing
        out = expert_mix(x, weights, experts, gate_up_proj, down_proj, linear, compute_order=compute_order,
                         counts=counts, ready=ready)
        return out if self.shared_expert is None else out + self.shared_expert(x)


class DecoderLayer(DecoderLayerBase):
    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MultiHeadLatentAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DeepseekMoE(cfg) if cfg.is_sparse(index) else SwiGLU(cfg.hidden_size, cfg.dense_intermediate_size)

    def attention_inputs(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, decode: bool = False):
        """(q, (cache row,)): prefill's per-head query [T, H, nope + rope], or decode's absorbed one
        [T, H, rank + rope] over the cached rows."""
        q_nope, q_pe, row = self.self_attn.project(self.input_layernorm(x), cos, sin)
        q = self.self_attn.absorb(q_nope, q_pe) if decode else torch.cat((q_nope, q_pe), -1)
        return q, (row,)

    def prefill_kv(self, row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.self_attn.expand(row)

    def decode_output(self, attn: torch.Tensor) -> torch.Tensor:
        return self.self_attn.unabsorb(attn)


# the Linear weights an FP8 checkpoint stores in e4m3 (the router, norms, embeddings and LM head stay 16-bit)
_FP8_WEIGHT = re.compile(r"(self_attn\.(q_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)"
                         r"|mlp\.(experts\.\d+\.|shared_expert\.)?(gate_proj|up_proj|down_proj))\.weight$")
_LAYER = re.compile(r"^layers\.(\d+)\.")


def tensor_targets(raw: str, cfg: ModelConfig) -> list[Target] | None:
    """HF names (per-expert or packed experts; `shared_experts` is our `shared_expert`); FP8 weights
    dequantised with their `weight_scale_inv`; the MTP layer after the last one skipped."""
    name = strip_model_prefix(raw).replace(".mlp.shared_experts.", ".mlp.shared_expert.")
    if name.endswith("_scale_inv"):
        return None  # read with its weight
    layer = _LAYER.match(name)
    if layer and cfg.num_layers <= int(layer.group(1)) < cfg.num_layers + cfg.ignored_layers:
        return None
    targets = hf_style_targets(name, cfg)
    if not (cfg.fp8_block and _FP8_WEIGHT.search(name)) or cfg.listed_float(raw.removesuffix(".weight")):
        return targets  # 16-bit, or kept in float by modules_to_not_convert
    block = cfg.fp8_block
    keep = cfg.expert_format is not None and ".experts." in name  # routed experts held in e4m3
    read = fp8_piece if keep else dequantize_fp8_blocks
    return [replace(t, transform=lambda w, s: read(w, s, block), companion=raw + "_scale_inv") for t in targets]


# transformers' defaults for fields a config.json may leave out, per model type
_DEFAULTS = {
    "deepseek_v2": dict(scoring_func="softmax", topk_method="greedy", n_group=None, topk_group=None,
                        routed_scaling_factor=1.0, norm_topk_prob=False, first_k_dense_replace=0,
                        n_shared_experts=2, q_lora_rank=1536, bos=1, eos=2),
    "deepseek_v3": dict(scoring_func="sigmoid", topk_method="noaux_tc", n_group=8, topk_group=4,
                        routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=3,
                        n_shared_experts=1, q_lora_rank=1536, bos=0, eos=1),
}


def config_from_hf(cfg: dict, where: str) -> ModelConfig:
    mtype = cfg.get("model_type")
    d = _DEFAULTS["deepseek_v2" if mtype == "deepseek_v2" else "deepseek_v3"]
    get = lambda key: cfg.get(key, d[key])  # noqa: E731 - the config's value, else transformers' default
    require(cfg, where, "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
            "num_hidden_layers", "num_attention_heads", "num_experts_per_tok", "kv_lora_rank",
            "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    check_act(cfg, where)
    experts = cfg.get("n_routed_experts", cfg.get("num_local_experts", cfg.get("num_experts")))
    if experts is None:
        raise ConfigError(f"{where}: missing required field(s) n_routed_experts")
    routing = _routing(cfg, where, mtype, int(experts), get)
    if mtype == "deepseek_v2" and get("norm_topk_prob"):
        raise ConfigError(f"{where}: norm_topk_prob is true for a deepseek_v2 model: DeepSeek's code then drops "
                          "routed_scaling_factor and transformers ignores the flag, so its output is undefined; "
                          "no released V2 checkpoint sets it (set it to false)")
    mtp = int(cfg.get("num_nextn_predict_layers") or 0)
    if mtp:
        warnings.warn(f"{where}: num_nextn_predict_layers={mtp}: the multi-token-prediction head is ignored; "
                      f"moelight loads and runs the main model's {cfg['num_hidden_layers']} layers", stacklevel=2)
    n_layers, f = int(cfg["num_hidden_layers"]), int(cfg["moe_intermediate_size"])
    dense = int(get("first_k_dense_replace") or 0)
    heads = int(cfg["num_attention_heads"])
    yarn = rope_scaling_of(cfg, where, allow=("yarn",))  # the rotary frequencies and MLA's softmax scale
    return ModelConfig(
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=f,
        num_layers=n_layers,
        num_heads=heads,
        num_kv_heads=heads,  # MLA has no KV heads: every head reads the one latent
        num_experts=int(experts),
        top_k=int(cfg["num_experts_per_tok"]),
        head_dim=int(cfg["qk_rope_head_dim"]),  # the rotary dim, as transformers sets head_dim
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta_of(cfg, 10000.0),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        bos_token_id=cfg.get("bos_token_id", d["bos"]),
        eos_token_ids=eos_ids_of(cfg, d["eos"]),
        model_type=mtype,
        qkv_bias=bool(cfg.get("attention_bias", False)),
        o_bias=bool(cfg.get("attention_bias", False)),
        norm_topk_prob=bool(get("norm_topk_prob")),
        shared_expert_size=int(get("n_shared_experts") or 0) * f,
        dense_layers=tuple(range(min(dense, n_layers))),
        dense_intermediate_size=int(cfg["intermediate_size"]) if dense else 0,
        rope_scaling=yarn,
        mla=_latent(cfg, where, mtype, get, dict(yarn)),
        group_routing=routing,
        fp8_block=_fp8_block(cfg, where),
        ignored_layers=mtp,
    )


def _routing(cfg: dict, where: str, mtype: str, experts: int, get) -> GroupRouting:
    """The router's scoring and top-k method, checked against what the model type implements."""
    scoring, method = get("scoring_func"), get("topk_method")
    allowed = METHODS["softmax" if mtype == "deepseek_v2" else "sigmoid"]
    if (scoring, method) not in {(s, m) for s in METHODS for m in METHODS[s]} or method not in allowed:
        scoring_ok = "softmax" if mtype == "deepseek_v2" else "sigmoid"
        raise ConfigError(f"{where}: scoring_func {scoring!r} with topk_method {method!r} is not supported for "
                          f"{mtype}; it routes with scoring_func {scoring_ok!r} and topk_method "
                          f"{' or '.join(map(repr, allowed))}")
    n_group, topk_group = int(get("n_group") or 1), int(get("topk_group") or 1)
    if method != "greedy" and (experts % n_group or not 1 <= topk_group <= n_group):
        raise ConfigError(f"{where}: n_group {n_group} must divide n_routed_experts ({experts}) and topk_group "
                          f"({topk_group}) must be in 1..n_group")
    if method == "noaux_tc" and experts // n_group < 2:
        raise ConfigError(f"{where}: noaux_tc scores a group by its two best experts; n_group {n_group} leaves "
                          f"{experts // n_group} expert per group")
    return GroupRouting(scoring, method, n_group, topk_group, float(get("routed_scaling_factor")))


def _latent(cfg: dict, where: str, mtype: str, get, yarn: dict) -> LatentAttention:
    nope, rope_dim = int(cfg["qk_nope_head_dim"]), int(cfg["qk_rope_head_dim"])
    if rope_dim % 2:
        raise ConfigError(f"{where}: qk_rope_head_dim {rope_dim} must be even (RoPE rotates pairs)")
    scale = (nope + rope_dim) ** -0.5
    if yarn.get("mscale_all_dim"):  # DeepSeek's YaRN sharpens the softmax by mscale^2 (transformers' yarn_apply_mscale)
        scale *= yarn_mscale(float(yarn["factor"]), float(yarn["mscale_all_dim"])) ** 2
    return LatentAttention(
        kv_lora_rank=int(cfg["kv_lora_rank"]),
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope_dim,
        v_head_dim=int(cfg["v_head_dim"]),
        q_lora_rank=int(get("q_lora_rank") or 0),
        rope_interleave=mtype == "deepseek_v2" or bool(cfg.get("rope_interleave", True)),
        softmax_scale=scale,
    )


def _fp8_block(cfg: dict, where: str) -> tuple[int, ...]:
    """The FP8 checkpoint's weight block ([128, 128] in V3), () for a 16-bit checkpoint."""
    quant = cfg.get("quantization_config") or {}
    if quant.get("quant_method") != "fp8":
        return ()
    block = quant.get("weight_block_size")
    if quant.get("fmt", "e4m3") != "e4m3" or not (isinstance(block, list) and len(block) == 2
                                                  and all(isinstance(b, int) and b > 0 for b in block)):
        raise ConfigError(f"{where}: an FP8 checkpoint with fmt {quant.get('fmt')!r} and weight_block_size "
                          f"{block!r}; moelight dequantises e4m3 weights with [rows, columns] block scales, two "
                          "positive whole numbers")
    return tuple(int(b) for b in block)
