"""DBRX (132B, 16 experts top-4): LayerNorm without bias, a fused Wqkv projection whose output is
clamped to +-clip_qkv, router weights renormalised (p-norm, p = 1 by default).

The checkpoint's fused Wqkv is split into q/k/v at load (clamping the parts is clamping the
whole), and its experts, stored stacked as w1 / v1 / w2 [E*f, h], go into the packed form.
"""

from __future__ import annotations

import re

import torch

from moelight.errors import ConfigError
from moelight.models.config import ModelConfig, eos_ids_of, require, rope_scaling_of
from moelight.models.layers import Attention, DecoderLayerBase, LayerNorm, SparseMoE, apply_rotary
from moelight.models.targets import Target


class DecoderLayer(DecoderLayerBase):
    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        self.clip = cfg.clip_qkv
        self.input_layernorm = LayerNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = LayerNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SparseMoE(cfg)

    def pre_attention(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        a = self.self_attn
        q, k, v = a.qkv(self.input_layernorm(x))
        if self.clip is not None:
            q, k, v = (t.clamp(-self.clip, self.clip) for t in (q, k, v))
        q, k, v = a.heads(q, k, v)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v


_RENAME = {
    "transformer.wte.weight": "embed_tokens.weight",
    "transformer.norm_f.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
}
_BLOCK = re.compile(r"^transformer\.blocks\.(\d+)\.(.+)$")
_IN_BLOCK = {
    "norm_attn_norm.norm_1.weight": "input_layernorm.weight",
    "norm_attn_norm.norm_2.weight": "post_attention_layernorm.weight",
    "norm_attn_norm.attn.out_proj.weight": "self_attn.o_proj.weight",
    "ffn.router.layer.weight": "mlp.gate.weight",
}


def tensor_targets(name: str, cfg: ModelConfig) -> list[Target] | None:
    if name in _RENAME:
        return [Target(_RENAME[name])]
    m = _BLOCK.match(name)
    if not m:
        return None
    i, rest = int(m.group(1)), m.group(2)
    pre = f"layers.{i}."
    if rest in _IN_BLOCK:
        return [Target(pre + _IN_BLOCK[rest])]
    e, f, h = cfg.num_experts, cfg.intermediate_size, cfg.hidden_size
    if rest == "norm_attn_norm.attn.Wqkv.weight":
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        cuts = ((0, q), (q, q + kv), (q + kv, q + 2 * kv))
        return [Target(pre + f"self_attn.{p}_proj.weight", (), lambda t, a=a, b=b: t[a:b])
                for p, (a, b) in zip("qkv", cuts, strict=True)]
    if rest == "ffn.experts.mlp.w1":  # gate, [E*f, h]
        return [Target(pre + "mlp.gate_up_proj", (slice(None), slice(0, f)), lambda t: t.reshape(e, f, h))]
    if rest == "ffn.experts.mlp.v1":  # up, [E*f, h]
        return [Target(pre + "mlp.gate_up_proj", (slice(None), slice(f, 2 * f)), lambda t: t.reshape(e, f, h))]
    if rest == "ffn.experts.mlp.w2":  # down, stored [E*f, h] and used as x @ w2[e]: [E, h, f] is its transpose
        return [Target(pre + "mlp.down_proj", (), lambda t: t.reshape(e, f, h).transpose(1, 2))]
    # any other tensor of a block has no place in the model: the loader names it (rotary buffers aside)
    return None if rest.endswith("inv_freq") else [Target(pre + rest)]


def config_from_hf(cfg: dict, where: str) -> ModelConfig:
    require(cfg, where, "vocab_size", "d_model", "n_layers", "n_heads", "ffn_config")
    attn, ffn = cfg.get("attn_config") or {}, cfg["ffn_config"]
    for key in ("ffn_hidden_size", "moe_num_experts", "moe_top_k"):
        if key not in ffn:
            raise ConfigError(f"{where}: ffn_config lacks {key}")
    act = (ffn.get("ffn_act_fn") or {}).get("name", "silu")
    if act != "silu":
        raise ConfigError(f"{where}: ffn_config.ffn_act_fn {act!r} is not supported (DBRX experts use 'silu')")
    p = ffn.get("moe_normalize_expert_weights", 1)
    if p not in (1, 1.0, None):
        raise ConfigError(f"{where}: moe_normalize_expert_weights={p} is not supported (1 or null)")
    h, heads = int(cfg["d_model"]), int(cfg["n_heads"])
    clip = attn.get("clip_qkv")
    return ModelConfig(
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=h,
        intermediate_size=int(ffn["ffn_hidden_size"]),
        num_layers=int(cfg["n_layers"]),
        num_heads=heads,
        num_kv_heads=int(attn.get("kv_n_heads") or heads),
        num_experts=int(ffn["moe_num_experts"]),
        top_k=int(ffn["moe_top_k"]),
        head_dim=h // heads,
        rms_norm_eps=1e-5,  # torch's LayerNorm default, which DBRX uses
        # transformers 5 writes (and reads) a top-level rope_parameters; original configs keep it in attn_config
        rope_theta=float((cfg.get("rope_parameters") or {}).get("rope_theta") or attn.get("rope_theta", 10000.0)),
        rope_scaling=rope_scaling_of(cfg, where),
        max_position_embeddings=int(cfg.get("max_seq_len", 2048)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids_of(cfg, None),
        model_type="dbrx",
        norm="layernorm",
        clip_qkv=None if clip is None else float(clip),
        norm_topk_prob=p is not None,
    )
