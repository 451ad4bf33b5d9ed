"""Roofs, turning points and balance point against hand-computed values."""

import numpy as np
import pytest

from hrm import roofline as rl
from hrm.hardware import HardwareSpec, Level, Link
from hrm.model_presets import get_model


def test_roofs_and_attainable():
    np.testing.assert_allclose(rl.memory_roof(1e11, [1, 10]), [1e11, 1e12])
    np.testing.assert_allclose(rl.attainable_local(1e12, 1e11, [1, 10, 100]), [1e11, 1e12, 1e12])
    # min(P_i=1e13, B_i*I_i=1e11*50, B_link*I_j=1e10*20) = 2e11
    assert rl.attainable(1e13, 1e11, 50, 1e10, 20) == pytest.approx(2e11)
    assert rl.ridge_point(1e12, 5e10) == pytest.approx(20)


def test_turning_points_and_balance():
    # P1: B_link*I = min(P_cpu, B_cpu*I) -> I = P_cpu / B_link = 1e12 / 1e10
    assert rl.turning_point_p1(1e12, 5e10, 1e10) == pytest.approx(100)
    assert rl.turning_point_p1(1e12, 5e10, 6e10) == 0.0  # link faster than CPU memory
    assert rl.turning_point_p2(1e13, 1e10) == pytest.approx(1000)
    # balance: B_link*I_j = min(P_i, B_i*I_i) = min(1e13, 1e11*50) -> I_j = 500
    assert rl.balance_point(1e13, 1e11, 50, 1e10) == pytest.approx(500)
    assert rl.balance_point(1e13, 1e11, 500, 1e10) == pytest.approx(1000)  # compute-bound: = P2


def test_turning_points_of_a_spec():
    cpu = Level("c", 1e11, 5e10, {"float32": 1e12})
    hw = HardwareSpec("h", cpu, Level("g", 1e10, 1e11, {"float32": 1e13}), 2, Link(1e10, 1e10))
    tp = rl.turning_points(hw, "float32")
    assert tp["P1"] == pytest.approx(1e12 / 2e10)  # two GPUs: two links
    assert tp["P2"] == pytest.approx(2e13 / 2e10)
    assert tp["gpu_ridge"] == pytest.approx(100)
    assert tp["cpu_ridge"] == pytest.approx(20)


def test_ffn_intensity_grows_with_batch():
    m = get_model("mixtral-8x7b")
    i_gpu_small, i_cpu_small = rl.ffn_intensities(m, 64, 64, 2.0)
    i_gpu_big, i_cpu_big = rl.ffn_intensities(m, 1024, 256, 2.0)
    assert i_cpu_big == pytest.approx(i_cpu_small * 16)
    # I_cpu of N tokens over all experts' bytes: 6hfkN / (E*3hf*b) = 2*k*N/(E*b) = N/4 here
    assert i_cpu_small == pytest.approx(64 / 4)
    assert i_gpu_big > i_gpu_small
    # r_w = 0.5 halves the bytes moved
    assert rl.ffn_intensities(m, 64, 64, 2.0, r_w=0.5)[1] == pytest.approx(2 * i_cpu_small)
