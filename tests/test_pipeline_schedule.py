"""CGOPipe task graphs and the simulator: structure, feasibility of timelines, ordering."""

from __future__ import annotations

from dataclasses import replace

import pytest

from hrm import WorkloadSpec, get_hardware, get_model
from moelight.pipeline.schedule import SCHEDULES, build_decode, build_prefill
from moelight.pipeline.schedule_simulator import list_schedule, shape_from_spec, simulate, simulate_policy
from optimizer import Policy, plan

MIXTRAL = get_model("mixtral-8x7b")
MT_BENCH = WorkloadSpec(77, 128)


def _shape(n_mb=3, r_w=0.25, mu=64, **kw):
    return shape_from_spec(MIXTRAL, mu, n_mb, 140.0, r_w, **kw)


@pytest.mark.parametrize("name", SCHEDULES)
def test_graph_is_complete_and_acyclic(name):
    s = build_decode(name, _shape())
    L, n = MIXTRAL.num_layers, 3
    for op in ("pre_attn", "post_attn"):
        assert {(t.layer, t.mb) for t in s.find(op)} == {(j, i) for j in range(L) for i in range(n)}
    assert all(d < t.index for t in s.tasks for d in t.deps)
    attn_op = "gpu_attn" if name == "flexgen" else "cpu_attn"
    assert len(s.find(attn_op)) == L * n
    assert len(s.find("logits_d2h")) == n
    # every layer's post-attention waits for all pages of its layer (steady state: layer 0 preloaded)
    pages = s.find("w_h2d")
    for t in s.find("post_attn"):
        needed = {p.index for p in pages if p.layer == t.layer}
        assert needed <= set(t.deps)


def test_cgopipe_pages_per_micro_batch_and_blocks_elsewhere():
    shape = _shape(n_mb=4)
    cg = build_decode("cgopipe", shape).find("w_h2d", layer=1)
    assert len(cg) == 4 and sum(t.nbytes for t in cg) == pytest.approx(shape.paged_bytes_per_layer)
    for name in ("flexgen", "flexgen-cpu", "overlap-unpaged"):
        blocks = build_decode(name, shape).find("w_h2d", layer=1)
        assert len(blocks) == 1 and blocks[0].nbytes == pytest.approx(shape.paged_bytes_per_layer)
    # double buffer: loading layer j waits for layer j-2's post-attention (the slot it reuses)
    s = build_decode("cgopipe", shape)
    posts = {t.index for t in s.find("post_attn", layer=1)}
    for t in s.find("w_h2d", layer=3):
        assert posts <= set(t.deps)
    # fully resident weights: nothing to page
    assert not build_decode("cgopipe", _shape(r_w=1.0)).find("w_h2d")


def test_first_pass_loads_layer_zero_in_a_prologue():
    assert not build_decode("cgopipe", _shape()).find("w_h2d", layer=0)  # steady state: preloaded
    s = build_decode("cgopipe", replace(_shape(), first_layer_loaded=False, prefetch_next=False))
    assert len(s.find("w_h2d", layer=0)) == 3 and not s.find("w_h2d", layer=MIXTRAL.num_layers)


def test_flexgen_cpu_does_not_overlap_attention_with_gpu():
    tl = simulate(build_decode("flexgen-cpu", _shape()), get_hardware("s1"), MIXTRAL)
    gpu = [(tl.start[t.index], tl.end[t.index]) for t in tl.schedule.by_lane("gpu")]
    for t in tl.schedule.by_lane("cpu"):
        a, b = tl.start[t.index], tl.end[t.index]
        assert all(e <= a + 1e-12 or s >= b - 1e-12 for s, e in gpu)


@pytest.mark.parametrize("hw", ["s1", "s2", "t4", "l4", "a100-40gb"])
@pytest.mark.parametrize("name", SCHEDULES)
def test_timeline_respects_dependencies_and_lanes(hw, name):
    tl = simulate(build_decode(name, _shape(n_mb=5)), get_hardware(hw), MIXTRAL)
    tl.check()
    assert tl.makespan > 0
    util = tl.utilisation()
    assert all(0 <= u <= 1 + 1e-9 for u in util.values())


def test_prefill_graph_timeline():
    shape = shape_from_spec(MIXTRAL, 16, 1, 77.0, 0.1, prompt_tokens=16 * 77)
    tl = simulate(build_prefill(shape), get_hardware("s1"), MIXTRAL)
    tl.check()
    assert len(tl.schedule.find("kv_write")) == MIXTRAL.num_layers


def test_list_scheduling_runs_ready_work_first():
    """A transfer waiting on slow compute must not block a ready one launched after it."""
    from moelight.pipeline.schedule import GraphShape, Schedule

    s = Schedule("toy", GraphShape(1, (1,), (1.0,), 0, 0, 0, 0, 0))
    slow = s.add("slow", "gpu", "x")
    waits = s.add("after slow", "h2d", "x", [slow])
    ready = s.add("ready", "h2d", "x")
    tl = list_schedule(s, [1.0, 0.5, 0.5])
    tl.check()
    assert tl.start[ready] == 0.0 and tl.start[waits] == 1.0


POLICIES = [
    Policy(1768, 884, 2, False, True, 0.03, 0.0),
    Policy(2720, 680, 4, False, True, 0.02, 0.0),
    Policy(3976, 568, 7, False, True, 0.14, 0.0),
    Policy(512, 64, 8, False, True, 0.0, 0.0),
    Policy(256, 256, 1, False, True, 0.5, 0.0),
]


@pytest.mark.parametrize("hw", ["s1", "s2", "t4", "l4", "a100-40gb"])
def test_cgopipe_never_slower_than_the_other_schedules(hw):
    spec = get_hardware(hw)
    for pol in POLICIES:
        t = {name: simulate_policy(spec, MIXTRAL, MT_BENCH, pol, name).step_seconds for name in SCHEDULES}
        for name in SCHEDULES:
            assert t["cgopipe"] <= t[name] * (1 + 1e-9), (hw, pol, t)


def test_simulated_cgopipe_is_close_to_the_planner_prediction():
    """The planner's T_layer = max(link, cpu, gpu) is a lower bound the timeline approaches."""
    for hw in ("s1", "s2"):
        res = plan(get_hardware(hw), MIXTRAL, MT_BENCH, family="cgopipe")
        sim = simulate_policy(get_hardware(hw), MIXTRAL, MT_BENCH, res.policy, "cgopipe")
        assert sim.step_seconds >= res.decode_step_time * 0.97
        assert sim.e2e_tok_s == pytest.approx(res.e2e_tok_s, rel=0.25)


def _ancestors(s, index):
    seen, todo = set(), [index]
    while todo:
        for d in s.tasks[todo.pop()].deps:
            if d not in seen:
                seen.add(d)
                todo.append(d)
    return seen


def test_flexgen_waits_at_every_step_as_its_sync_does():
    """FlexGen issues layer j's FFN weights in attention step 0 of layer j and syncs after every
    step: micro-batch 1's step waits for those weights, and a micro-batch's KV copy starts only
    once the step two back is done. CGOPipe has neither wait."""
    for name in ("flexgen", "flexgen-cpu"):
        s = build_decode(name, _shape(n_mb=4))
        for j in (1, 5):
            weights = {t.index for t in s.find("w_h2d", layer=j)}
            assert weights and weights <= _ancestors(s, s.find("pre_attn", layer=j, mb=1)[0].index)
            first_post = s.find("post_attn", layer=j - 1, mb=3)[0].index  # the step before
            assert all(first_post in _ancestors(s, w) for w in weights)
    s = build_decode("flexgen", _shape(n_mb=4))
    kv = s.find("kv_h2d", layer=3, mb=2)[0]
    assert s.find("gpu_attn", layer=3, mb=0)[0].index in _ancestors(s, kv.index)
    cg = build_decode("cgopipe", _shape(n_mb=4))
    weights = {t.index for t in cg.find("w_h2d", layer=5)}
    assert not weights & _ancestors(cg, cg.find("pre_attn", layer=5, mb=1)[0].index)


def test_flexgen_keeps_the_runtimes_layer_zero_protocol():
    """A decode pass leaves the next pass's layer 0 in its slot (prefetch_next), and loads it
    itself only when it is not there yet."""
    L = MIXTRAL.num_layers
    steady = build_decode("flexgen", _shape())
    assert not steady.find("w_h2d", layer=0) and len(steady.find("w_h2d", layer=L)) == 1
    first = build_decode("flexgen", replace(_shape(), first_layer_loaded=False, prefetch_next=False))
    assert len(first.find("w_h2d", layer=0)) == 1 and not first.find("w_h2d", layer=L)
