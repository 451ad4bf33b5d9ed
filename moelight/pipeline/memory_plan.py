"""The device memory a CGOPipe runtime needs (DESIGN.md section 4's GPU constraint), every tensor
counted: the weights it keeps there, the paged-weight slots, and what a pass allocates, kernels'
temporaries included, since the device counts them all (DESIGN.md section 8f).

The activation terms bound what the runtime's code allocates, not what it happens to keep at the
peak: a layer pass is charged everything it allocates per token as if nothing were freed before it
ends (norms in float32, q/k/v and rotary, the router in float32, the grouped experts' sorted rows,
their gate/up, activation and down outputs in each expert group, the float32 scaled outputs and
their per-token sum). Tests hold the measured peak under this plan.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moelight.models.causal_lm import MoECausalLM
from moelight.models.config import ModelConfig
from moelight.models.quantized_experts import held_quantized, routed_expert_param


def _elem(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _norm(n: int, el: int) -> int:
    """An RMS/LayerNorm over n values per token: float32 copies, squares, products; rounding back."""
    return 20 * n + 2 * el * n + 16


def attention_widths(cfg: ModelConfig) -> tuple[int, int]:
    """Elements per token of the widest query and of K + V over two (MLA: the larger of decode's
    absorbed query and prefill's; prefill's expanded K and V beside the latent row)."""
    if cfg.mla:
        m = cfg.mla
        return (cfg.num_heads * max(m.qk_head_dim, m.cache_width),
                (cfg.num_heads * (m.qk_head_dim + m.v_head_dim) + m.cache_width + 1) // 2)
    return cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim


def layer_pass_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype, expert_groups: int = 2) -> int:
    """Bytes one layer pass (pre- and post-attention) allocates per token, none freed before it ends."""
    el, h, f, E, k = _elem(dtype), cfg.hidden_size, cfg.intermediate_size, cfg.num_experts, cfg.top_k
    q, kv = attention_widths(cfg)
    pre = _norm(h, el) + 2 * el * (q + 2 * kv) + 5 * el * (q + kv)  # projections (+ bias / clip), rotary
    if cfg.mla:  # the low-rank projections and their norms
        m = cfg.mla
        pre += _norm(m.q_lora_rank, el) + _norm(m.kv_lora_rank, el) + 2 * el * (m.q_lora_rank + m.cache_width)
    if cfg.qk_norm:
        pre += _norm(q, el) + _norm(kv, el)
    act = 6 if cfg.swiglu_limit else 2  # clamped SwiGLU: clamps, sums, sigmoid; plain: silu and product
    bias = cfg.model_type == "gpt_oss"
    per_group = 83 + 3 * el * h + 5 * el * f + act * el * f + (4 * el * f + 2 * el * h if bias else 0)
    routed = (el * E + 32 * E + 24 * k + 8  # router in float32, top-k; per-expert counts and bounds
              + k * (48 + el * h)  # sort, the rows in expert order
              + expert_groups * k * per_group
              + k * (20 + 4 * h + 4 * el * h))  # float32 scaling, back to token order, the sum
    if cfg.shared_expert_size:
        routed += el * (2 + 4 * cfg.shared_expert_size + 3 * h) + 4
    dense = 4 * el * (cfg.dense_intermediate_size or cfg.intermediate_size) + el * h
    return pre + 3 * el * h + _norm(h, el) + max(routed, dense)


def held_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """Tensors a pass keeps per token between its tasks: hidden states in and out, q/k/v, the
    attention output, rotary tables, the token id and position."""
    el = _elem(dtype)
    q, kv = attention_widths(cfg)
    return el * (2 * cfg.hidden_size + 2 * q + 2 * kv + 2 * cfg.head_dim) + 16


def logits_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """One sequence's final norm, LM head output and its float32 copy."""
    return _norm(cfg.hidden_size, _elem(dtype)) + (_elem(dtype) + 4) * cfg.vocab_size


def prefill_attention_scratch(cfg: ModelConfig, longest_prompt: int) -> int:
    """The largest prompt's causal attention: float32 scores, mask, softmax and their copies."""
    return 6 * 4 * cfg.num_heads * longest_prompt * (longest_prompt + 1)


def gpu_decode_attention_bytes(cfg: ModelConfig, dtype: torch.dtype, batch: int, context: int) -> int:
    """FlexGen's GPU attention over one micro-batch: its packed K/V buffers, the keys and values
    gathered per sequence in the dtype and in float32, scores and their softmax in float32."""
    el = _elem(dtype)
    kv = batch * context * (2 * cfg.mla.cache_width if cfg.mla else cfg.kv_elements_per_token)  # MLA: K row, V latent
    return kv * el + kv * (el + 4) + 4 * 4 * batch * cfg.num_heads * context + 16 * batch * context


def prefix_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """A cached prefix position that prefill attention reads on the device (prefix sharing): its cache
    entries uploaded, expanded to K and V (MLA), copied beside the new tokens' K and V, and gathered in
    float32 by the attention."""
    el = _elem(dtype)
    if cfg.mla:
        m = cfg.mla
        kv = cfg.num_heads * (m.qk_head_dim + m.v_head_dim)
        return el * m.cache_width + el * kv + el * kv + 4 * kv
    kv = cfg.kv_elements_per_token
    return el * kv + el * kv + 4 * kv


@dataclass(frozen=True)
class MemoryPlan:
    """Device bytes the runtime may use."""

    non_expert: int
    resident_experts: int
    paged_slots: int  # 2 x one layer's CPU-resident experts
    activations: int  # the largest pass (a prefill chunk, with its prefixes' share, or a decode pass)
    kv_buffers: int  # FlexGen: two micro-batches' KV of one layer on the device, and their attention
    prefix_tokens: int = 4096  # cached prefix positions a prefill pass reads at once (pass_tasks groups rows)

    @property
    def total(self) -> int:
        return self.non_expert + self.resident_experts + self.paged_slots + self.activations + self.kv_buffers

    @classmethod
    def for_model(cls, model: MoECausalLM, n_resident: int, max_prefill_tokens: int, max_prompt_len: int,
                  max_batch: int, max_context: int, gpu_attention: bool, max_sequences: int | None = None,
                  fused_dequant: bool = False) -> MemoryPlan:
        """max_batch: the largest micro-batch; max_sequences: the most sequences of a decode pass;
        fused_dequant: the device multiplies quantized experts as they are (no dequantized layer)."""
        cfg = model.config
        dtype = model.embed_tokens.weight.dtype
        non_expert = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                         if not routed_expert_param(n))
        resident, paged, dequantized = expert_stack_bytes(model, n_resident, fused_dequant)
        groups = 2 if 0 < n_resident < cfg.num_experts else 1
        layer = layer_pass_bytes_per_token(cfg, dtype, groups)
        held = held_bytes_per_token(cfg, dtype)
        logits = logits_bytes(cfg, dtype)
        decode = (max_sequences or max_batch) * (held + logits) + max_batch * layer
        prefix_tokens = max(max_prefill_tokens, max_prompt_len)  # a row's prefix is shorter than its prompt
        prefill = (max_prefill_tokens * (held + layer) + prefill_attention_scratch(cfg, max_prompt_len)
                   + max_batch * logits + prefix_tokens * prefix_bytes_per_token(cfg, dtype))
        n_kv = 2 if gpu_attention else 0
        kv = n_kv * gpu_decode_attention_bytes(cfg, dtype, max_batch, max_context + 1)
        sparse = sum(cfg.is_sparse(j) for j in range(cfg.num_layers))
        return cls(non_expert, sparse * resident + dequantized, 2 * paged, max(decode, prefill), kv, prefix_tokens)


def expert_stack_bytes(model: MoECausalLM, n_resident: int, fused_dequant: bool = False) -> tuple[int, int, int]:
    """(one layer's resident stacks, one paged slot, the dequantized layer and the temporaries of
    dequantizing it) in device bytes, laid out as the weight pager lays them (runtime/expert_stacks.py);
    the last is 0 for 16-bit experts and where the fused dequant-GEMM multiplies the codes as they are."""
    from moelight.runtime.expert_stacks import DEQUANTIZE_SCRATCH, StackLayout

    cfg = model.config
    n_paged = cfg.num_experts - n_resident
    held = held_quantized(model)
    if held is not None:
        layouts = [StackLayout.quantized(n, *held) for n in (n_resident, n_paged)]
        dense = StackLayout.dense(cfg.num_experts, cfg.hidden_size, cfg.intermediate_size,
                                  model.embed_tokens.weight.dtype).nbytes + DEQUANTIZE_SCRATCH
        dense = 0 if fused_dequant else dense
    else:
        dtype = model.embed_tokens.weight.dtype
        layouts = [StackLayout.dense(n, cfg.hidden_size, cfg.intermediate_size, dtype) for n in (n_resident, n_paged)]
        dense = 0
    return layouts[0].nbytes, layouts[1].nbytes if n_paged else 0, dense
