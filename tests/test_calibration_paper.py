"""Regression test of the HRM's calibration against MoE-Lightning's published Table 5.

benchmarks/calibrate_paper.py predicts each row with the schedule its system runs, at the
paper's (mu, N), from the sourced achieved rates of the S1 preset. Tolerance: +-25% on every
row (the issue's target; the predictions sit at -20%..+17%). The same rows at datasheet peaks
are 1.8-2.8x too fast, so this test fails if the achieved terms stop applying.
"""

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "calibrate_paper.py"
_spec = importlib.util.spec_from_file_location("calibrate_paper", _PATH)
calibrate = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("calibrate_paper", calibrate)  # dataclasses look their module up there
_spec.loader.exec_module(calibrate)


@pytest.mark.parametrize("row", calibrate.TABLE5, ids=lambda r: f"{r.system}-{r.mu}x{r.n_mb}")
def test_table5_rows_within_tolerance(row):
    got = calibrate.predict(row)["tok_s"]
    assert abs(got / row.published - 1) <= calibrate.TOLERANCE, (got, row.published)
    assert calibrate.predict(row, datasheet=True)["tok_s"] > 1.5 * row.published


def test_cgopipe_beats_flexgen_at_the_same_policy_as_published():
    """Table 5's ordering: MoE-Lightning(p) > FlexGen at its policy with larger N > at its policy."""
    got = {(r.system, r.n_mb): calibrate.predict(r)["tok_s"] for r in calibrate.TABLE5}
    assert got[("MoE-Lightning(p)", 14)] > got[("FlexGen", 31)] > got[("FlexGen", 14)] > got[("FlexGen", 139)]


def test_the_planners_policy_is_no_worse_than_the_papers_under_the_same_model():
    for r in calibrate.planner_vs_paper():
        assert r["ours"].e2e_tok_s >= r["theirs"].e2e_tok_s * (1 - 1e-6), r["row"]
        assert r["sim"]["ours"] >= r["sim"]["theirs"] * 0.95, r["row"]
