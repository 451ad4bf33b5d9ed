"""Shared pieces of the tensor-parallel tests: small models of every family with weights that
make a misplaced shard show, and an all-reduce between threads of one process (so the sharding
of each family is checked without spawning processes)."""

from __future__ import annotations

import threading

import torch

from moelight.loading.hf_config import config_from_hf_dict
from moelight.loading.weights import build_model

_MIXTRAL = {"model_type": "mixtral", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 48,
            "num_hidden_layers": 3, "num_local_experts": 4, "num_experts_per_tok": 2, "num_attention_heads": 8,
            "num_key_value_heads": 4, "head_dim": 8, "max_position_embeddings": 256, "rope_theta": 1e4,
            "bos_token_id": 1, "eos_token_id": 2}
_QWEN = {"vocab_size": 300, "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 8,
         "num_key_value_heads": 4, "max_position_embeddings": 256, "rope_theta": 1e4, "bos_token_id": 1,
         "eos_token_id": 2}

_DEEPSEEK = {"vocab_size": 300, "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 8,
             "intermediate_size": 48, "moe_intermediate_size": 16, "kv_lora_rank": 16, "qk_nope_head_dim": 8,
             "qk_rope_head_dim": 8, "v_head_dim": 12, "max_position_embeddings": 256, "rope_theta": 1e4,
             "bos_token_id": 1, "eos_token_id": 2}

# every family, at shapes 2 and 4 divide (heads, KV heads, expert / shared / dense widths)
FAMILY_CONFIGS: dict[str, dict] = {
    "mixtral": _MIXTRAL,
    "qwen2_moe-shared-dense-bias": {**_QWEN, "model_type": "qwen2_moe", "intermediate_size": 80,
                                    "moe_intermediate_size": 24, "shared_expert_intermediate_size": 40,
                                    "num_experts": 6, "num_experts_per_tok": 2, "norm_topk_prob": False,
                                    "mlp_only_layers": [1]},
    "qwen3_moe-head-qk-norm": {**_QWEN, "model_type": "qwen3_moe", "head_dim": 8, "intermediate_size": 64,
                               "moe_intermediate_size": 16, "num_experts": 8, "num_experts_per_tok": 3,
                               "norm_topk_prob": True, "tie_word_embeddings": True},
    "olmoe-full-qk-norm-clip": {**_QWEN, "model_type": "olmoe", "intermediate_size": 32, "num_experts": 8,
                                "num_experts_per_tok": 2, "clip_qkv": 0.6, "rms_norm_eps": 1e-5},
    "dbrx-layernorm-clip": {"model_type": "dbrx", "vocab_size": 300, "d_model": 64, "n_heads": 8,
                            "n_layers": 2, "max_seq_len": 256,
                            "attn_config": {"kv_n_heads": 4, "clip_qkv": 0.5, "rope_theta": 1e4},
                            "ffn_config": {"ffn_hidden_size": 32, "moe_num_experts": 4, "moe_top_k": 2},
                            "eos_token_id": 2},
    "gpt_oss-sinks-window-biases": {"model_type": "gpt_oss", "vocab_size": 300, "hidden_size": 64,
                                    "num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 4,
                                    "head_dim": 8, "intermediate_size": 32, "num_local_experts": 4,
                                    "num_experts_per_tok": 2, "sliding_window": 4, "rope_theta": 1e4,
                                    "max_position_embeddings": 256, "attention_bias": True, "swiglu_limit": 7.0,
                                    "eos_token_id": 2},
    # MLA with heads split and the latent replicated; V3's grouped sigmoid router with its score bias,
    # shared experts, a dense first layer; V2's softmax greedy router without q_lora_rank
    "deepseek_v3-mla-groups-shared-dense": {**_DEEPSEEK, "model_type": "deepseek_v3", "q_lora_rank": 24,
                                            "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 4,
                                            "topk_group": 2, "first_k_dense_replace": 1, "n_shared_experts": 2,
                                            "routed_scaling_factor": 2.5, "num_nextn_predict_layers": 0},
    "deepseek_v2-mla-no-q-lora": {**_DEEPSEEK, "model_type": "deepseek_v2", "q_lora_rank": None,
                                  "n_routed_experts": 6, "num_experts_per_tok": 2, "n_shared_experts": 1,
                                  "topk_method": "greedy"},
}


def family_config(name: str):
    return config_from_hf_dict(FAMILY_CONFIGS[name], where=f"test config {name}")


def random_model(cfg, dtype: torch.dtype = torch.float32, seed: int = 0):
    """Weights at a trained-like spread with every norm, bias and sink randomised (a rank that
    applies one twice, or not at all, changes the logits); seeded, so each rank builds the same."""
    model = build_model(cfg, torch.float32, None, seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("_norm.weight"):
                p.uniform_(0.5, 1.5, generator=gen)
            elif name.endswith("bias") or ".bias." in name or name.endswith(("gate_up", "down")):
                p.uniform_(-0.3, 0.3, generator=gen)
            elif name.endswith("sinks"):
                p.uniform_(-1.0, 1.0, generator=gen)
            else:
                p.uniform_(-0.35, 0.35, generator=gen)
    return model.to(dtype)


class ThreadAllReduce:
    """Sum over N threads, each one 'rank'; every rank adds the parts in rank order, so all ranks
    hold bit-identical sums, as a real all-reduce guarantees."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.parts: list[torch.Tensor | None] = [None] * n
        self.barrier = threading.Barrier(n, timeout=60)

    def for_rank(self, rank: int):
        def all_reduce(t: torch.Tensor) -> torch.Tensor:
            self.parts[rank] = t.clone()
            self.barrier.wait()
            total = self.parts[0].clone()
            for k in range(1, self.n):
                total += self.parts[k]
            self.barrier.wait()
            t.copy_(total)
            return t

        return all_reduce


def run_ranks(n: int, work) -> list:
    """work(rank) on n threads at once -> its results in rank order; the first error is raised."""
    out: list = [None] * n
    errors: list[BaseException] = []

    def one(r: int) -> None:
        try:
            out[r] = work(r)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=one, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out
