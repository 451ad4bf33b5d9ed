"""CPU kernels for moelight: attention, fused routed experts, row-wise top-k.

Public API (the engine calls only these functions):

- ``decode_attention(q, k_cache, v_cache, offsets, lengths, scale)``: one query token per
  sequence over a ragged KV cache.
- ``prefill_attention(q, k, v, cu_seqlens, scale)``: causal attention over packed prompts.
- ``expert_mix(x, ids, weights, packed, act)``: all routed experts of a layer in one call over weights
  packed by ``pack_experts`` (bf16, int8, fp8, 4-bit int or MXFP4; C++, or the torch reference
  ``expert_pack.pack_experts``).
- ``topk_rows(x, k)``: top-k (k = 1: argmax) of every row, for the sampler.
- ``paged_decode_attention`` / ``paged_prefill_attention``: the same over a paged cache, each
  sequence's positions in the pages its block-table row names (prefix sharing; paged_reference.py).
- ``latent_decode_attention(q, cache, offsets, lengths, scale, latent_dim)``: MLA's absorbed decode,
  every head over one latent row per token (latent.py); ``paged_latent_decode_attention`` over a
  paged cache.

KV cache layout (one tensor each for K and V, per layer): ``[H_kv, T_total, d]``.
Sequence ``b`` owns the token slots ``offsets[b] : offsets[b] + capacity_b`` of every head;
its first ``lengths[b]`` slots are valid. Each (sequence, KV head) is therefore one
contiguous ``[length, d]`` block, which is what a bandwidth-bound kernel wants.

The C++ kernels (csrc/, registered as torch.ops.moelight.*) are built by the install step
(setup.py) and loaded on first use; where that build is missing or stale they compile then
(see build.py); if that fails the pure-torch reference runs, with one warning.
``kernel_backend()`` names the path in use: 'cpp-amx', 'cpp-avx512bf16', 'cpp-avx512', 'cpp-avx2' or
'torch' (MOELIGHT_CPU_KERNELS=torch forces the fallback). The ops use
torch.get_num_threads() OpenMP threads and release the GIL while they run.
"""

from cpu_kernels.dispatch import (
    decode_attention,
    expert_mix,
    kernel_backend,
    pack_experts,
    paged_decode_attention,
    paged_prefill_attention,
    prefill_attention,
    topk_rows,
)
from cpu_kernels.latent import latent_decode_attention, paged_latent_decode_attention

__all__ = ["decode_attention", "prefill_attention", "paged_decode_attention", "paged_prefill_attention",
           "latent_decode_attention", "paged_latent_decode_attention", "expert_mix", "topk_rows", "kernel_backend",
           "pack_experts"]
