"""Expert-cache and throughput-only options are either used or said to be unused: `--mode auto`
may choose throughput mode (no expert cache), and latency mode runs no CGOPipe schedule."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from moelight.cli import app
from tests.cli_text import says
from tests.test_cli_run import report_of, write_jsonl

CKPT = Path(__file__).parent / "data" / "stdlib-moe"
PROMPTS = ["def __init__(self, name, value=None):\n    ", "import os\nimport sys\n\n\ndef main(",
           "class Config:\n    def __init__(self", "    return sorted("]


def invoke(*args) -> object:
    return CliRunner().invoke(app, [str(a) for a in args])


def run(tmp_path: Path, *extra) -> object:
    data = write_jsonl(tmp_path / "d.jsonl", [{"id": i, "prompt": p, "max_tokens": 8} for i, p in enumerate(PROMPTS)])
    return invoke("run", "--dataset", data, "--model", CKPT, "--dtype", "float32", "--device", "emulated",
                  "--hardware", "t4", "--no-progress", "--output", tmp_path / "o.jsonl", *extra)


def test_auto_mode_choosing_throughput_says_the_cache_options_went_unused(tmp_path):
    """The HRM's choice depends on the workload, so the job runs in the faster mode, but the options
    the user gave are named as unused on the console and in the report, with the way to use them."""
    res = run(tmp_path, "--cache-policy", "lru", "--cache-size", "8")
    assert res.exit_code == 0, res.output
    rep = report_of(tmp_path / "o.jsonl")
    assert rep["policy"]["mode"] == "throughput"
    warning = "--cache-policy, --cache-size unused: --mode auto chose throughput mode"
    assert says(res.output, "warning: " + warning) and says(res.output, "add --mode latency")
    assert any(warning in note for note in rep["notes"]), rep["notes"]


@pytest.mark.parametrize("extra, named", [
    (["--schedule", "flexgen"], "--schedule"),
    (["--batch-size", "4", "--micro-batch-size", "1"], "--micro-batch-size"),
])
def test_latency_mode_refuses_throughput_only_options(tmp_path, extra, named):
    """Latency mode runs one batch through the expert cache: a schedule or micro-batch size would be
    recorded as used and do nothing."""
    res = run(tmp_path, "--mode", "latency", *extra)
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert says(res.output, f"{named}: throughput mode's (CGOPipe's) options, and --mode is latency")
    assert not (tmp_path / "o.jsonl").exists()


def test_auto_mode_choosing_latency_says_the_throughput_options_went_unused(tmp_path):
    res = run(tmp_path, "--num-requests", "1", "--schedule", "flexgen")
    assert res.exit_code == 0, res.output
    rep = report_of(tmp_path / "o.jsonl")
    assert rep["policy"]["mode"] == "latency" and "schedule" not in rep["policy"]
    assert says(res.output, "warning: --schedule unused: --mode auto chose latency mode")
    assert any("add --mode throughput" in note for note in rep["notes"]), rep["notes"]
