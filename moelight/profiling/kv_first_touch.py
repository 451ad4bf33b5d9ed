"""The rate at which the host faults in a fresh KV cache pool, as the engine's first writes meet it.

The engine allocates a job's KV pool untouched and the kernel maps and zeroes each page when the first
K/V row lands on it. Prefill's first pass writes pages spread over the whole pool (every sequence owns its
own pages), so it pays for nearly all of it at once. In the README job on a 2-core AMX guest the prefill
pass's KV writes took 219-284 ms (10 runs) for a 327 MB pool (~1.4 GB/s); with the pool touched beforehand
they took 2-30 ms. This probe, on ordinary 4 KiB pages, measured 4.2-5.9 GB/s there; on huge pages
(host_memory.empty_huge, as the engine asks) 6-11 GB/s, while free huge pages were plentiful. The job's pool
faults slower than either (not established why: a guess is the kernel compacting memory for huge pages
after the model's weights took the free ones), so this term still undercharges there, about 3x.
"""

from __future__ import annotations

import statistics
import time

POOL_BYTES = 256 * 2**20
POOL_BYTES_QUICK = 128 * 2**20


def measure_kv_first_touch(quick: bool = False, pool_bytes: int | None = None, pools: int | None = None) -> float:
    """Bytes/s of a fresh KV pool (bench-1b's shape, ordinary pages) faulted in by one K/V row written into
    every page of every layer through the engine's cache class, as its first writes do: median of `pools`."""
    import torch

    from moelight.loading.presets import PRESETS
    from moelight.runtime.kv_cache import RaggedKVCache
    from moelight.runtime.paged_layout import PAGE_SIZE

    cfg = PRESETS["bench-1b"]
    per_slot = RaggedKVCache.bytes_needed(cfg, 1, torch.bfloat16)
    slots = max(PAGE_SIZE, (pool_bytes or (POOL_BYTES_QUICK if quick else POOL_BYTES)) // per_slot)
    shape = (cfg.num_kv_heads, slots, cfg.head_dim)
    at = torch.arange(0, slots, PAGE_SIZE, dtype=torch.int64)
    row = torch.ones(len(at), cfg.num_kv_heads, cfg.head_dim, dtype=torch.bfloat16)
    none = torch.zeros(0, dtype=torch.int64)
    rates = []
    for _ in range(pools or (1 if quick else 3)):
        cache = RaggedKVCache([torch.empty(shape, dtype=torch.bfloat16) for _ in range(cfg.num_layers)],
                              [torch.empty(shape, dtype=torch.bfloat16) for _ in range(cfg.num_layers)], none, none)
        t0 = time.perf_counter()
        for j in range(cfg.num_layers):
            cache.write(j, row, row, at)
        rates.append(RaggedKVCache.bytes_needed(cfg, slots, torch.bfloat16) / max(1e-9, time.perf_counter() - t0))
        cache = None  # unmapped before the next pool is allocated
    return statistics.median(rates)
