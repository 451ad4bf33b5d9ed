"""What a CPU generation holds beside the weights: its KV pool (reserved and resident) and its activations.

A cut-down Qwen3-30B-A3B (the real layer: hidden 2048, 32 query / 4 KV heads, 128 experts of 768, top 8, int4
experts; fewer layers) runs jobs of 8 new tokens at a few batches, with and without a shared prefix. Per job:

- pool_bytes: the KV pool the engine reserved (engine/scheduler.py sizes it; RaggedKVCache.bytes_needed);
- pool_resident: how much of it is resident at the end (/proc/self/smaps Rss of its mappings): first-fit pages
  the job touched, rounded to the 2 MiB huge pages the pool is advised onto;
- prefill / decode: the largest peak of a phase (each prefill, each decode step) over the process before the job,
  less the pool resident at that phase's end (the pool only grows): what it held beside the pool, its activations
  and logits. Each job runs in a fresh process (glibc keeps one job's freed activations for the next).

Usage: python benchmarks/kv_pool_memory.py [--layers 4] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import torch

from moelight.engine import generation
from moelight.engine.generation import Engine
from moelight.loading.expert_storage import with_expert_format
from moelight.loading.hf_config import config_from_hf_dict
from moelight.loading.weights import build_model
from moelight.planning.memory_check import peak_rss_bytes, reset_peak_rss
from moelight.runtime.cpu_linear import pack_model
from moelight.sampling.params import SamplingParams

MIB = 2**20
QWEN3_LAYER = {"model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
               "moe_intermediate_size": 768, "num_hidden_layers": 4, "num_attention_heads": 32,
               "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
               "norm_topk_prob": True, "rope_theta": 1e6, "max_position_embeddings": 4096, "bos_token_id": 1,
               "eos_token_id": 2}


def resident(tensors: list[torch.Tensor]) -> int:
    """Rss of the mappings that hold `tensors` (each pool tensor is its own 2 MiB-aligned mapping)."""
    ptrs = sorted(t.data_ptr() for t in tensors)
    total, vma = 0, None
    seen = set()
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                vma = (lo, hi)
            elif head == "Rss:" and vma is not None and vma not in seen:
                if any(vma[0] <= p < vma[1] for p in ptrs):
                    seen.add(vma)
                    total += int(line.split()[1]) * 1024
    return total


def prompts_for(kind: str, batch: int, requests: int, vocab: int, gen: torch.Generator) -> list[list[int]]:
    """'distinct': random 85-token prompts; 'prefix': a 64-token prefix every prompt shares, 21 tokens of its
    own; 'repeated': 16 distinct 85-token prompts cycled (the README dataset replicated)."""
    def rand(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=gen).tolist()

    if kind == "distinct":
        return [rand(85) for _ in range(requests)]
    if kind == "prefix":
        shared = rand(64)
        return [shared + rand(21) for _ in range(requests)]
    base = [rand(85) for _ in range(16)]
    return [base[i % 16] for i in range(requests)]


def run_job(model, cfg, kind: str, batch: int, requests: int, sharing: bool, greedy: bool = False) -> dict:
    gen = torch.Generator().manual_seed(batch)
    prompts = prompts_for(kind, batch, requests, cfg.vocab_size, gen)
    sampling = {"temperature": 0.0} if greedy else {"temperature": 1.0, "top_p": 0.9}
    params = [SamplingParams(max_tokens=8, ignore_eos=True, **sampling)] * requests
    pools: list = []
    phases = {"prefill": 0, "decode": 0}
    start = {}
    orig_pool = generation.kv_cache_class(cfg).pool
    orig_prefill, orig_decode = generation._Run._prefill, generation._Run._decode_step

    def pool(*a, **k):
        c = orig_pool(*a, **k)
        pools.append(c)
        return c

    def held(name: str) -> None:
        """The phase's peak (VmHWM reset at its start) less the pool resident at its end and the process before
        the job: what the phase held beside the pool."""
        cache = pools[-1]
        phases[name] = max(phases[name], peak_rss_bytes() - start["rss"] - resident([*cache.k, *cache.v]))

    def prefill(self, new):
        reset_peak_rss()
        orig_prefill(self, new)
        held("prefill")

    def decode(self, batches):
        reset_peak_rss()
        orig_decode(self, batches)
        held("decode")

    cls = generation.kv_cache_class(cfg)
    cls.pool, generation._Run._prefill, generation._Run._decode_step = pool, prefill, decode
    try:
        engine = Engine(model, (cfg.eos_token_ids[0],), max_prefill_tokens=4096, prefix_sharing=sharing)
        start["rss"] = reset_peak_rss()
        engine.generate(prompts, params, list(range(requests)), batch, batch)
        peak = max(phases.values())  # beside the pool
    finally:
        cls.pool, generation._Run._prefill, generation._Run._decode_step = orig_pool, orig_prefill, orig_decode
    cache = pools[-1]
    slots = cache.k[0].shape[1]
    return {"kind": kind, "sharing": sharing, "greedy": greedy, "batch": batch, "requests": requests,
            "pool_slots": slots,
            "pool_bytes": cache.bytes_needed(cfg, slots, cache.k[0].dtype),
            "pool_resident": resident([*cache.k, *cache.v]), "beside_pool": peak,
            "prefill_beside_pool": phases["prefill"], "decode_beside_pool": phases["decode"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batches", default="32,64,128")
    ap.add_argument("--kinds", default="distinct0,distinct1,prefix1,repeated1",
                    help="KIND + 0/1 (prefix sharing off/on): distinct0 runs `batch` requests, the others 4x")
    ap.add_argument("--json")
    ap.add_argument("--one", help="KIND,BATCH,REQUESTS,SHARING,GREEDY: one job, in this process (JSON on stdout)")
    ap.add_argument("--greedy", action="store_true", help="greedy sampling (argmax: no sampler copies)")
    args = ap.parse_args()
    if args.one:
        kind, batch, requests, sharing, greedy = args.one.split(",")
        cfg = config_from_hf_dict(QWEN3_LAYER | {"num_hidden_layers": args.layers})
        cfg = with_expert_format(cfg, torch.bfloat16, "cpu", "int4")
        model = build_model(cfg, torch.bfloat16, None, seed=0)
        pack_model(model, "int4", 128, huge_pages=False, plain_weights=False)
        print(json.dumps(run_job(model, cfg, kind, int(batch), int(requests), sharing == "1", greedy == "1")))
        return
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        for kind, sharing in ((k[:-1], int(k[-1])) for k in args.kinds.split(",")):
            requests = 4 * batch if sharing else batch
            # a fresh process a job: one job's freed activations, kept by glibc, would hide the next one's
            one = f"{kind},{batch},{requests},{sharing},{int(args.greedy)}"
            out = subprocess.run([sys.executable, __file__, "--layers", str(args.layers), "--one", one],
                                 capture_output=True, text=True, check=True)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append(r)
            counts = ("batch", "requests", "pool_slots", "sharing", "greedy")
            print(json.dumps({k: round(v / MIB, 1) if isinstance(v, int) and k not in counts else v
                              for k, v in r.items()}), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"layers": args.layers, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
