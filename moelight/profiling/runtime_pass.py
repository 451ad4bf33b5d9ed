"""The fixed cost of one layer pass as the CGOPipe runtime pays it on a GPU, measured through the
runtime itself.

Launching a layer's kernels (gpu_profile.measure_launch_overhead x KERNELS_PER_LAYER) is only part
of a layer pass: the runtime's Python builds each task, the lanes hand tensors over through events,
and with CPU attention a micro-batch's layer waits for its Q/K/V to come down, the CPU kernel, and the
result to go back up. At a few hundred sequences on a fast GPU that chain, not the GPU's kernels,
sets a decode step's time. So a model whose compute is ~0 (the tiny preset's widths, few sequences)
decodes through the real runtime with a short and a long stack of layers; the slope of the median
pass time over the layer count is the cost per layer pass (the median of three such slopes).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace

SHORT, LONG = 2, 6  # layer counts of the two models
SEQUENCES, CONTEXT = 8, 64


def measure_runtime_layer_pass(device: str = "cuda", quick: bool = False, schedule: str = "cgopipe") -> float:
    """Seconds per layer pass of one micro-batch on `device` through the runtime's `schedule`."""
    import torch

    from moelight.loading.presets import PRESETS
    from moelight.loading.weights import build_model
    from moelight.pipeline.pipeline_executor import PipelineExecutor
    from moelight.runtime.kv_cache import RaggedKVCache

    dtype = torch.bfloat16 if device != "cuda" or torch.cuda.is_bf16_supported() else torch.float16
    passes = 6 if quick else 20

    def pass_times(layers: int) -> list[float]:
        cfg = replace(PRESETS["tiny"], num_layers=layers)
        model = build_model(cfg, dtype, None, 0)
        cache = RaggedKVCache.allocate(cfg, [CONTEXT] * SEQUENCES, dtype)
        for j in range(layers):
            for t in cache.layer(j):
                t.zero_()
        ex = PipelineExecutor(model, schedule, device, r_w=1.0, max_batch=SEQUENCES, max_context=CONTEXT,
                              max_prompt_len=CONTEXT, max_prefill_tokens=SEQUENCES * CONTEXT)
        tokens = torch.arange(3, 3 + SEQUENCES, dtype=torch.int64)
        positions = torch.full((SEQUENCES,), CONTEXT // 2, dtype=torch.int64)
        try:
            times = []
            for _ in range(passes + 2):  # the first two warm the allocator and the kernels' caches
                t0 = time.perf_counter()
                ex.decode(cache, [(tokens, cache.offsets, positions)])
                times.append(time.perf_counter() - t0)
            return times[2:]
        finally:
            ex.close()

    slopes = []
    for _ in range(1 if quick else 3):
        short, long = statistics.median(pass_times(SHORT)), statistics.median(pass_times(LONG))
        slopes.append((long - short) / (LONG - SHORT))
    return max(0.0, statistics.median(slopes))
