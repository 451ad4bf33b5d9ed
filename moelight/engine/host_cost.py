"""The host's work per sequence in a decode step, outside the layers: the engine's scheduling, block
tables, sampling, stop checks and result bookkeeping, all Python and small ops per sequence.

It is paid on the host whatever runs the layers, serially with the step (the next step needs the
sampled tokens), and it grows with the batch: at a few hundred sequences on a GPU it can take longer
than the GPU's work. A model without layers (an embedding and a small LM head, so compute is ~0)
decodes two batch sizes through the real engine; the slope of the median step time over the batch
size is the cost per sequence (the median of three such slopes: a busy host's noise).

`moelight profile` sits below the engine, so the engine lends it this probe
(profiling/sequence_step.py) when the package is imported.
"""

from __future__ import annotations

import random
import statistics
from dataclasses import replace

from moelight.profiling import sequence_step

SMALL, LARGE = 32, 256  # batch sizes of the two runs


def measure_sequence_step(quick: bool = False) -> float:
    """Seconds per sequence per decode step (> 0: a measured profile is told from an older one by it)."""
    import torch
    from torch import nn

    from moelight.engine.generation import Engine, GenerationStats
    from moelight.loading.presets import PRESETS
    from moelight.loading.weights import build_model
    from moelight.sampling.params import SamplingParams

    steps = 8 if quick else 24
    cfg = replace(PRESETS["tiny"], num_layers=1, num_experts=8, top_k=2, vocab_size=512)
    model = build_model(cfg, torch.float32, None, 0)  # float32: its LM head is a fast GEMM on every host
    model.layers = nn.ModuleList()  # the engine's work alone: no layer runs
    rng = random.Random(0)

    def median_step(batch: int) -> float:
        # one-token prompts: without layers no pass picks each prompt's last position
        prompts = [[rng.randrange(3, cfg.vocab_size)] for _ in range(batch)]
        params = [SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)] * batch
        stats = GenerationStats()
        Engine(model, (), 4096).generate(prompts, params, list(range(batch)), batch, batch, stats=stats)
        return statistics.median(stats.step_seconds)

    median_step(SMALL)  # warm-up: first calls pay for allocations and lazy imports
    slopes = [(median_step(LARGE) - median_step(SMALL)) / (LARGE - SMALL) for _ in range(3)]
    return max(1e-9, statistics.median(slopes))


sequence_step.register(measure_sequence_step)
