"""Dummy routed-expert weights drawn fast: uniform 16-bit levels, 4 to a generator draw.

Why: `uniform_` on a bf16 tensor draws one float per element, ~4.5 ns each on this project's 2-core AMX
host: bench-1b's 704 M expert weights took ~3 s of the README job's ~6 s load. Random int16 levels drawn as
int64 and scaled into the tensor in chunks give the same distribution at 16-bit precision (what a bf16 or
fp16 weight holds) in under half the time. The routers keep `uniform_`: they decide the routing.
"""

from __future__ import annotations

import torch

_CHUNK = 1 << 22  # elements per draw: a small int16 buffer, reused


@torch.no_grad()
def uniform_levels_(t: torch.Tensor, bound: float, gen: torch.Generator) -> torch.Tensor:
    """Fill contiguous `t` with values uniform in [-bound, bound), on 65536 levels; deterministic in `gen`."""
    flat = t.view(-1)
    buf = torch.empty(min(_CHUNK, flat.numel()), dtype=torch.int16)
    for start in range(0, flat.numel(), _CHUNK):
        n = min(_CHUNK, flat.numel() - start)
        levels = buf[:n]
        if n % 4 == 0:  # four int16 levels from one 64-bit draw
            levels.view(torch.int64).random_(-2**63, 2**63 - 1, generator=gen)
        else:
            levels.random_(-2**15, 2**15, generator=gen)
        torch.mul(levels, bound / 2**15, out=flat[start:start + n])
    return t
