"""GPT-OSS (20B, 120B): attention with biases and a learned sink logit per head, sliding-window
(128) and full layers alternating, YaRN rotary, a router with bias whose top-k logits are
softmaxed, experts with biases and a clamped SwiGLU ((up + 1) * gate * sigmoid(1.702 gate)).

Checkpoints ship the experts in MXFP4 (`*_blocks` / `*_scales`), dequantised at load into the
run's dtype (moelight/models/mxfp4.py), or in bf16 with gate and up interleaved column by column
([E, h, 2f]); both go into the packed [E, 2f, h] (gate rows, then up rows) / [E, h, f] form.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from moelight.models.config import ModelConfig, check_act, eos_ids_of, require, rope_scaling_of, rope_theta_of
from moelight.models.layers import Attention, DecoderLayerBase, RMSNorm
from moelight.models.moe import expert_mix
from moelight.models.mxfp4 import dequantize_mxfp4, mxfp4_piece
from moelight.models.targets import Target, hf_style_targets, strip_model_prefix


class RMSNormF32Scale(RMSNorm):
    """GPT-OSS scales by the weight in float32 before rounding (its norms are kept in float32)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * xf).to(x.dtype)


class ExpertBiases(nn.Module):
    """The experts' biases, a module of their own so a runtime moves them with the router
    (they stay resident while the expert weights are paged)."""

    def __init__(self, e: int, h: int, f: int) -> None:
        super().__init__()
        self.gate_up = nn.Parameter(torch.empty(e, 2 * f))
        self.down = nn.Parameter(torch.empty(e, h))


class GptOssMoE(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        e, h, f = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
        self.top_k, self.limit, self.alpha = cfg.top_k, cfg.swiglu_limit, cfg.swiglu_alpha
        self.gate = nn.Linear(h, e, bias=True)  # the router
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * f, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, f))
        self.expert_bias = ExpertBiases(e, h, f)
        self.linear = F.linear  # cpu_linear.pack_model swaps in pre-packed weights and their matmul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_with(x, self.gate_up_proj, self.down_proj, self.linear)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        top, experts = torch.topk(self.gate(x), self.top_k, dim=-1)
        return torch.softmax(top, dim=-1, dtype=top.dtype), experts  # softmax after top-k, no renormalising

    def expert_terms(self):
        return self.clamped_swiglu, self.expert_bias.gate_up, self.expert_bias.down

    def forward_with(self, x: torch.Tensor, gate_up_proj, down_proj, linear, routing=None,
                     compute_order=None, counts=None, ready=None) -> torch.Tensor:
        weights, experts = self.route(x) if routing is None else routing
        return expert_mix(x, weights, experts, gate_up_proj, down_proj, linear, self.clamped_swiglu,
                          self.expert_bias.gate_up, self.expert_bias.down, compute_order=compute_order,
                          counts=counts, ready=ready)

    def clamped_swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


class DecoderLayer(DecoderLayerBase):
    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNormF32Scale(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.self_attn.sinks = nn.Parameter(torch.empty(cfg.num_heads))  # read by forward.attention_extras
        self.post_attention_layernorm = RMSNormF32Scale(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GptOssMoE(cfg)


_EXPERTS = re.compile(r"^(layers\.\d+\.mlp)\.experts\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?$")


def tensor_targets(raw: str, cfg: ModelConfig) -> list[Target] | None:
    name = strip_model_prefix(raw)
    name = name.replace(".mlp.router.", ".mlp.gate.")
    m = _EXPERTS.match(name)
    if not m:
        return hf_style_targets(name, cfg)
    mlp, which, kind = m.group(1), m.group(2), m.group(3) or ""
    f = cfg.intermediate_size
    halves = ((slice(None), slice(0, f)), (slice(None), slice(f, 2 * f)))
    if kind == "_scales":
        return None  # read with its blocks
    if kind == "_blocks":
        scales = raw[: -len("_blocks")] + "_scales"
        # kept packed when the run holds its experts in MXFP4 (loading/expert_storage.py)
        read = mxfp4_piece if cfg.expert_format is not None else dequantize_mxfp4
        if which == "down_proj":  # [E, h, f/32, 16] -> [E, h, f], already (out, in)
            return [Target(f"{mlp}.down_proj", (), read, companion=scales)]
        # [E, 2f, h/32, 16] -> [E, 2f, h] (out, in), gate and up interleaved row by row
        return [Target(f"{mlp}.gate_up_proj", idx, lambda b, s, j=j: read(b, s)[:, j::2], scales)
                for j, idx in enumerate(halves)]
    if which == "down_proj":  # weight [E, f, h] used as x @ w; bias [E, h]
        if kind == "_bias":
            return [Target(f"{mlp}.expert_bias.down")]
        return [Target(f"{mlp}.down_proj", (), lambda t: t.transpose(1, 2))]
    if kind == "_bias":  # [E, 2f], interleaved
        return [Target(f"{mlp}.expert_bias.gate_up", idx, lambda t, j=j: t[:, j::2]) for j, idx in enumerate(halves)]
    # weight [E, h, 2f], interleaved columns, used as x @ w
    return [Target(f"{mlp}.gate_up_proj", idx, lambda t, j=j: t[:, :, j::2].transpose(1, 2))
            for j, idx in enumerate(halves)]


def config_from_hf(cfg: dict, where: str) -> ModelConfig:
    require(cfg, where, "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    check_act(cfg, where)
    experts = cfg.get("num_local_experts", cfg.get("num_experts"))
    top_k = cfg.get("num_experts_per_tok", cfg.get("experts_per_token"))
    if experts is None or top_k is None:
        require(cfg, where, "num_local_experts", "num_experts_per_tok")
    n = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
    return ModelConfig(
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=n,
        num_heads=int(cfg["num_attention_heads"]),
        num_kv_heads=int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"]),
        num_experts=int(experts),
        top_k=int(top_k),
        head_dim=int(cfg.get("head_dim") or 0),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        rope_theta=rope_theta_of(cfg, 150000.0),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 131072)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids_of(cfg, None),
        model_type="gpt_oss",
        qkv_bias=bool(cfg.get("attention_bias", True)),
        o_bias=bool(cfg.get("attention_bias", True)),
        rope_scaling=rope_scaling_of(cfg, where, allow=("yarn",)),
        sliding_window=int(cfg.get("sliding_window") or 0),
        sliding_layers=tuple(i for i, t in enumerate(types) if t == "sliding_attention"),
        attention_sinks=True,
        swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
        swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
    )
