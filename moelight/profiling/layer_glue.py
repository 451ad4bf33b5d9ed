"""What a decode layer pass costs the CPU engine beyond the terms the HRM prices as kernels, measured
where the engine pays it: in the real layer sequence.

On a host where each parallel op wakes its threads (a KVM guest: ~0.3 ms an op), the ops between the
GEMMs (norms, rotary, KV writes, routing, residual adds) and the GEMMs themselves right after the expert
kernel run several times slower than the same ops timed back to back alone (an AMX host: a 256-row
q projection 0.33 ms alone, 0.75 ms right after the experts). A layer of bench-1b at 256 tokens spent
~4 ms a pass there, where a glue probe timed alone (and a dispatch probe on a 64-wide toy model, whose ops
never go parallel) gave the HRM ~1.4 ms.

So `measure_layer_glue` decodes through LAYERS real bench-1b layers, packed as the engine packs them
(fused experts), at two token counts, and times the pass, the expert kernel and the attention kernel in
place. Right after each step it times the same layers' projection and router GEMMs alone (the terms the
HRM prices from its GEMM curve), and the glue is the step's rest less those: both sides of the difference
come from the same phase of a shared host, where subtracting a GEMM curve measured a minute earlier
moved the difference by more than its size (BENCHMARKS.md §4: 1.1-8.5 ms a layer at 256 tokens over
four profiles, against ~12 ms of GEMMs). The HRM charges the glue as a fixed cost per layer pass plus
element-wise bytes (hrm.operators) at a rate: the line through the two points.
"""

from __future__ import annotations

from dataclasses import replace

LAYERS = 4  # distinct layers: each pass reads other experts, as a decode step does
TOKENS = (32, 256)
CONTEXT = 64


def glue_line(glue_s: tuple[float, float], nbytes: tuple[float, float],
              fallback_overhead: float) -> tuple[float, float]:
    """(seconds per layer pass, element-wise bytes/s) of the line through (bytes, glue seconds) at the two
    token counts. A noisy host may leave no positive slope: then all the glue at the larger count is
    element-wise work on top of `fallback_overhead` (a lower bound of the rate, never a missing one)."""
    (b0, b1), (g0, g1) = nbytes, glue_s
    if g1 > g0 and b1 > b0:
        rate = (b1 - b0) / (g1 - g0)
        return max(0.0, g0 - b0 / rate), rate
    return fallback_overhead, b1 / max(g1 - fallback_overhead, 1e-6)


def measure_layer_glue(dtype, quick: bool = False, fallback_overhead: float = 0.0) -> tuple[float, float]:
    """(seconds per layer pass, element-wise bytes/s) of the engine's decode layer beyond its kernels and
    GEMMs; (fallback_overhead, 0.0) where the model cannot be packed for this dtype."""

    from hrm.dtypes import dtype_bytes
    from hrm.model import model_from_hf_config
    from hrm.operators import post_attention_elementwise, pre_attention_elementwise
    from moelight.loading.presets import PRESETS
    from moelight.loading.weights import build_model
    from moelight.runtime.cpu_linear import pack_model

    cfg = replace(PRESETS["bench-1b"], num_layers=LAYERS, vocab_size=256)
    model = build_model(cfg, dtype, None, 0)
    if not pack_model(model):
        return fallback_overhead, 0.0
    spec = model_from_hf_config(cfg.to_hf_dict(), "profile")
    b = dtype_bytes(str(dtype).removeprefix("torch."))
    samples = 4 if quick else 10
    glue, nbytes = [], []
    for t in TOKENS:
        glue.append(_glue_seconds(model, cfg, dtype, t, samples))
        nbytes.append(float(pre_attention_elementwise(spec, t, b).bytes + post_attention_elementwise(spec, t, b).bytes))
    return glue_line((glue[0], glue[1]), (nbytes[0], nbytes[1]), fallback_overhead)


def _gemms_alone_seconds(model, tokens: int, dtype) -> float:
    """Seconds of every layer's q/k/v, o and router GEMMs at `tokens` rows, called back to back as the
    layer calls them (the HRM's qkv_proj, o_proj and router terms)."""
    import time

    import torch

    from moelight.models.moe import router_logits

    attn = model.layers[0].self_attn
    h = torch.randn(tokens, model.config.hidden_size).to(dtype)
    heads_out = torch.randn(tokens, attn.n_heads * attn.head_dim).to(dtype)
    t0 = time.perf_counter()
    for layer in model.layers:
        layer.self_attn.qkv(h)
        layer.self_attn.o_proj(heads_out)
        router_logits(h, layer.mlp.gate.weight)
    return time.perf_counter() - t0


def _glue_seconds(model, cfg, dtype, tokens: int, samples: int) -> float:
    """Seconds of one layer pass at `tokens` decode tokens beyond its expert and attention kernels and
    its GEMMs: per step, the pass less its kernels less the GEMMs timed alone right after it (one phase
    of the host), the median of `samples` steps, each over LAYERS layers."""
    import statistics
    import time

    import torch

    from moelight.runtime.forward import decode_step
    from moelight.runtime.kv_cache import RaggedKVCache

    cache = RaggedKVCache.allocate(cfg, [CONTEXT + 1] * tokens, dtype)
    for j in range(cfg.num_layers):
        for t in cache.layer(j):
            t.zero_()
    ids = torch.arange(tokens, dtype=torch.int64) % cfg.vocab_size
    pos = torch.full((tokens,), CONTEXT, dtype=torch.int64)
    kernels = [0.0]
    moes = [layer.mlp.gate_up_proj for layer in model.layers]
    saved_attend = cache.attend

    def timed(fn):
        def call(*a, **k):
            t0 = time.perf_counter()
            out = fn(*a, **k)
            kernels[0] += time.perf_counter() - t0
            return out
        return call

    for fused in moes:
        fused.fused_mix = timed(fused.fused_mix)
    cache.attend = timed(saved_attend)
    glue = []
    try:
        for _ in range(samples + 1):  # the first warms the allocator and the kernels' caches
            kernels[0] = 0.0
            t0 = time.perf_counter()
            decode_step(model, cache, ids, cache.offsets, pos)
            rest = time.perf_counter() - t0 - kernels[0]
            glue.append(rest - _gemms_alone_seconds(model, tokens, dtype))
    finally:
        for fused in moes:
            del fused.fused_mix
        del cache.attend
    # the median, not the fastest: a job pays the glue's typical cost every layer of every step
    return statistics.median(glue[1:]) / cfg.num_layers
