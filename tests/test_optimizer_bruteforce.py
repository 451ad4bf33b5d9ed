"""The search's optimum equals a brute-force enumeration on many random small problems."""

import numpy as np
import pytest

from optimizer import InfeasibleError, plan
from optimizer.cost_model import build_point_model
from optimizer.lp import feasible
from tests.test_optimizer_cases import DTYPE, random_case

MUS = np.arange(1, 11, dtype=float)
NS = np.arange(1, 6, dtype=float)


def brute_force(hw, m, wl) -> float:
    """Max end-to-end tok/s over (mu, n_mb, A_g, F_g) and a fine (r_w, r_c) grid; 0 if nothing fits."""
    best = 0.0
    mu, n = (a.ravel()[:, None] for a in np.meshgrid(MUS, NS, indexing="ij"))
    for a_g, f_g in ([(0, 1), (1, 1), (0, 0), (1, 0)] if hw.has_gpu else [(0, 0)]):
        pm = build_point_model(hw, m, wl, DTYPE, mu, n, a_g, f_g)
        steps = 2001 if a_g == 0 else 201
        xs = np.linspace(0, pm.x_max, steps if f_g else 1)
        ys = np.linspace(0, pm.y_max, steps if a_g else 1)
        gx, gy = (a.ravel()[None, :] for a in np.meshgrid(xs, ys))
        ok = feasible(pm, gx, gy)
        thr = np.where(ok, pm.throughput(gx, gy), 0.0)
        best = max(best, float(thr.max()))
    return best


@pytest.mark.parametrize("seed", range(40))
def test_plan_equals_brute_force(seed):
    hw, m, wl = random_case(seed)
    brute = brute_force(hw, m, wl)
    try:
        res = plan(hw, m, wl, DTYPE, mu_grid=MUS, n_grid=NS)
    except InfeasibleError:
        assert brute == 0.0
        return
    assert brute > 0.0
    assert res.e2e_tok_s >= brute * (1 - 1e-9)
    assert res.e2e_tok_s <= brute * 1.005
    # the reported policy respects both memories
    assert sum(res.gpu_memory.values()) <= res.gpu_capacity * (1 + 1e-6) or not res.gpu_memory
    assert sum(res.cpu_memory.values()) <= res.cpu_capacity * (1 + 1e-6)
