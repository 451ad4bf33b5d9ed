"""Whether a plan's full memory limits it: the same search neighbourhood with that memory doubled.

A level can be full without limiting anything: the LP fills what the rest leaves with resident
experts (r_w) even when the link is not the binding roof, so a full GPU alone says nothing. A level
limits the plan when more of it would predict faster: the chosen (mu, n_mb) and its neighbours on the
grid (the next mu, one more micro-batch), solved again with twice that level's capacity. A handful of
single-point LPs, not a second search.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from optimizer.cost_model import PointModel, build_point_model
from optimizer.lp import solve_grid

FULL = 0.99  # a level this full may be what stops the plan


def level_full(parts: dict[str, float], cap: float) -> bool:
    return bool(parts) and cap > 0 and sum(parts.values()) >= FULL * cap


def limiting_levels(hw, model, workload, dtype: str, pm: PointModel, tok_s: float, mus: np.ndarray,
                    ns: np.ndarray, alpha: float, full: dict[str, bool]) -> list[str]:
    """The full levels ('GPU', 'CPU') whose doubled capacity predicts more than the plan's end-to-end
    `tok_s` near its point `pm` (a one-point model)."""
    mu, n = float(np.ravel(pm.mu)[0]), float(np.ravel(pm.n_mb)[0])
    up_mu = mus[mus > mu][:1]
    up_n = ns[ns > n][:1]
    cand = [(mu, n)] + [(float(m), n) for m in up_mu] + [(mu, float(k)) for k in up_n]
    grid = build_point_model(hw, model, workload, dtype, np.array([c[0] for c in cand]),
                             np.array([c[1] for c in cand]), pm.a_g, pm.f_g, alpha)
    out = []
    for level, key in (("GPU", "gpu_cap"), ("CPU", "cpu_cap")):
        if not full.get(level):
            continue
        t, _, _ = solve_grid(replace(grid, **{key: 2 * getattr(grid, key)}))
        ok = np.isfinite(t)
        if ok.any() and float((grid.batch[ok] * grid.gen_len / t[ok]).max()) > tok_s * (1 + 1e-3):
            out.append(level)
    return out
