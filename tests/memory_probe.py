"""Run in a fresh interpreter by tests/test_memory_estimate.py: resident-memory rises of a small Qwen3-MoE-shaped
model's packing and of one generation on it, printed as JSON. Each phase's peak is its own: reset_peak_rss() before
the phase. Arguments: batch, prompt length, and optionally `plain` (the packed bf16 linears keep their plain copies,
as a job of a few sequences does)."""

from __future__ import annotations

import json
import sys

import torch

from moelight.engine.generation import Engine
from moelight.loading.hf_config import config_from_hf_dict
from moelight.loading.weights import build_model
from moelight.planning.memory_check import peak_rss_bytes, process_bytes, reset_peak_rss
from moelight.runtime.cpu_linear import pack_model
from moelight.sampling.params import SamplingParams

# attention weights of 8 MiB each (the size glibc keeps in its heap once its mmap threshold has risen), few small
# experts: packing's memory is the attention's and the LM head's
SHAPE = {"model_type": "qwen3_moe", "vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 4096,
         "moe_intermediate_size": 128, "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 16,
         "head_dim": 128, "num_experts": 16, "num_experts_per_tok": 4, "norm_topk_prob": True, "rope_theta": 1e6,
         "max_position_embeddings": 4096, "bos_token_id": 1, "eos_token_id": 2}


def main() -> None:
    batch, prompt_len = int(sys.argv[1]), int(sys.argv[2])
    plain = sys.argv[3:] == ["plain"]
    cfg = config_from_hf_dict(SHAPE)
    model = build_model(cfg, torch.bfloat16, None, seed=0)
    before = reset_peak_rss()
    pack_model(model, huge_pages=False, plain_weights=plain)
    pack = {"peak": peak_rss_bytes() - before, "after": process_bytes() - before}
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, cfg.vocab_size, (prompt_len,), generator=gen).tolist() for _ in range(batch)]
    params = [SamplingParams(max_tokens=2, temperature=1.0, top_p=0.9, ignore_eos=True)] * batch
    engine = Engine(model, (cfg.eos_token_ids[0],), max_prefill_tokens=4096, prefix_sharing=False)
    before = reset_peak_rss()
    engine.generate(prompts, params, list(range(batch)), batch, batch)
    run = {"peak": peak_rss_bytes() - before}
    print(json.dumps({"pack": pack, "run": run}))


if __name__ == "__main__":
    main()
