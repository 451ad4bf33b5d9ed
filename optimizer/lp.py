"""The per-point LP over (r_w, r_c): exact vectorised vertex enumeration, and PuLP/CBC.

At fixed integers (mu, n_mb, A_g, F_g) the end-to-end time is a convex piecewise-linear
function of x = r_w, y = r_c (sums of maxima of affine pieces) and the feasible set is a
polygon (box, GPU memory, CPU memory). Such an LP attains its optimum at a vertex of the
arrangement formed by the constraint lines and the lines where two pieces of one max
are equal (on each cell of that arrangement the objective is linear). So the exact
optimum is the best feasible pairwise intersection of those lines; evaluating all of
them for every grid point at once is what makes the exact outer loop take milliseconds.

`solve_point_pulp` states the same LP for PuLP (CBC) with epigraph variables; the search
re-solves its chosen point with it, and the tests check both agree everywhere.
"""

from __future__ import annotations

import warnings
from itertools import combinations

import numpy as np

from optimizer.cost_model import Affine, PointModel
from optimizer.pulp_solvers import pulp

_TOL = 1e-9


Line = tuple[np.ndarray, np.ndarray, np.ndarray]  # a + bx * x + by * y = 0 at every grid point


def _edges(pm: PointModel) -> list[Line]:
    """The feasible polygon's edge lines: the box, GPU memory (where the GPU holds anything), CPU memory."""
    shape = np.shape(pm.mu)
    one, zero = np.ones(shape), np.zeros(shape)
    lines = [(zero, one, zero), (-pm.x_max * one, one, zero), (zero, zero, one), (-pm.y_max * one, zero, one)]
    gpu, cpu = pm.gpu_total(), pm.cpu_total()
    if pm.gpu_mem:
        lines.append((gpu.c0 - pm.gpu_cap, gpu.cx, gpu.cy))
    lines.append((cpu.c0 - pm.cpu_cap, cpu.cx, cpu.cy))
    return lines


def _meet(l1: Line, l2: Line) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Where two lines cross at each grid point: (not parallel, x, y)."""
    (a1, bx1, by1), (a2, bx2, by2) = l1, l2
    det = bx1 * by2 - bx2 * by1
    ok = np.abs(det) > 1e-12
    with np.errstate(divide="ignore", invalid="ignore"):
        x = np.where(ok, (-a1 * by2 + a2 * by1) / np.where(ok, det, 1.0), 0.0)
        y = np.where(ok, (-bx1 * a2 + bx2 * a1) / np.where(ok, det, 1.0), 0.0)
    return ok, x, y


def _lines(pm: PointModel) -> list[Line]:
    """Lines whose pairwise intersections contain every LP vertex: the polygon's edges and, for each
    max term, where two of its pieces are equal."""
    lines = _edges(pm)
    zero = np.zeros(np.shape(pm.mu))
    const = Affine(pm.compute + zero, zero, zero)
    pre_const = Affine(pm.pre_comp, zero, zero)
    for pieces in ((*pm.decode_roofs, const), (*pm.prefill_roofs, pre_const)):
        for p, q in combinations(pieces, 2):
            lines.append((p.c0 - q.c0, p.cx - q.cx, p.cy - q.cy))
    return lines


def feasible(pm: PointModel, x, y, rtol: float = 1e-9, totals=None) -> np.ndarray:
    """Memory and box feasibility of (x, y) at every grid point."""
    gpu, cpu = totals or (pm.gpu_total(), pm.cpu_total())
    ok = (x >= -_TOL) & (x <= pm.x_max + _TOL) & (y >= -_TOL) & (y <= pm.y_max + _TOL)
    if pm.gpu_mem:
        ok = ok & (gpu.at(x, y) <= pm.gpu_cap * (1 + rtol))
    ok = ok & (cpu.at(x, y) <= pm.cpu_cap * (1 + rtol))
    return ok


def _min_over_box(a: Affine, x_max: float, y_max: float) -> np.ndarray:
    """Smallest value of an affine function over the box [0, x_max] x [0, y_max]."""
    return a.c0 + np.minimum(a.cx * x_max, 0.0) + np.minimum(a.cy * y_max, 0.0)


def maybe_feasible(pm: PointModel) -> np.ndarray:
    """Necessary condition for feasibility: each memory fits at its own best corner.

    Points failing it are infeasible for sure, so skipping them keeps the search exact.
    """
    ok = _min_over_box(pm.cpu_total(), pm.x_max, pm.y_max) <= pm.cpu_cap * (1 + 1e-9)
    if pm.gpu_mem:
        ok &= _min_over_box(pm.gpu_total(), pm.x_max, pm.y_max) <= pm.gpu_cap * (1 + 1e-9)
    return ok


def solve_grid(pm: PointModel) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Exact LP optimum at every grid point: (min end-to-end time or inf, r_w, r_c). With nothing on a
    GPU (a CPU-only host, or the all-CPU placement) the box is the point (0, 0): no vertices to search."""
    if pm.nothing_on_gpu:
        zero = np.zeros(np.shape(pm.mu))
        return np.where(feasible(pm, zero, zero), pm.total_time(zero, zero), np.inf), zero, zero.copy()
    return enumerate_vertices(pm)


def enumerate_vertices(pm: PointModel) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """solve_grid by the best feasible pairwise intersection of the arrangement's lines."""
    lines = _lines(pm)
    totals = (pm.gpu_total(), pm.cpu_total())
    best_t = np.full(pm.mu.shape, np.inf)
    best_x = np.zeros(pm.mu.shape)
    best_y = np.zeros(pm.mu.shape)
    for l1, l2 in combinations(lines, 2):
        ok, x, y = _meet(l1, l2)
        x = np.where(np.abs(x) < _TOL, 0.0, x)
        y = np.where(np.abs(y) < _TOL, 0.0, y)
        ok &= feasible(pm, x, y, totals=totals)
        if not ok.any():
            continue
        x, y = np.clip(x, 0.0, pm.x_max), np.clip(y, 0.0, pm.y_max)
        t = np.where(ok, pm.total_time(x, y), np.inf)
        better = t < best_t * (1 - 1e-12)
        best_t = np.where(better, t, best_t)
        best_x = np.where(better, x, best_x)
        best_y = np.where(better, y, best_y)
    return best_t, best_x, best_y


def time_lower_bound(pm: PointModel) -> np.ndarray:
    """A lower bound of every grid point's LP optimum (inf where nothing is feasible), far cheaper
    than the LP: each max term's pieces are minimised one by one over the feasible polygon (box and
    memory), whose minimum of an affine piece lies at one of the polygon's vertices. The max of those
    minima bounds the minimum of the max; the search prunes points this bound already rules out."""
    totals = (pm.gpu_total(), pm.cpu_total())
    vertices = []
    for l1, l2 in combinations(_edges(pm), 2):
        ok, x, y = _meet(l1, l2)
        ok &= feasible(pm, x, y, totals=totals)
        vertices.append((ok, np.clip(x, 0.0, pm.x_max), np.clip(y, 0.0, pm.y_max)))

    def least(piece: Affine) -> np.ndarray:  # min of the piece over the polygon's vertices (inf: none)
        return np.min([np.where(ok, piece.at(x, y), np.inf) for ok, x, y in vertices], axis=0)

    layer = np.maximum(pm.compute, np.max([least(a) for a in pm.decode_roofs], axis=0))
    pre_layer = np.maximum(pm.pre_comp, np.max([least(a) for a in pm.prefill_roofs], axis=0))
    decode = (pm.gen_len - 1) * pm.step_time_of(layer) if pm.gen_len > 1 else 0.0  # no step: no inf * 0
    return pm.prefill_time_of(pre_layer) + decode


def _var(prob, name: str, lo: float, hi: float | None = None):
    if hasattr(prob, "add_variable"):  # PuLP >= 3.3
        return prob.add_variable(name, lo, hi)
    return pulp.LpVariable(name, lo, hi)


def _scalar(a, i):
    return float(np.asarray(a).reshape(-1)[i]) if np.ndim(a) else float(a)


def solve_point_pulp(pm: PointModel, index: int = 0, msg: bool = False) -> tuple[float, float, float] | None:
    """Solve the LP at grid point `index` with PuLP/CBC; (time, r_w, r_c), or None if infeasible."""
    s = lambda a: _scalar(a, index)  # noqa: E731
    sa = lambda a: (s(a.c0), s(a.cx), s(a.cy))  # noqa: E731
    prob = pulp.LpProblem("moelight_point", pulp.LpMinimize)
    x = _var(prob, "r_w", 0, pm.x_max)
    y = _var(prob, "r_c", 0, pm.y_max)
    t_dec = _var(prob, "T_layer", 0)
    t_pre = _var(prob, "T_prefill_layer", 0)
    L, steps = pm.num_layers, pm.gen_len - 1
    prob += L * t_pre + steps * L * t_dec
    for a in pm.decode_roofs:
        c0, cx, cy = sa(a)
        prob += t_dec >= c0 + cx * x + cy * y
    prob += t_dec >= s(pm.compute)
    for a in pm.prefill_roofs:
        c0, cx, cy = sa(a)
        prob += t_pre >= c0 + cx * x + cy * y
    prob += t_pre >= s(pm.pre_comp)
    gib = 2.0**30  # memory in GiB keeps the coefficients well scaled
    if pm.gpu_mem:
        c0, cx, cy = sa(pm.gpu_total())
        prob += (c0 + cx * x + cy * y) / gib <= pm.gpu_cap / gib
    c0, cx, cy = sa(pm.cpu_total())
    prob += (c0 + cx * x + cy * y) / gib <= pm.cpu_cap / gib
    with warnings.catch_warnings():  # PuLP 3.x deprecation notices about its 4.0 API
        warnings.simplefilter("ignore", DeprecationWarning)
        status = prob.solve(pulp.PULP_CBC_CMD(msg=msg))
    if pulp.LpStatus[status] != "Optimal":
        return None
    xv, yv = float(x.value() or 0.0), float(y.value() or 0.0)
    xv, yv = min(max(xv, 0.0), pm.x_max), min(max(yv, 0.0), pm.y_max)
    total = L * (t_pre.value() or 0.0) + steps * L * (t_dec.value() or 0.0)
    return total + s(pm.head_pre) + steps * s(pm.head_dec), xv, yv
