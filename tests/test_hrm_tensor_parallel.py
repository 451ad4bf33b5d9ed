"""The HRM with t GPUs: aggregate levels and links (own or shared), the all-reduce cost over PCIe
or NVLink, the host-memory roof every link draws from, replicated weights, the divisibility
check at plan time, and the paper's S6 / S7 settings through `plan` and `simulate`."""

from dataclasses import replace

import numpy as np
import pytest
from typer.testing import CliRunner

from hrm import WorkloadSpec, costs, get_hardware, get_model
from hrm.hardware import HardwareSpec, Level, Link
from hrm.hardware_presets import HARDWARE_PRESETS
from moelight.cli import app
from moelight.pipeline.schedule import build_decode
from moelight.pipeline.schedule_simulator import pass_roofs, shape_from_spec, simulate_policy, task_durations
from optimizer import plan
from optimizer.cost_model import build_point_model
from tests.cli_text import says

MIX = get_model("mixtral-8x7b")
BIG = get_model("mixtral-8x22b")
CPU = Level("cpu", 1e12, 1e11, {"float16": 1e12})
GPU = Level("gpu", 16e9, 3e11, {"float16": 6e13})
LINK = Link(h2d=1.6e10, d2h=1.6e10)


def host(t: int, **kw) -> HardwareSpec:
    return HardwareSpec("synthetic", CPU, GPU, t, LINK, **kw)


def test_links_add_up_unless_shared():
    assert host(4).link_total().h2d == 4 * 1.6e10
    assert host(4, link_shared=True).link_total().h2d == 1.6e10
    assert host(4).gpu_total().memory_bytes == 4 * 16e9


def test_ring_all_reduce_by_hand():
    nbytes = 1e6
    # 4 GPUs over PCIe: 2 * 3/4 of the bytes at one link's 16 GB/s, plus 6 steps of 5 us
    assert costs.allreduce_time(host(4), nbytes) == pytest.approx(1.5e6 / 1.6e10 + 6 * 5e-6)
    # a shared link: each GPU gets a quarter of it
    assert costs.allreduce_time(host(4, link_shared=True), nbytes) == pytest.approx(1.5e6 / 4e9 + 6 * 5e-6)
    # NVLink at 300 GB/s, 2 GPUs: one send of half the bytes... 2 * 1/2 * nbytes
    assert costs.allreduce_time(host(2, interconnect=3e11), nbytes) == pytest.approx(1e6 / 3e11 + 2 * 5e-6)
    assert costs.allreduce_time(host(1), nbytes) == 0.0
    # one layer: the O-projection and the FFN outputs, [tokens, hidden] fp16 each
    one = costs.allreduce_time(host(4), 10 * 4096 * 2)
    assert costs.layer_allreduce_time(host(4), MIX, 10, "float16") == pytest.approx(2 * one)
    # over PCIe the ring traffic of all GPUs lands on the host links; over NVLink it does not
    assert costs.allreduce_link_bytes(host(4), MIX, 10, "float16") == pytest.approx(4 * 1.5 * 2 * 10 * 4096 * 2)
    assert costs.allreduce_link_bytes(host(4, interconnect=3e11), MIX, 10, "float16") == 0.0


def test_replicated_weights_are_held_by_every_gpu():
    # embeddings + LM head + final norm, and per layer two norms and the router
    h, v, e, layers = 4096, 32000, 8, 32
    assert MIX.replicated_params() == 2 * v * h + h + layers * (2 * h + h * e)
    wl = WorkloadSpec(77, 64)
    one = build_point_model(host(1), MIX, wl, "float16", 64, 4, 0, 1)
    four = build_point_model(host(4), MIX, wl, "float16", 64, 4, 0, 1)
    extra = four.gpu_mem["non_expert_weights"].c0 - one.gpu_mem["non_expert_weights"].c0
    assert extra == pytest.approx(3 * MIX.replicated_params() * 2)
    assert four.gpu_mem["activations"].c0 == pytest.approx(4 * one.gpu_mem["activations"].c0)


def test_host_memory_roof_by_hand():
    """Paged bytes cross host memory three times (copy in, copy out, DMA); CPU attention reads the KV."""
    wl = WorkloadSpec(77, 64)
    pm = build_point_model(host(4), MIX, wl, "float16", 100.0, 8.0, 0, 1)
    w_le = costs.layer_expert_bytes(MIX, "float16")
    kv = costs.kv_cache_bytes(MIX, 800, wl.mean_context, "float16")
    crossing = costs.qkv_bytes(MIX, 800, "float16") + costs.attention_output_bytes(MIX, 800, "float16")
    at = lambda x: float(pm.host.at(x, 0.0))  # noqa: E731
    assert at(0.0) == pytest.approx((3 * w_le + kv + crossing) / 1e11)
    assert at(1.0) == pytest.approx((kv + crossing) / 1e11)
    times = pm.layer_times(0.0, 0.0)
    assert float(times["T_layer"]) >= float(times["T_host"])


def test_more_of_the_interconnect_never_predicts_slower():
    wl = WorkloadSpec(77, 128, 418)
    own = plan(get_hardware("s7"), BIG, wl, "float16").e2e_tok_s
    shared = plan(replace(get_hardware("s7"), link_shared=True), BIG, wl, "float16").e2e_tok_s
    nvlink = plan(replace(get_hardware("s7"), interconnect=3e11), BIG, wl, "float16").e2e_tok_s
    assert shared < own <= nvlink


def test_a_gpu_count_that_does_not_divide_the_model_is_refused_at_plan_time():
    with pytest.raises(ValueError, match=r"needs 3 to divide .*attention heads 32, KV heads 8.*one of 1, 2, 4, 8"):
        plan(get_hardware("t4"), MIX, WorkloadSpec(77, 64), "float16", gpus=3)
    res = CliRunner().invoke(app, ["plan", "--model", "mixtral-8x7b", "--hardware", "t4", "--gpus", "3"])
    assert res.exit_code == 2 and says(res.output, "needs 3 to divide the model's attention heads 32")


def test_the_simulator_charges_all_reduces_and_the_shared_roofs():
    hw = get_hardware("s7")
    shape = shape_from_spec(BIG, 64, 4, 140.0, 0.1, "float16")
    graph = build_decode("cgopipe", shape)
    durations = task_durations(graph, hw, BIG, "float16")
    post = next(t for t in graph.tasks if t.op == "post_attn")
    no_reduce = costs.post_attention_time(hw, BIG, 64, "gpu", "float16")
    assert durations[post.index] == pytest.approx(no_reduce + costs.layer_allreduce_time(hw, BIG, 64, "float16")
                                                  + costs.runtime_layer_time(hw, 1.0, "gpu"))
    roofs = pass_roofs(graph, hw, BIG, "float16")
    staged = sum(t.nbytes for t in graph.tasks if t.op == "w_stage")
    assert roofs["host"] * hw.cpu.bandwidth >= 3 * staged
    h2d = sum(t.nbytes for t in graph.tasks if t.lane == "h2d")
    ring = sum(float(costs.allreduce_link_bytes(hw, BIG, t.tokens, "float16")) for t in graph.find("post_attn"))
    assert roofs["link"] == pytest.approx((h2d + ring) / hw.link_total().h2d)


@pytest.mark.parametrize("name", ["s6", "s7"])
def test_the_papers_multi_t4_settings_run_mixtral_8x22b(name):
    hw = get_hardware(name)
    res = plan(hw, BIG, WorkloadSpec(77, 128, 418), "float16", family="cgopipe")
    assert res.policy.ffn_on_gpu and res.e2e_tok_s > 0
    sim = simulate_policy(hw, BIG, WorkloadSpec(77, 128, 418), res.policy, "cgopipe")
    assert sim.e2e_tok_s == pytest.approx(res.e2e_tok_s, rel=0.2)  # the task graph agrees with the LP
    out = CliRunner().invoke(app, ["simulate", "--model", "mixtral-8x22b", "--hardware", name, "--gen-len", "128"])
    assert out.exit_code == 0, out.output
    assert says(out.output, f"on {name} ({hw.gpu_count}x T4)")


@pytest.mark.parametrize("preset", sorted(n for n, h in HARDWARE_PRESETS.items() if h.has_gpu))
def test_every_gpu_preset_plans_and_simulates_with_gpus(preset):
    for cmd in (["plan", "--model", "mixtral-8x7b", "--hardware", preset, "--gpus", "2"],
                ["simulate", "--model", "mixtral-8x7b", "--hardware", preset, "--gpus", "2", "--gen-len", "64"]):
        res = CliRunner().invoke(app, cmd)
        assert res.exit_code == 0, (cmd, res.output)
    two = plan(get_hardware(preset), MIX, WorkloadSpec(77, 64), gpus=2)
    assert two.hardware.endswith("x2 GPU")
    assert np.isfinite(two.e2e_tok_s)
