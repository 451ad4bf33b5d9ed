"""Cache sweeps drawn: hit rate and median per-token latency against cache size, one line per policy
(one figure per batch size). matplotlib is imported only here, on demand."""

from __future__ import annotations

from pathlib import Path


def plot_cache_sweep(results: list, total_experts: int, out_dir: str | Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for b in sorted({r.batch for r in results}):
        fig, (hit, lat) = plt.subplots(1, 2, figsize=(11, 4))
        for name in dict.fromkeys(r.policy for r in results):
            rs = sorted((r for r in results if r.batch == b and r.policy == name), key=lambda r: r.slots)
            share = [100 * r.slots / total_experts for r in rs]
            hit.plot(share, [100 * r.stats.hit_rate for r in rs], marker="o", label=name)
            lat.plot(share, [r.percentiles()["p50"] for r in rs], marker="o", label=name)
        hit.set(xlabel="cache size (% of experts)", ylabel="hit rate (%)", title=f"hit rate, batch {b}")
        lat.set(xlabel="cache size (% of experts)", ylabel="per-token latency p50 (ms)",
                title=f"time per output token, batch {b}")
        for ax in (hit, lat):
            ax.grid(alpha=0.3)
            ax.legend()
        fig.tight_layout()
        path = out / f"cache_sweep_batch{b}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths
