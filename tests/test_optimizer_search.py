"""Search properties: memory limits, monotonicity, CPU-only hosts, errors, families, TP, JSON."""

import dataclasses
import re

import numpy as np
import pytest

from hrm import WorkloadSpec, get_hardware, get_model
from hrm.hardware import HardwareSpec, Level, Link
from optimizer import InfeasibleError, Policy, evaluate_policy, plan
from tests.test_optimizer_cases import DTYPE, random_case

MUS = np.arange(1, 13, dtype=float)
NS = np.arange(1, 7, dtype=float)
MIX = get_model("mixtral-8x7b")
MTBENCH = WorkloadSpec(77, 128, 418)


def _plan(hw, m, wl, **kw):
    return plan(hw, m, wl, DTYPE, mu_grid=MUS, n_grid=NS, **kw)


def _scale_level(lvl: Level, mem=1.0, bw=1.0) -> Level:
    return dataclasses.replace(lvl, memory_bytes=lvl.memory_bytes * mem, bandwidth=lvl.bandwidth * bw)


@pytest.mark.parametrize("seed", range(40, 52))
def test_more_resources_never_lower_throughput(seed):
    hw, m, wl = random_case(seed)
    try:
        base = _plan(hw, m, wl).e2e_tok_s
    except InfeasibleError:
        base = 0.0
    variants = [dataclasses.replace(hw, cpu=_scale_level(hw.cpu, mem=1.5))]
    if hw.has_gpu:
        variants.append(dataclasses.replace(hw, gpu=_scale_level(hw.gpu, mem=1.5)))
        variants.append(dataclasses.replace(hw, link=Link(hw.link.h2d * 2, hw.link.d2h * 2)))
    for v in variants:
        assert _plan(v, m, wl).e2e_tok_s >= base * (1 - 1e-6)  # within the LP solver's tolerance


def test_more_memory_and_link_on_mixtral_presets():
    base = plan(get_hardware("s1"), MIX, MTBENCH, "float16")
    s1 = get_hardware("s1")
    more_gpu = dataclasses.replace(s1, gpu=_scale_level(s1.gpu, mem=1.5))
    more_cpu = dataclasses.replace(s1, cpu=_scale_level(s1.cpu, mem=1.5))
    faster = dataclasses.replace(s1, link=Link(s1.link.h2d * 2, s1.link.d2h * 2))
    for hw in (more_gpu, faster):  # the plan is bound by GPU memory (a prefill pass's activations) and the link
        assert plan(hw, MIX, MTBENCH, "float16").e2e_tok_s > base.e2e_tok_s
    assert plan(more_cpu, MIX, MTBENCH, "float16").e2e_tok_s >= base.e2e_tok_s * (1 - 1e-6)


@pytest.mark.parametrize("name", ["s1", "s2", "s7"])
def test_memory_never_exceeded_on_presets(name):
    m = get_model("mixtral-8x22b") if name == "s7" else MIX
    res = plan(get_hardware(name), m, MTBENCH, "float16")
    assert 0 < sum(res.gpu_memory.values()) <= res.gpu_capacity * (1 + 1e-6)
    assert 0 < sum(res.cpu_memory.values()) <= res.cpu_capacity * (1 + 1e-6)
    assert res.policy.batch_size == res.policy.micro_batch_size * res.policy.num_micro_batches


def test_paper_finding_cpu_attention_gpu_ffn_small_rw():
    for name in ("s1", "s2"):
        p = plan(get_hardware(name), MIX, MTBENCH, "float16").policy
        assert (p.A_g, p.F_g) == (0, 1)
        assert 0.0 <= p.r_w < 0.3 and p.r_c == 0.0


def test_cpu_only_host_gets_all_cpu_policy():
    hw = get_hardware("cpu-server")
    res = plan(hw, MIX, MTBENCH, "bfloat16")
    p = res.policy
    assert (p.A_g, p.F_g, p.r_w, p.r_c) == (0, 0, 0.0, 0.0)
    assert res.gpu_memory == {} and res.binding == "cpu"
    # the same answer when a GPU host is told to use no GPU
    p0 = plan(get_hardware("s1"), MIX, MTBENCH, "bfloat16", gpus=0).policy
    assert (p0.A_g, p0.F_g) == (0, 0)
    # N chosen for CPU throughput: the plan beats a batch of one micro-batch of 1
    one = evaluate_policy(hw, MIX, MTBENCH, Policy(1, 1, 1, False, False, 0.0, 0.0, "bfloat16"))
    assert res.e2e_tok_s > 10 * one.e2e_tok_s
    with pytest.raises(ValueError, match="needs a GPU"):
        plan(hw, MIX, MTBENCH, family="flexgen")


def test_infeasible_names_the_memory():
    small = HardwareSpec("small", Level("cpu", 40 * 2**30, 1e11, {"bfloat16": 1e12}))
    with pytest.raises(InfeasibleError, match=r"CPU memory short by \d+\.\d+ GiB"):
        plan(small, MIX, MTBENCH)
    tiny_gpu = dataclasses.replace(get_hardware("s1"), gpu=Level("g", 2**30, 3e11, {"bfloat16": 1e13}))
    with pytest.raises(InfeasibleError, match=r"GPU memory short by"):
        plan(tiny_gpu, MIX, MTBENCH, family="cgopipe")
    # with the whole search space the CPU can still take everything
    assert plan(tiny_gpu, MIX, MTBENCH).policy.F_g == 0


def test_a_policy_too_big_for_a_tiny_gpu_says_how_much_in_mib():
    """A few-MiB device's shortfall in MiB, as the planner's own error gives it, not '0.00 GiB'."""
    tiny = dataclasses.replace(get_hardware("s1"), gpu=Level("g", 2 * 2**20, 3e11, {"bfloat16": 1e13}))
    problems = evaluate_policy(tiny, MIX, MTBENCH, Policy(8, 4, 2, False, True, 1.0, 0.0)).memory_problems()
    assert len(problems) == 1 and "0.00 GiB" not in problems[0]
    assert re.search(r"GPU memory: needs \d+\.\d+ GiB of 1\.80 MiB usable, short by \d+\.\d+ GiB \(\w+ \d", problems[0])


def test_flexgen_family_and_comparison():
    hw = get_hardware("s1")
    fg = plan(hw, MIX, MTBENCH, "float16", family="flexgen")
    ml = plan(hw, MIX, MTBENCH, "float16", family="moelight")
    assert (fg.policy.A_g, fg.policy.F_g) == (1, 1)
    assert ml.e2e_tok_s >= fg.e2e_tok_s
    # FlexGen moves KV over the link: its link time exceeds what the weights alone need
    w_only = (1 - fg.policy.r_w) * MIX.layer_expert_params() * 2 / hw.link_total().h2d
    assert fg.layer_times["T_h2d"] > w_only


def test_tensor_parallel_scales_resources():
    m = get_model("mixtral-8x22b")
    two = plan(get_hardware("s7"), m, MTBENCH, "float16", gpus=2)
    four = plan(get_hardware("s7"), m, MTBENCH, "float16")
    assert four.gpu_capacity == pytest.approx(2 * two.gpu_capacity)
    assert four.e2e_tok_s > two.e2e_tok_s


def test_policy_and_result_json_roundtrip(tmp_path):
    res = plan(get_hardware("s2"), MIX, MTBENCH, "bfloat16")
    p = res.policy.save(tmp_path / "policy.json")
    assert Policy.load(p) == res.policy
    d = res.to_dict()
    assert d["policy"]["micro_batch_size"] == res.policy.mu and "T_link" in d["layer_times"]
    assert "bound by" in res.reason
    with pytest.raises(ValueError):
        Policy(10, 3, 3, False, True, 0.1, 0.0)


def test_evaluate_policy_matches_plan():
    res = plan(get_hardware("s1"), MIX, MTBENCH, "float16")
    again = evaluate_policy(get_hardware("s1"), MIX, MTBENCH, res.policy)
    assert again.e2e_tok_s == pytest.approx(res.e2e_tok_s, rel=1e-9)


@pytest.mark.parametrize("seed", range(60, 72))
def test_pruning_by_the_lps_lower_bound_returns_the_full_grids_answer(seed, monkeypatch):
    """The search solves the most promising points first and skips those whose bound cannot reach the
    best found; forced to prune after 16 points, it returns what solving every point returns."""
    import optimizer.search as search
    from optimizer.lp import solve_grid, time_lower_bound

    hw, m, wl = random_case(seed)
    mus, ns = np.arange(1, 200, 3, dtype=float), np.arange(1, 24, dtype=float)

    def run(first):
        monkeypatch.setattr(search, "_FIRST", first)
        try:
            r = plan(hw, m, wl, DTYPE, mu_grid=mus, n_grid=ns)
        except InfeasibleError as e:
            return str(e)
        return r.policy, r.placements, r.e2e_tok_s

    assert run(16) == run(10**9)
    # the bound is a bound: never above a point's optimum
    from optimizer.cost_model import build_point_model

    mu, n = (a.ravel() for a in np.meshgrid(mus, ns, indexing="ij"))
    for a_g, f_g in ([(0, 1), (1, 1), (1, 0)] if hw.has_gpu else []):
        pm = build_point_model(hw, m, wl, DTYPE, mu, n, a_g, f_g)
        t, lb = solve_grid(pm)[0], time_lower_bound(pm)
        assert np.all(lb <= t * (1 + 1e-9))
        assert np.all(np.isfinite(lb) | ~np.isfinite(t))
