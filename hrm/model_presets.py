"""Model presets shared by the whole project (same names as the engine's presets)."""

from __future__ import annotations

from pathlib import Path

from hrm.model import ModelSpec, load_model_dir, model_from_hf_config


def _mixtral(vocab, hidden, f, layers, experts, top_k, heads, kv, head_dim, max_pos, theta=1e6) -> dict:
    return {"model_type": "mixtral", "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": f,
            "num_hidden_layers": layers, "num_local_experts": experts, "num_experts_per_tok": top_k,
            "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": head_dim,
            "max_position_embeddings": max_pos, "rope_theta": theta, "bos_token_id": 1, "eos_token_id": 2}


# Each preset is the config.json of its model (at the real shape, from the published checkpoints),
# so the engine (moelight/loading/presets.py, through its family adapters) and the HRM read the same numbers.
_MXFP4 = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}

PRESET_CONFIGS: dict[str, dict] = {
    "tiny": _mixtral(512, 64, 128, 2, 4, 2, 4, 2, 16, 2048),
    "bench-1b": _mixtral(32000, 1024, 3584, 8, 8, 2, 16, 4, 64, 4096),
    "mixtral-8x7b": _mixtral(32000, 4096, 14336, 32, 8, 2, 32, 8, 128, 32768),
    "mixtral-8x22b": _mixtral(32768, 6144, 16384, 56, 8, 2, 48, 8, 128, 65536),
    "dbrx": {"model_type": "dbrx", "vocab_size": 100352, "d_model": 6144, "n_layers": 40, "n_heads": 48,
             "max_seq_len": 32768, "attn_config": {"kv_n_heads": 8, "clip_qkv": 8, "rope_theta": 500000},
             "ffn_config": {"ffn_hidden_size": 10752, "moe_num_experts": 16, "moe_top_k": 4},
             "eos_token_id": 100257},
    "qwen3-30b-a3b": {"model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048,
                      "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
                      "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
                      "num_experts_per_tok": 8, "norm_topk_prob": True, "rope_theta": 1e6, "rms_norm_eps": 1e-6,
                      "max_position_embeddings": 40960, "bos_token_id": 151643, "eos_token_id": 151645},
    "qwen2-57b-a14b": {"model_type": "qwen2_moe", "vocab_size": 151936, "hidden_size": 3584,
                       "intermediate_size": 18944, "moe_intermediate_size": 2560,
                       "shared_expert_intermediate_size": 20480, "num_hidden_layers": 28,
                       "num_attention_heads": 28, "num_key_value_heads": 4, "num_experts": 64,
                       "num_experts_per_tok": 8, "norm_topk_prob": False, "rope_theta": 1e6, "rms_norm_eps": 1e-6,
                       "max_position_embeddings": 32768, "bos_token_id": 151643, "eos_token_id": 151643},
    "olmoe-1b-7b": {"model_type": "olmoe", "vocab_size": 50304, "hidden_size": 2048, "intermediate_size": 1024,
                    "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 16,
                    "num_experts": 64, "num_experts_per_tok": 8, "norm_topk_prob": False, "rope_theta": 10000.0,
                    "rms_norm_eps": 1e-5, "max_position_embeddings": 4096, "eos_token_id": 50279,
                    "pad_token_id": 1},
    # the GPT-OSS checkpoints ship their experts in MXFP4, so their presets do too (dummy codes, kept packed)
    "gpt-oss-20b": {**(_GPT_OSS := {
        "model_type": "gpt_oss", "vocab_size": 201088, "hidden_size": 2880, "intermediate_size": 2880,
        "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "num_experts_per_tok": 4,
        "sliding_window": 128, "rope_theta": 150000.0, "max_position_embeddings": 131072, "attention_bias": True,
        "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                         "original_max_position_embeddings": 4096, "truncate": False},
        "swiglu_limit": 7.0, "eos_token_id": 200002, "pad_token_id": 199999}),
        "num_hidden_layers": 24, "num_local_experts": 32, "quantization_config": _MXFP4},
    "gpt-oss-120b": {**_GPT_OSS, "num_hidden_layers": 36, "num_local_experts": 128, "quantization_config": _MXFP4},
    # bench-1b's size (8 layers, hidden 1024, ~88 M expert weights a layer) in the other families'
    # expert shapes, for the CPU benchmark: Qwen3-MoE's many small experts, GPT-OSS's few wide ones
    "bench-qwen3-moe": {"model_type": "qwen3_moe", "vocab_size": 32000, "hidden_size": 1024,
                        "intermediate_size": 3584, "moe_intermediate_size": 224, "num_hidden_layers": 8,
                        "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 64, "num_experts": 128,
                        "num_experts_per_tok": 8, "norm_topk_prob": True, "rope_theta": 1e6,
                        "max_position_embeddings": 4096, "bos_token_id": 1, "eos_token_id": 2},
    "bench-gpt-oss": {**_GPT_OSS, "vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 896,
                      "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 4,
                      "num_local_experts": 32, "max_position_embeddings": 4096, "bos_token_id": 1,
                      "eos_token_id": 2, "pad_token_id": 0},
    # DeepSeek (MLA, grouped routing, shared experts, dense first layers), from the published config.json
    # files less their FP8 quantization_config and MTP layer (a preset has no weights to dequantise)
    "deepseek-v2-lite": {"model_type": "deepseek_v2", "vocab_size": 102400, "hidden_size": 2048,
                         "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 27,
                         "num_attention_heads": 16, "num_key_value_heads": 16, "n_routed_experts": 64,
                         "n_shared_experts": 2, "num_experts_per_tok": 6, "first_k_dense_replace": 1,
                         "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                         "v_head_dim": 128, "topk_method": "greedy", "scoring_func": "softmax", "n_group": 1,
                         "topk_group": 1, "routed_scaling_factor": 1.0, "norm_topk_prob": False,
                         "rope_theta": 10000, "max_position_embeddings": 163840, "rms_norm_eps": 1e-6,
                         "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                                          "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
                         "bos_token_id": 100000, "eos_token_id": 100001},
    "deepseek-v3": {**(_DEEPSEEK_V3 := {
        "model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
        "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
        "num_key_value_heads": 128, "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
        "first_k_dense_replace": 3, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
        "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5, "norm_topk_prob": True, "rope_theta": 10000,
        "max_position_embeddings": 163840, "rms_norm_eps": 1e-6,
        "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                         "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
        "bos_token_id": 0, "eos_token_id": 1})},
    # Kimi-K2: V3's architecture with other counts (64 heads, 384 experts in one group, one dense layer)
    "kimi-k2": {**_DEEPSEEK_V3, "model_type": "kimi_k2", "vocab_size": 163840, "num_attention_heads": 64,
                "num_key_value_heads": 64, "n_routed_experts": 384, "first_k_dense_replace": 1, "n_group": 1,
                "topk_group": 1, "routed_scaling_factor": 2.827, "rope_theta": 50000.0,
                "max_position_embeddings": 131072,
                "rope_scaling": {"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                                 "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
                "bos_token_id": 163584, "eos_token_id": 163585},
    # bench-1b's size (8 layers, hidden 1024, ~88 M expert weights a layer) in DeepSeek-V2-Lite's shape:
    # its attention (16 heads, latent 512 + RoPE 64, no q_lora), 64 experts top-6, two shared, one dense layer
    "bench-deepseek": {"model_type": "deepseek_v2", "vocab_size": 32000, "hidden_size": 1024,
                       "intermediate_size": 3584, "moe_intermediate_size": 448, "num_hidden_layers": 8,
                       "num_attention_heads": 16, "n_routed_experts": 64, "n_shared_experts": 2,
                       "num_experts_per_tok": 6, "first_k_dense_replace": 1, "kv_lora_rank": 512,
                       "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
                       "topk_method": "greedy", "scoring_func": "softmax", "routed_scaling_factor": 1.0,
                       "norm_topk_prob": False, "rope_theta": 10000, "max_position_embeddings": 4096,
                       "bos_token_id": 1, "eos_token_id": 2},
}

MODEL_PRESETS: dict[str, ModelSpec] = {name: model_from_hf_config(cfg, name=name)
                                       for name, cfg in PRESET_CONFIGS.items()}


def list_models() -> list[str]:
    return sorted(MODEL_PRESETS)


def get_model(name_or_dir: str | Path) -> ModelSpec:
    """A preset by name, else a directory holding config.json (or the config file itself)."""
    key = str(name_or_dir)
    if key.lower() in MODEL_PRESETS:
        return MODEL_PRESETS[key.lower()]
    p = Path(key).expanduser()
    if p.exists():
        return load_model_dir(p)
    raise KeyError(f"unknown model {key!r}; valid presets: {', '.join(list_models())}, or a directory "
                   "with config.json")
