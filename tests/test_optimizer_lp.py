"""The per-point LP: vectorised vertex enumeration agrees with PuLP/CBC and with a fine grid; importing
PuLP keeps nothing of its importer alive."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from optimizer.cost_model import build_point_model
from optimizer.lp import feasible, solve_grid, solve_point_pulp
from tests.test_optimizer_cases import DTYPE, random_case


@pytest.mark.parametrize("seed", range(12))
def test_enumeration_matches_pulp_and_grid(seed):
    hw, m, wl = random_case(seed)
    rng = np.random.default_rng(100 + seed)
    combos = [(0, 1), (1, 1), (1, 0), (0, 0)] if hw.has_gpu else [(0, 0)]
    for a_g, f_g in combos:
        mu, n = float(rng.integers(1, 40)), float(rng.integers(1, 8))
        pm = build_point_model(hw, m, wl, DTYPE, mu, n, a_g, f_g)
        t, x, y = (float(v) for v in solve_grid(pm))
        lp = solve_point_pulp(pm)
        # brute force over (r_w, r_c)
        xs = np.linspace(0, pm.x_max, 301)
        ys = np.linspace(0, pm.y_max, 301)
        gx, gy = np.meshgrid(xs, ys)
        ok = feasible(pm, gx, gy)
        brute = np.where(ok, pm.total_time(gx, gy), np.inf).min()
        if lp is None:
            assert not np.isfinite(t) and not np.isfinite(brute)
            continue
        assert t == pytest.approx(lp[0], rel=1e-6)
        assert t <= brute * (1 + 1e-9)
        assert brute <= t * 1.01
        assert bool(feasible(pm, np.float64(x), np.float64(y)))
        assert float(pm.total_time(x, y)) == pytest.approx(t, rel=1e-9)



def test_the_all_cpu_shortcut_equals_the_vertex_search_on_a_grid():
    """With nothing on a GPU the box is (0, 0): solve_grid skips the vertex search and must give what it
    gives, infeasible points included, over a whole (mu, n) grid of each case."""
    from optimizer.lp import enumerate_vertices

    mu, n = (a.ravel() for a in np.meshgrid(np.arange(1.0, 200.0, 7.0), np.arange(1.0, 40.0, 3.0), indexing="ij"))
    fitting = 0
    for seed in range(8):
        hw, m, wl = random_case(seed)
        pm = build_point_model(hw, m, wl, DTYPE, mu, n, 0, 0)
        fast, slow = solve_grid(pm), enumerate_vertices(pm)
        for a, b in zip(fast, slow, strict=True):
            np.testing.assert_array_equal(a, b)
        fitting += bool(np.isfinite(slow[0]).any())
    assert fitting >= 4  # the cases exercise feasible points, not only infeasible ones


_FIRST_IMPORT = """
import gc, weakref
class Caller: pass
def plan(caller):  # the frame of a first plan (an LLM's generate, its model in reach) imports the optimizer
    import optimizer
caller = Caller()
alive = weakref.ref(caller)
plan(caller)
del caller
gc.collect()
print(alive() is None)
"""


def test_the_first_import_of_pulp_keeps_no_frame_of_its_importer():
    """PuLP keeps each unavailable solver's import error; its traceback held every frame running at the
    first import (a fresh interpreter's). The errors' text stays for pulp's own message."""
    res = subprocess.run([sys.executable, "-c", _FIRST_IMPORT], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[1])
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split() == ["True"]
    from pulp.apis.cplex_api import CPLEX_PY

    if not CPLEX_PY().available():
        with pytest.raises(Exception, match="Not Available"):
            CPLEX_PY().actualSolve(None)
