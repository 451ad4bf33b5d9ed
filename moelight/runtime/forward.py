"""Whole-model passes for the plain (single-device) executor: prefill and one decode step.

Both walk the layers as pre-attention -> KV write -> attention -> post-attention, the
split CGOPipe pipelines across devices. A layer says what its cache keeps and how its attention
reads it (`attention_inputs`, `prefill_kv`, `decode_output`): GQA's K and V, or MLA's latent rows
read by the absorbed decode; the cache (RaggedKVCache or LatentKVCache) attends accordingly, a
prompt after a cached prefix too (`prefix_attend`).
"""

from __future__ import annotations

import torch

from cpu_kernels import prefill_attention
from moelight.models.causal_lm import MoECausalLM
from moelight.runtime.kv_cache import RaggedKVCache
from moelight.runtime.latent_kv_cache import LatentKVCache
from moelight.runtime.paged_layout import PagedLayout

KVPlace = torch.Tensor | PagedLayout  # ragged offsets [B] or block tables


def attention_extras(model: MoECausalLM, layer: int) -> dict:
    """A layer's sliding window and attention sinks, for the attention kernels (none for most families)."""
    cfg = model.config
    if not (cfg.sliding_layers or cfg.attention_sinks):
        return {}
    sinks = model.layers[layer].self_attn.sinks if cfg.attention_sinks else None
    return {"window": cfg.window(layer), "sinks": sinks}


@torch.inference_mode()
def prefill(
    model: MoECausalLM, cache: RaggedKVCache | LatentKVCache, tokens: torch.Tensor, seq_lens: torch.Tensor,
    place: KVPlace, rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Packed prompts tokens [T] (seq_lens [B]; `place`: cache offsets [B], or block tables whose
    `starts` say how many leading positions are cached already and the tokens are the rest) -> last
    hidden state [B, h], or the hidden states of the packed positions `rows` (prompt logprobs)."""
    cu = torch.zeros(len(seq_lens) + 1, dtype=torch.int64)
    torch.cumsum(seq_lens, 0, out=cu[1:])
    starts = torch.repeat_interleave(cu[:-1], seq_lens)
    positions = torch.arange(int(cu[-1]), dtype=torch.int64) - starts
    paged = isinstance(place, PagedLayout)
    if paged:
        cached = place.cached(len(seq_lens))
        positions += torch.repeat_interleave(cached, seq_lens)
        slots = place.slots(positions, torch.repeat_interleave(torch.arange(len(seq_lens)), seq_lens))
        paged = bool((cached > 0).any())  # attention reads the cache only where a prefix is there
    else:
        slots = torch.repeat_interleave(place, seq_lens) + positions
    last = cu[1:] - 1 if rows is None else rows
    scale = model.config.attention_scale
    x = model.embed_tokens(tokens)
    cos, sin = model.rotary(positions, x.dtype)
    n_layers = len(model.layers)
    for li, layer in enumerate(model.layers):
        q, entry = layer.attention_inputs(x, cos, sin)
        cache.write(li, *entry, slots)
        if paged:  # after cached prefixes: through the block tables (MLA: prefix rows expanded too)
            attn = cache.prefix_attend(li, q, layer.prefill_kv, place, seq_lens, cu, scale,
                                       **attention_extras(model, li))
        else:
            attn = prefill_attention(q, *layer.prefill_kv(*entry), cu, scale, **attention_extras(model, li))
        attn = attn.flatten(1)
        if li == n_layers - 1:  # only the last token of each prompt feeds the LM head
            x, attn = x[last], attn[last]
        x = layer.post_attention(x, attn)
    return x


def decode_slots(place: KVPlace, positions: torch.Tensor) -> torch.Tensor:
    """Cache slots the decode step writes (each row's `positions`)."""
    if isinstance(place, PagedLayout):
        return place.slots(positions, torch.arange(len(positions)))
    return place + positions


@torch.inference_mode()
def decode_step(
    model: MoECausalLM, cache: RaggedKVCache | LatentKVCache, tokens: torch.Tensor, place: KVPlace,
    positions: torch.Tensor,
) -> torch.Tensor:
    """One new token per sequence: tokens [B] at positions [B] -> hidden state [B, h]."""
    slots = decode_slots(place, positions)
    lengths = positions + 1
    scale = model.config.attention_scale
    x = model.embed_tokens(tokens)
    cos, sin = model.rotary(positions, x.dtype)
    for li, layer in enumerate(model.layers):
        q, entry = layer.attention_inputs(x, cos, sin, decode=True)
        cache.write(li, *entry, slots)
        attn = cache.attend(li, q, place, lengths, scale, **attention_extras(model, li)).flatten(1)
        x = layer.post_attention(x, layer.decode_output(attn))
    return x
