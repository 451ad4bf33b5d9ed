"""Megatron-style tensor-parallel shards of a loaded model: one rank's slice of every layer.

Each rank holds 1/N of the attention heads (q/k/v rows, O-projection columns, sinks; MLA's
per-head up-projections, with the latent replicated: see moelight/parallel/__init__.py) and
1/N of every expert's intermediate dimension (gate and up rows, down columns), the same for
shared experts and dense MLPs; embeddings, norms, routers and the LM head are replicated.
A rank's model is an ordinary `MoECausalLM` built from a config with N times fewer heads and
a N times narrower FFN, so the executors, the weight pager and the KV cache need no change:
they size everything from `model.config`. The two row-parallel outputs of a layer (O
projection, FFN) are partial sums; `layer.tp_reduce` all-reduces them (DecoderLayerBase).
Biases added after a row-parallel matmul are kept on rank 0 only, so the sum adds them once.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import replace

import torch
from torch import nn

from moelight.errors import MoelightError
from moelight.loading.weights import empty_model, fillable_parameters
from moelight.models.causal_lm import MoECausalLM
from moelight.models.config import ModelConfig
from moelight.models.quantized_experts import QuantizedExperts, QuantPiece, quantized_experts_of


class TensorParallelError(MoelightError):
    """A model that cannot be split N ways, or a rank that failed; the message says which."""


def _spec(cfg: ModelConfig):
    from hrm import model_from_hf_config

    return model_from_hf_config(cfg.to_hf_dict())


def tensor_parallel_problems(cfg: ModelConfig, n: int) -> list[str]:
    """Every count of `cfg` that N does not divide (the HRM's check, so plan and run agree)."""
    return _spec(cfg).tensor_parallel_problems(n)


def shard_config(cfg: ModelConfig, n: int) -> ModelConfig:
    """The config of one rank's model; TensorParallelError names what N does not divide."""
    try:
        _spec(cfg).check_tensor_parallel(n)
    except ValueError as e:
        raise TensorParallelError(str(e)) from None
    form, f = cfg.expert_format, cfg.intermediate_size
    if form is not None and form.group and (f // n) % form.group:
        raise TensorParallelError(f"{n} ranks split each expert's down projection into {f // n} columns, which "
                                  f"its {form.fmt} scale groups of {form.group} do not divide; use a group that "
                                  f"divides {f // n} ({form.origin})")
    return replace(
        cfg,
        num_heads=cfg.num_heads // n,
        num_kv_heads=cfg.num_kv_heads // n,
        intermediate_size=cfg.intermediate_size // n,
        shared_expert_size=cfg.shared_expert_size // n,
        dense_intermediate_size=cfg.dense_intermediate_size // n,
    )


def _rows(t: torch.Tensor, r: int, n: int, dim: int = 0) -> torch.Tensor:
    return t.chunk(n, dim)[r]


def _packed_halves(t: torch.Tensor, r: int, n: int, dim: int) -> torch.Tensor:
    """gate and up stacked along `dim` ([.., 2f, ..]): rank r's part of each, stacked again."""
    gate, up = t.chunk(2, dim)
    return torch.cat((gate.chunk(n, dim)[r], up.chunk(n, dim)[r]), dim)


def _rank0(t: torch.Tensor, r: int, n: int) -> torch.Tensor:
    return t if r == 0 else torch.zeros_like(t)


# parameter-name suffix -> how rank r of n takes its part; anything else is replicated
_RULES: list[tuple[re.Pattern, Callable[[torch.Tensor, int, int], torch.Tensor]]] = [
    (re.compile(r"self_attn\.[qkv]_proj\.(weight|bias)$"), _rows),
    # MLA: the per-head up-projections are split by head; the latent's own projections and norms
    # (q_a_proj, kv_a_proj_with_mqa, *_layernorm) are replicated, so every rank has the whole latent
    (re.compile(r"self_attn\.(q_b_proj|kv_b_proj)\.weight$"), _rows),
    (re.compile(r"self_attn\.o_proj\.weight$"), lambda t, r, n: _rows(t, r, n, 1)),
    (re.compile(r"self_attn\.o_proj\.bias$"), _rank0),
    (re.compile(r"self_attn\.sinks$"), _rows),
    (re.compile(r"self_attn\.[qk]_norm\.weight$"), None),  # decided by qk_norm (below)
    (re.compile(r"mlp\.gate_up_proj$"), lambda t, r, n: _packed_halves(t, r, n, 1)),
    (re.compile(r"mlp\.down_proj$"), lambda t, r, n: _rows(t, r, n, 2)),
    (re.compile(r"mlp\.expert_bias\.gate_up$"), lambda t, r, n: _packed_halves(t, r, n, 1)),
    (re.compile(r"mlp\.expert_bias\.down$"), _rank0),
    (re.compile(r"mlp\.(shared_expert\.)?(gate|up)_proj\.weight$"), _rows),
    (re.compile(r"mlp\.(shared_expert\.)?down_proj\.weight$"), lambda t, r, n: _rows(t, r, n, 1)),
]


def part_of(name: str, full: torch.Tensor, cfg: ModelConfig, r: int, n: int) -> torch.Tensor:
    """Rank r's part of the whole parameter `name` of a model with config `cfg`."""
    for pattern, take in _RULES:
        if pattern.search(name):
            if take is None:  # q/k norms: per head (one weight [d], replicated) or over the projection
                return _rows(full, r, n) if cfg.qk_norm == "full" else full
            return take(full, r, n)
    return full


class ShardedRMSNorm(nn.Module):
    """RMSNorm over a projection split across ranks (OLMoE's q/k norm): the sum of squares is
    all-reduced so every rank divides by the whole projection's mean, as one device does."""

    def __init__(self, weight: torch.Tensor, eps: float, full_dim: int, all_reduce) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps, self.full_dim, self.all_reduce = eps, full_dim, all_reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        sq = self.all_reduce(xf.pow(2).sum(-1, keepdim=True))
        xf = xf * torch.rsqrt(sq / self.full_dim + self.eps)
        return self.weight * xf.to(x.dtype)


def shard_model(full: MoECausalLM, rank: int, n: int, all_reduce: Callable[[torch.Tensor], torch.Tensor]
                ) -> MoECausalLM:
    """Rank `rank`'s model: its slices of `full`'s weights (copied, so `full` can be freed) and the
    all-reduce that sums the layers' partial outputs."""
    part = empty_model(shard_config(full.config, n), full.embed_tokens.weight.dtype)
    sources = {name: p.detach() for name, p in full.named_parameters(remove_duplicate=False)}  # tied lm_head
    sources |= quantized_experts_of(full)  # routed experts held quantized: by their module
    for name, p in fillable_parameters(part).items():
        take_part(p, name, sources[name], full.config, rank, n)
    return finish_shard(part, full.config, all_reduce)


def quantized_part_of(name: str, whole: QuantizedExperts, r: int, n: int) -> QuantPiece:
    """Rank r's part of routed experts held quantized, cut as their 16-bit parameter is: gate_up's
    rows (each row keeps its scales), down's columns with their groups along K (shard_config has
    checked that a rank's columns hold whole groups). int8's scale per output row is the whole
    row's, so every rank keeps it: the shards hold the codes and scales one device holds, and
    dequantise to its values exactly."""
    m = whole.matrix()
    gate_up = name.endswith("gate_up_proj")

    def cut(t: torch.Tensor) -> torch.Tensor:
        return _packed_halves(t, r, n, 1) if gate_up else _rows(t, r, n, 2)

    def cut_scales(t: torch.Tensor | None) -> torch.Tensor | None:  # one scale per down row: kept whole
        return None if t is None else t if not gate_up and m.scales.shape[-1] == 1 else cut(t)

    return QuantPiece(m.fmt, cut(m.codes), cut_scales(m.scales), cut_scales(m.bias))


@torch.no_grad()
def take_part(p, name: str, whole, cfg: ModelConfig, rank: int, n: int) -> None:
    """Copy rank `rank`'s part of the whole parameter into the shard's parameter `p` (or of the
    whole routed experts into the shard's, where both are held quantized)."""
    quantized = isinstance(p, QuantizedExperts)
    piece = quantized_part_of(name, whole, rank, n) if quantized else part_of(name, whole, cfg, rank, n)
    if tuple(piece.shape) != tuple(p.shape):
        raise TensorParallelError(f"{name}: rank {rank}'s slice has shape {tuple(piece.shape)}, "
                                  f"the rank's model expects {tuple(p.shape)}")
    (p[()] if quantized else p).copy_(piece)


def finish_shard(part: MoECausalLM, full_cfg: ModelConfig, all_reduce) -> MoECausalLM:
    """Tie the embeddings, give every layer the all-reduce of its row-parallel outputs, and make
    OLMoE's whole-projection q/k norms sum their squares over the ranks."""
    cfg = part.config
    if cfg.tie_word_embeddings:
        part.lm_head.weight = part.embed_tokens.weight
    for layer in part.layers:
        layer.tp_reduce = all_reduce
        attn = layer.self_attn
        if cfg.qk_norm == "full":
            for key, heads in (("q_norm", full_cfg.num_heads), ("k_norm", full_cfg.num_kv_heads)):
                norm = getattr(attn, key)
                setattr(attn, key, ShardedRMSNorm(norm.weight.detach(), norm.eps, heads * cfg.head_dim,
                                                  all_reduce))
    return part.eval().requires_grad_(False)
