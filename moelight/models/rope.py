"""Rotary position embeddings: the plain RoPE inverse frequencies, linear and Llama-3 scaling, and YaRN's
(GPT-OSS, Qwen3's long-context configs, DeepSeek with its `mscale` / `mscale_all_dim`), computed as
transformers computes them, so cos/sin match to the last bit in float32."""

from __future__ import annotations

import functools
import math

import torch

from moelight.models.config import ModelConfig


@functools.lru_cache(maxsize=16)
def inverse_frequencies(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim / 2], the factor cos and sin are scaled by); computed once per config (a
    decode step at batch 1 spent ~0.14 ms on it), so callers must not modify the tensor."""
    d, base = cfg.head_dim, cfg.rope_theta
    plain = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    p = dict(cfg.rope_scaling)
    rope_type = p.pop("rope_type", "default")
    if rope_type == "default":
        return plain, 1.0
    if rope_type == "linear":  # positions divided by factor, folded into the frequencies
        return plain / float(p["factor"]), 1.0
    if rope_type == "llama3":
        return _llama3(p, plain), 1.0
    return _yarn(p, d, base, cfg.max_position_embeddings)


def _llama3(p: dict, inv_freq: torch.Tensor) -> torch.Tensor:
    """Llama 3.1's scaling: wavelengths longer than original / low_freq_factor are stretched by
    `factor`, shorter than original / high_freq_factor kept, those between blended smoothly."""
    factor, low, high = float(p["factor"]), float(p["low_freq_factor"]), float(p["high_freq_factor"])
    original = float(p["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < original / high) * ~(wavelen > original / low)
    return torch.where(medium, blended, scaled)


def _yarn(p: dict, d: int, base: float, context: int) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071): interpolate the low frequencies by `factor`, keep the high ones,
    ramp linearly between the beta_fast / beta_slow correction dimensions. Without an
    original_max_position_embeddings the model's context is the original one, as transformers reads it."""
    factor = float(p["factor"])
    original = int(p.get("original_max_position_embeddings") or context)
    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = p.get("mscale"), p.get("mscale_all_dim")
        attention_factor = (yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
                            if mscale and mscale_all_dim else yarn_mscale(factor))
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (d * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, d, 2).to(dtype=torch.float) / d)
    extrapolate = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv_freq, float(attention_factor)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature for a context stretched `factor` times (1 when not stretched)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rotary_cos_sin(positions: torch.Tensor, cfg: ModelConfig, dtype: torch.dtype):
    """cos/sin [T, head_dim] for the given absolute positions (float32, then `dtype`, as HF does)."""
    inv_freq, scale = inverse_frequencies(cfg)
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    if scale == 1.0:
        return emb.cos().to(dtype), emb.sin().to(dtype)
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)
