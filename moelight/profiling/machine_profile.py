"""Measure this machine's HRM numbers with torch (`moelight profile`).

Peaks are measured, not looked up, and on the CPU they are measured with the kernels
the engine runs, so the HRM predicts the engine rather than an ideal machine:
- read bandwidth (a sum over a large buffer),
- GEMM FLOP/s of oneDNN pre-packed weights (moelight.runtime.cpu_linear.packed_linear) as a
  function of the row count M, cycling through more weight bytes than the caches hold
  (an expert's weights come from DRAM in every layer); small M is far below peak,
- the decode attention kernel's KV read bandwidth and the prefill attention FLOP/s
  (cpu_kernels),
- the fixed cost per decode step (Python dispatch, small ops), from a toy model's decode step
  (its compute is ~0), and the engine's host work per sequence per step (sequence_step.py),
- the fixed cost per layer pass and the rate of the element-wise work between the GEMMs (norms,
  rotary, KV writes, routing), from real decoder layers decoding in place, less their expert and
  attention kernels and their GEMMs timed alone in the same phase, at two token counts (layer_glue.py),
- the rate of the host's passes over a decode step's logits (cast, check, argmax),
- the rate a fresh KV cache pool is faulted in at by its first writes (kv_first_touch.py).
The pageable -> pinned copy rate (the first paging hop) is measured on any host; with CUDA
moelight/profiling/gpu_profile.py measures the GPU terms and the link, and runtime_pass.py the cost of
a layer pass through the CGOPipe runtime itself.
The result is an hrm.HardwareSpec (hrm itself never imports torch), cached as JSON and
loaded with `--hardware profile`.
"""

from __future__ import annotations

import os
import platform
from dataclasses import replace
from datetime import datetime, timezone

from hrm.hardware import HardwareSpec, Level, Link
from moelight.profiling.expert_kernel_curve import measure_expert_curve
from moelight.profiling.kv_first_touch import measure_kv_first_touch
from moelight.profiling.layer_glue import measure_layer_glue
from moelight.profiling.runtime_pass import measure_runtime_layer_pass
from moelight.profiling.sequence_step import measure_sequence_step
from moelight.profiling.timing import best_time, fastest_in_rounds

GEMM_ROWS = (1, 4, 16, 64, 256, 1024)
GEMM_ROWS_QUICK = (1, 16, 128, 1024)
_GEMM_K, _GEMM_N = 2048, 4096  # weight shape (in, out) of the probe GEMM


def _cpu_memory_bytes() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 16.0 * 2**30


def bf16_gemm_form() -> str:
    """The form the engine holds bf16 matmul weights in on this host (what the bf16 GEMM curve measures)."""
    import torch

    from moelight.runtime.cpu_linear import linear_form

    return linear_form(torch.bfloat16, _GEMM_K)


def measure_gemm_curve(dtype, rows=GEMM_ROWS, pool_bytes: float = 96 * 2**20,
                       repeat: int = 3) -> list[list[float]]:
    """[[M, FLOP/s], ...] of the engine's CPU GEMM as runtime/cpu_linear holds its weights (linear_form: packed
    oneDNN weights, bf16 strips or float32 copies where oneDNN packs no bf16; aten if neither), with
    PackedLinear's few-row path (small_linear on the plain bf16 weight) at the rows it takes it."""
    import torch

    from cpu_kernels import dispatch
    from cpu_kernels.strip_linear import pack_linear_strips, strip_linear
    from moelight.runtime.cpu_linear import linear_form, pack_weight, packed_linear, plain_bf16_rows

    elem = torch.empty((), dtype=dtype).element_size()
    n_w = max(2, int(pool_bytes // (_GEMM_K * _GEMM_N * elem)))
    dense = [torch.randn(_GEMM_N, _GEMM_K).to(dtype) for _ in range(n_w)]
    form = linear_form(dtype, _GEMM_K)
    few = plain_bf16_rows(form) if dtype == torch.bfloat16 else 0
    if form == "packed":
        weights, mm = [pack_weight(w) for w in dense], packed_linear
    elif form == "strips":
        weights = [pack_linear_strips(w) for w in dense]

        def mm(x, w):
            return strip_linear(x, w, None, _GEMM_N)
    elif form == "float32":
        weights = [pack_weight(w.float()) for w in dense]

        def mm(x, w):
            return packed_linear(x.float(), w).to(torch.bfloat16)
    else:
        weights, mm = dense, torch.nn.functional.linear
    passes, pools = [], []
    for m in rows:
        x = torch.randn(m, _GEMM_K).to(dtype)
        pool = weights if m <= 64 else weights[:2]  # large M is compute-bound: caches do not matter
        fn = mm
        if m <= few:
            pool, fn = dense, dispatch.small_linear

        def one_pass(x=x, pool=pool, fn=fn) -> None:
            # back to back through the pool, as a layer calls its experts: each weight was
            # evicted from cache since its last use, and the fastest *single* call (a lucky
            # one) would overstate the sustained rate at small M
            for w in pool:
                fn(x, w)

        passes.append(one_pass)
        pools.append(len(pool))
    seconds = fastest_in_rounds(passes, repeat)
    return [[float(m), 2.0 * m * _GEMM_K * _GEMM_N * n / t] for m, n, t in zip(rows, pools, seconds, strict=True)]


def measure_attention(dtype, quick: bool = False) -> tuple[float, float]:
    """(decode attention KV bytes/s, prefill attention FLOP/s) of cpu_kernels in `dtype`."""
    import torch

    from cpu_kernels import decode_attention, prefill_attention

    hq, hkv, d = 16, 4, 128
    seqs, ctx = (32, 256) if quick else (64, 512)
    total = seqs * ctx
    k = torch.randn(hkv, total, d).to(dtype)
    v = torch.randn(hkv, total, d).to(dtype)
    q = torch.randn(seqs, hq, d).to(dtype)
    offsets = torch.arange(seqs, dtype=torch.int64) * ctx
    lengths = torch.full((seqs,), ctx, dtype=torch.int64)
    t = best_time(lambda: decode_attention(q, k, v, offsets, lengths, d**-0.5), 3)
    kv_bw = 2.0 * total * hkv * d * k.element_size() / t
    p_seqs, p_len = (2, 256) if quick else (4, 512)
    tokens = p_seqs * p_len
    qp = torch.randn(tokens, hq, d).to(dtype)
    kp = torch.randn(tokens, hkv, d).to(dtype)
    vp = torch.randn(tokens, hkv, d).to(dtype)
    cu = torch.arange(p_seqs + 1, dtype=torch.int64) * p_len
    t = best_time(lambda: prefill_attention(qp, kp, vp, cu, d**-0.5), 2)
    flops = 2.0 * hq * d * p_len * p_len * p_seqs  # causal: half of 4 * Hq * d * p^2
    return kv_bw, flops / t


def measure_overheads(dtype, quick: bool = False) -> tuple[float, float]:
    """(seconds per layer pass, seconds per micro-batch step outside the layers).

    A toy model (hidden 64, 8 experts, 16 sequences so every expert is touched) has
    negligible compute, so its times are dispatch cost (Python, kernel calls, threading).
    The per-layer cost is the slope of a decode forward over depth (0 vs 4 layers); the
    per-step cost is the 0-layer forward (embedding, rotary) plus LM head and sampling.
    """
    import torch
    from torch import nn

    from moelight.loading.presets import PRESETS
    from moelight.loading.weights import build_model
    from moelight.runtime.cpu_linear import pack_model
    from moelight.runtime.forward import decode_step
    from moelight.runtime.kv_cache import RaggedKVCache
    from moelight.sampling.params import SamplingParams
    from moelight.sampling.sampler import Sampler

    samples, seqs, ctx, depth = (12 if quick else 30), 16, 32, 4
    cfg = replace(PRESETS["tiny"], num_layers=depth, num_experts=8, top_k=2)
    model = build_model(cfg, dtype, None, 0)
    pack_model(model)
    all_layers = model.layers
    cache = RaggedKVCache.allocate(cfg, [ctx + 1] * seqs, dtype)
    offsets = cache.offsets.clone()
    tokens = torch.arange(seqs, dtype=torch.int64) + 3
    pos = torch.full((seqs,), ctx, dtype=torch.int64)
    rows = list(range(seqs))
    sampler = Sampler([SamplingParams(max_tokens=2, temperature=0.0)] * seqs, [0] * seqs)

    def step() -> None:
        logits = model.logits(decode_step(model, cache, tokens, offsets, pos))
        torch.tensor(sampler(logits, rows).tolist(), dtype=torch.int64)

    try:
        full = best_time(step, samples)
        model.layers = nn.ModuleList()
        bare = best_time(step, samples)
    finally:
        model.layers = all_layers
    return max(0.0, (full - bare) / depth), bare


LOGIT_ROWS, LOGIT_VOCAB = 256, 32000


def measure_logits_passes(quick: bool = False) -> float:
    """Bytes/s of the host's passes over a decode step's logits, as the engine runs them: the LM head's
    bf16 output widened to float32 (MoECausalLM.logits), the finiteness check (one sum) and the greedy
    argmax (cpu_kernels.topk_rows): hrm.costs.LOGIT_PASS_BYTES per logit. At 256 sequences and a 32k
    vocabulary that is ~115 MB a step, several ms on a 2-core host, which no other term counts."""
    import torch

    from cpu_kernels import topk_rows
    from hrm.costs import LOGIT_PASS_BYTES

    out = torch.randn(LOGIT_ROWS, LOGIT_VOCAB).to(torch.bfloat16)

    def passes() -> None:
        logits = out.float()
        bool(torch.isfinite(logits.sum()))
        topk_rows(logits.contiguous(), 1)

    return LOGIT_PASS_BYTES * out.numel() / best_time(passes, 5 if quick else 10)


def measure_cpu(quick: bool = False) -> Level:
    """CPU read bandwidth, engine GEMM FLOP/s curves, attention kernels and dispatch overheads."""
    import torch

    n_bytes = (64 if quick else 256) * 2**20
    buf = torch.ones(n_bytes // 4, dtype=torch.float32)
    bw = n_bytes / best_time(buf.sum, 3 if quick else 5)
    buf = None  # free it before the GEMM probes allocate theirs
    rows = GEMM_ROWS_QUICK if quick else GEMM_ROWS
    pool = (48 if quick else 96) * 2**20
    curves = {name: measure_gemm_curve(dt, rows, pool) for name, dt in
              (("float32", torch.float32), ("bfloat16", torch.bfloat16))}
    flops = {name: max(f for _, f in c) for name, c in curves.items()}
    flops["float16"] = flops["bfloat16"]  # CPU half kernels run at about the bf16 rate (no curve: aten)
    att_bw, att_flops = 0.0, {}
    try:
        att_bw, att_flops["bfloat16"] = measure_attention(torch.bfloat16, quick)
        att_flops["float32"] = measure_attention(torch.float32, quick)[1]
    except (RuntimeError, ImportError):  # no attention kernels: the HRM falls back to the roofs
        pass
    toy_layer_oh, step_oh = measure_overheads(torch.bfloat16, quick)
    per_sequence = measure_sequence_step(quick)
    experts = measure_expert_curve(quick)
    level = Level(f"cpu-{os.cpu_count()}c-{platform.machine()}", _cpu_memory_bytes(), bw, flops,
                  gemm_flops=curves, gemm_form=bf16_gemm_form(), attention_bandwidth=att_bw, attention_flops=att_flops,
                  step_overhead_s=step_oh, sequence_step_s=per_sequence, expert_gemm_flops=experts,
                  logits_bandwidth=measure_logits_passes(quick),
                  kv_first_touch_bandwidth=measure_kv_first_touch(quick))
    # the glue beyond the kernels and the GEMMs this level prices: a fixed cost per layer pass and element-wise bytes
    layer_oh, elementwise = measure_layer_glue(torch.bfloat16, quick, toy_layer_oh)
    return replace(level, layer_overhead_s=layer_oh, elementwise_bandwidth=elementwise)


def measure_gpu(quick: bool = False) -> tuple[Level, Link, int] | None:
    """GPU 0 and its link (moelight/profiling/gpu_profile.py); None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    from moelight.profiling import gpu_profile as gp

    dev = torch.device("cuda:0")
    sync = torch.cuda.synchronize
    props = torch.cuda.get_device_properties(dev)
    n_bytes = (128 if quick else 1024) * 2**20
    src = torch.empty(n_bytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    bw = 2.0 * n_bytes / best_time(lambda: dst.copy_(src), 5, sync)  # read + write
    src = dst = None
    flops = {}
    size = 2048 if quick else 8192
    for name, dt in (("float32", torch.float32), ("bfloat16", torch.bfloat16), ("float16", torch.float16)):
        a = torch.randn(size, size, device=dev, dtype=dt)
        b = torch.randn(size, size, device=dev, dtype=dt)
        c = torch.empty_like(a)  # one output: a fast GPU runs thousands of products a second

        def products(r: int, a=a, b=b, c=c) -> None:
            for _ in range(r):
                torch.mm(a, b, out=c)

        # repeated for ~a second so the clock settles under the board's power cap (T4, L4)
        reps = max(1, int(1.0 / best_time(lambda: products(1), 2, sync)))
        flops[name] = 2.0 * size**3 * reps / best_time(lambda r=reps: products(r), 3, sync)
    fast = "float16" if flops["float16"] >= flops["bfloat16"] else "bfloat16"
    dt = getattr(torch, fast)
    gemm_bw, curve = gp.measure_expert_gemm(dt, quick)
    att_bw, att_flops = gp.measure_gpu_attention(dt, quick)
    level = Level(props.name, float(props.total_memory), bw, flops, gemm_flops={fast: curve},
                  attention_bandwidth=att_bw, attention_flops={fast: att_flops},
                  layer_overhead_s=gp.KERNELS_PER_LAYER * gp.measure_launch_overhead(quick),
                  runtime_layer_s=measure_runtime_layer_pass("cuda", quick),
                  gemm_bandwidth=gemm_bw, fused_dequant=_fused_dequant(dev, dt))
    return level, gp.measure_link(quick), torch.cuda.device_count()


def _fused_dequant(dev, dtype) -> bool:
    """Whether runs here multiply quantized experts with the fused dequant-GEMM (int4 at group 128, the
    --quantize default; MOELIGHT_DEQUANT_GEMM as the profile ran)."""
    from moelight.models.fused_dequant import use_fused

    return use_fused(dev, dtype, "uint4", (128, 128), (128, 128))


def profile_machine(quick: bool = False) -> HardwareSpec:
    """Measure CPU (and GPUs when CUDA is present) into a HardwareSpec; its notes say so where other
    processes took a share of the CPUs meanwhile (host_load.OtherWork)."""
    from moelight.profiling.gpu_profile import measure_staging
    from moelight.profiling.host_load import OtherWork

    with OtherWork() as other:
        cpu = measure_cpu(quick)
        staging = measure_staging(quick)
        gpu = measure_gpu(quick)
    source = ("measured by moelight profile (no CUDA)" if gpu is None
              else "measured by moelight profile; GPU numbers from cuda:0, assumed identical")
    notes = "; ".join(filter(None, (source, other.note())))
    when = datetime.now(timezone.utc).isoformat(timespec="seconds")
    if gpu is None:
        return HardwareSpec("profiled", cpu, notes=notes, staging_bandwidth=staging, measured_at=when)
    level, link, count = gpu
    return HardwareSpec("profiled", cpu, level, count, link, staging_bandwidth=staging, notes=notes,
                        measured_at=when)
