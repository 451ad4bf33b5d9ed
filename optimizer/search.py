"""Policy search: an exact outer loop over the integer grid with an LP per point.

For every placement (A_g, F_g) allowed by the policy family and every (mu, n_mb) on the
grid, the best (r_w, r_c) is an LP (see optimizer.lp); all LPs of the grid are solved
exactly at once by vertex enumeration, the point of highest predicted end-to-end
throughput wins, and that point's LP is solved again with PuLP/CBC, which supplies the
returned r_w, r_c (and must agree with the enumeration). A cheap lower bound of each point's LP
(optimizer.lp.time_lower_bound) orders the points: the most promising are solved first, and
points whose bound cannot reach the best throughput found are not solved at all. The optimum is
therefore exact over the grid, not a heuristic; the grid is dense where policies live (every mu up to 32,
every 4th to 1024, every 16th to 4096; every n_mb up to 128).
"""

from __future__ import annotations

import time

import numpy as np

from hrm.dtypes import dtype_bytes
from hrm.hardware import HardwareSpec
from hrm.model import ModelSpec
from hrm.workload import WorkloadSpec
from optimizer.cost_model import ALPHA, PointModel, binding_roof, build_point_model
from optimizer.explain import explain, placement_key
from optimizer.lp import feasible, maybe_feasible, solve_grid, solve_point_pulp, time_lower_bound
from optimizer.memory_limits import level_full, limiting_levels
from optimizer.policy import InfeasibleError, PlanResult, Policy, size_text

# (A_g, F_g) placements per policy family.
FAMILIES: dict[str, list[tuple[int, int]]] = {
    "moelight": [(0, 1), (1, 1), (0, 0), (1, 0)],  # the paper's whole search space
    "cgopipe": [(0, 1)],  # CPU attention, GPU FFN with paged weights
    "flexgen": [(1, 1)],  # GPU attention, KV of each micro-batch moved to the GPU
    "cpu": [(0, 0)],  # everything on the CPU
}

GiB = 2.0**30


def default_mu_grid(max_mu: int = 4096) -> np.ndarray:
    g = np.concatenate([np.arange(1, 33), np.arange(36, 1025, 4), np.arange(1040, 4097, 16)])
    return g[g <= max_mu].astype(float)


def default_n_grid(max_n: int = 128) -> np.ndarray:
    return np.arange(1, max_n + 1, dtype=float)


def _placements(hw: HardwareSpec, family: str) -> list[tuple[int, int]]:
    if family not in FAMILIES:
        raise ValueError(f"unknown policy family {family!r}; valid: {', '.join(FAMILIES)}")
    combos = FAMILIES[family]
    if not hw.has_gpu:
        combos = [c for c in combos if c == (0, 0)]
        if not combos:
            raise ValueError(f"policy family {family!r} needs a GPU; hardware {hw.name!r} has none")
    return combos


def plan(hw: HardwareSpec, model: ModelSpec, workload: WorkloadSpec, dtype: str = "bfloat16",
         gpus: int | None = None, family: str = "moelight", alpha: float = ALPHA,
         mu_grid=None, n_grid=None, verify_with_pulp: bool = True) -> PlanResult:
    """Best policy for `model` on `hw` for `workload` (highest predicted end-to-end tok/s).

    gpus: override the GPU count (tensor parallelism; 0 = ignore the GPU).
    Raises InfeasibleError when nothing fits, naming the memory and the shortfall, and ValueError
    when the GPU count does not divide the model's heads, KV heads or expert width.
    """
    t0 = time.perf_counter()
    if gpus is not None:
        hw = hw.with_gpus(gpus)
    if hw.has_gpu and family != "cpu":
        model.check_tensor_parallel(hw.gpu_count)  # ValueError naming what the GPU count does not divide
    mus = np.asarray(default_mu_grid() if mu_grid is None else mu_grid, float)
    ns = np.asarray(default_n_grid() if n_grid is None else n_grid, float)
    best = None  # (thr, -N, mu, combo, pm, flat index, x, y)
    points = 0
    placements: dict[str, float | None] = {}
    for a_g, f_g in _placements(hw, family):
        placements[placement_key(bool(a_g), bool(f_g))] = None
        mu_f, n_f = (a.ravel() for a in np.meshgrid(mus, ns, indexing="ij"))
        grid = build_point_model(hw, model, workload, dtype, mu_f, n_f, a_g, f_g, alpha)
        keep = maybe_feasible(grid)
        points += mu_f.size
        if not keep.any():
            continue
        pm = grid.take(np.flatnonzero(keep))
        t, x, y = _solve_pruned(pm)
        if not np.isfinite(t).any():
            continue
        thr = np.where(np.isfinite(t), pm.batch * workload.gen_len / np.where(np.isfinite(t), t, 1.0), -1.0)
        top = thr.max()
        placements[placement_key(bool(a_g), bool(f_g))] = float(top)
        cand = np.flatnonzero(thr.reshape(-1) >= top * (1 - _TIE))
        # ties: the smallest batch, then the largest micro-batch (fewer kernel launches)
        key = np.lexsort((-pm.mu.reshape(-1)[cand], pm.batch.reshape(-1)[cand]))
        i = int(cand[key[0]])
        entry = (float(top), i, (a_g, f_g), pm, float(x.reshape(-1)[i]), float(y.reshape(-1)[i]))
        if best is None or entry[0] > best[0] * (1 + 1e-6) or (
            entry[0] >= best[0] * (1 - 1e-6) and pm.batch.reshape(-1)[i] < best[3].batch.reshape(-1)[best[1]]
        ):
            best = entry
    if best is None:
        raise InfeasibleError(_infeasible_message(hw, model, workload, dtype, family, alpha))
    _, i, (a_g, f_g), pm_grid, x, y = best
    mu, n = int(pm_grid.mu.reshape(-1)[i]), int(pm_grid.n_mb.reshape(-1)[i])
    pm = build_point_model(hw, model, workload, dtype, mu, n, a_g, f_g, alpha)
    if verify_with_pulp:
        sol = solve_point_pulp(pm)
        if sol is not None:
            t_lp, x_lp, y_lp = sol
            t_enum = float(pm.total_time(x, y))
            if t_lp <= t_enum * (1 + 1e-6) and feasible_point(pm, x_lp, y_lp):
                x, y = x_lp, y_lp
    policy = Policy(mu * n, mu, n, bool(a_g), bool(f_g), float(x), float(y), dtype)
    full = {"GPU": level_full({k: float(a.at(x, y)) for k, a in pm.gpu_mem.items()}, pm.gpu_cap),
            "CPU": level_full({k: float(a.at(x, y)) for k, a in pm.cpu_mem.items()}, pm.cpu_cap)}
    tok_s = mu * n * workload.gen_len / float(pm.total_time(x, y))
    limits = limiting_levels(hw, model, workload, dtype, pm, tok_s, mus, ns, alpha, full)
    result = summarize(pm, policy, hw, model, workload, family, placements, limits, int(mus.max()))
    result.solve_seconds = time.perf_counter() - t0
    result.grid_points = points
    return result


_FIRST = 2048  # points solved before pruning: the most promising by their bound
_TIE = 1e-6  # throughputs this close count as tied (the smallest batch wins)


def _solve_pruned(pm: PointModel) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """solve_grid where it can matter: the LP's lower bound of time gives each point's highest possible
    throughput; the most promising points are solved first, then only those whose bound reaches the
    best throughput found (less the tie tolerance). Pruned points report inf: none of them could be
    the best or tie with it, so the search's answer is the full grid's."""
    if pm.nothing_on_gpu or pm.mu.size <= _FIRST:  # (the all-CPU placement has no LP to bound)
        return solve_grid(pm)
    lb = time_lower_bound(pm)
    bound = np.where(np.isfinite(lb), pm.batch * pm.gen_len / np.where(np.isfinite(lb), lb, 1.0), -1.0)
    order = np.argsort(-bound, kind="stable")
    t, x, y = np.full(pm.mu.shape, np.inf), np.zeros(pm.mu.shape), np.zeros(pm.mu.shape)
    best = -1.0
    for part in (order[:_FIRST], order[_FIRST:]):
        part = part[bound[part] >= best * (1 - 2 * _TIE)]
        if part.size == 0:
            continue
        sub = pm.take(part)
        t[part], x[part], y[part] = solve_grid(sub)
        done = np.isfinite(t[part])
        if done.any():
            best = max(best, float((sub.batch[done] * pm.gen_len / t[part][done]).max()))
    return t, x, y


def feasible_point(pm: PointModel, x: float, y: float) -> bool:
    return bool(np.all(feasible(pm, np.float64(x), np.float64(y), rtol=1e-7)))


def evaluate_policy(hw: HardwareSpec, model: ModelSpec, workload: WorkloadSpec, policy: Policy,
                    alpha: float = ALPHA, family: str = "given") -> PlanResult:
    """HRM prediction for a given policy (no search); memory is reported, not enforced."""
    pm = build_point_model(hw, model, workload, policy.dtype, policy.mu, policy.n_mb, policy.A_g,
                           policy.F_g, alpha)
    return summarize(pm, policy, hw, model, workload, family)


def summarize(pm: PointModel, policy: Policy, hw: HardwareSpec, model: ModelSpec,
              workload: WorkloadSpec, family: str, placements: dict | None = None,
              memory_limits: list[str] | None = None, mu_cap: int = 0) -> PlanResult:
    """The PlanResult of `policy` at `pm`; memory_limits (the full levels more of which would predict
    faster, None: not asked) and mu_cap (the top of the micro-batch grid searched) feed its reasons."""
    x, y = policy.r_w, policy.r_c
    lt = {k: float(v) for k, v in pm.layer_times(x, y).items()}
    binding = binding_roof(lt)
    t_pre = float(pm.prefill_time(x, y))
    t_step = float(pm.decode_step_time(x, y))
    n, g = policy.batch_size, workload.gen_len
    total = t_pre + (g - 1) * t_step
    res = PlanResult(
        policy=policy, hardware=hw.name + (f" x{hw.gpu_count} GPU" if hw.gpu_count > 1 else ""),
        model=model.name, workload=workload.to_dict(), family=family,
        prefill_tok_s=n * workload.effective_prompt / t_pre, decode_tok_s=n / t_step,
        e2e_tok_s=n * g / total, prefill_time=t_pre, decode_step_time=t_step, layer_times=lt,
        binding=binding,
        gpu_memory={k: float(a.at(x, y)) for k, a in pm.gpu_mem.items()},
        cpu_memory={k: float(a.at(x, y)) for k, a in pm.cpu_mem.items()},
        gpu_capacity=pm.gpu_cap, cpu_capacity=pm.cpu_cap, placements=dict(placements or {}),
        memory_limits=memory_limits, mu_cap=mu_cap,
    )
    res.reason = explain(res, hw, model, workload)
    return res


def _infeasible_message(hw, model, workload, dtype, family, alpha) -> str:
    """Smallest shortfall over placements at the smallest batch (mu = N = 1)."""
    best = None
    xs = np.linspace(0, 1, 101)
    for a_g, f_g in _placements(hw, family):
        pm = build_point_model(hw, model, workload, dtype, 1.0, 1.0, a_g, f_g, alpha)
        gx, gy = np.meshgrid(xs * pm.x_max, xs * pm.y_max)
        g_over = np.maximum(0.0, pm.gpu_total().at(gx, gy) - pm.gpu_cap) if pm.gpu_mem else 0 * gx
        c_over = np.maximum(0.0, pm.cpu_total().at(gx, gy) - pm.cpu_cap)
        j = np.unravel_index(np.argmin(g_over + c_over), gx.shape)
        cand = (float(g_over[j] + c_over[j]), float(g_over[j]), float(c_over[j]), a_g, f_g,
                float(pm.gpu_total().at(gx[j], gy[j])), float(pm.cpu_total().at(gx[j], gy[j])), pm)
        if best is None or cand[0] < best[0]:
            best = cand
    _, g_over, c_over, a_g, f_g, g_need, c_need, pm = best
    where = f"attention on {'GPU' if a_g else 'CPU'}, FFN on {'GPU' if f_g else 'CPU'}"
    msgs = []
    if g_over > 0:
        msgs.append(f"GPU memory short by {size_text(g_over)} (needs {size_text(g_need)}, "
                    f"{size_text(pm.gpu_cap)} usable = "
                    f"{alpha:.0%} of {size_text(hw.gpu_total().memory_bytes)})")
    if c_over > 0:
        msgs.append(f"CPU memory short by {size_text(c_over)} (needs {size_text(c_need)}, "
                    f"{size_text(pm.cpu_cap)} usable = "
                    f"{alpha:.0%} of {size_text(hw.cpu.memory_bytes)})")
    b = dtype_bytes(dtype)
    sparse = model.num_layers - model.num_dense_layers
    weights = (model.non_expert_params() * b
               + sparse * model.num_experts * model.expert_params() * model.expert_weight_bytes(b))
    usable = (pm.gpu_cap if pm.gpu_mem else 0.0) + pm.cpu_cap
    why = (f"; the weights alone take {size_text(weights)} in {dtype}, beyond the {size_text(usable)} usable "
           "in GPU and CPU memory together" if weights > usable else "")
    return (f"no policy fits {model.name} on {hw.name} even at batch size 1 ({where}): "
            + "; ".join(msgs) + why)
