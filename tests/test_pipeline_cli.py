"""`moelight simulate` through a local typer app holding only that command (and a no-op)."""

from __future__ import annotations

import json

import typer
from typer.testing import CliRunner

from moelight.cli import simulate_cmd
from tests.cli_text import says


def _app() -> typer.Typer:
    app = typer.Typer()
    simulate_cmd.register(app)

    @app.command("noop")
    def noop() -> None:  # a second command keeps typer in multi-command mode
        pass

    return app


def test_simulate_all_schedules_with_gantt(tmp_path):
    png = tmp_path / "g.png"
    res = CliRunner().invoke(
        _app(),
        ["simulate", "--model", "mixtral-8x7b", "--hardware", "s2", "--schedule", "all", "--gantt", str(png)],
    )
    assert res.exit_code == 0, res.output
    for name in ("cgopipe", "flexgen", "flexgen-cpu", "overlap-unpaged"):
        assert says(res.output, f"schedule {name}:")
    assert says(res.output, "per layer (decode)") and says(res.output, "lane utilisation")
    assert says(res.output, "end-to-end") and says(res.output, "speed-up of cgopipe")
    assert png.stat().st_size > 0


def test_simulate_policy_file_and_errors(tmp_path):
    pol = tmp_path / "p.json"
    pol.write_text(
        json.dumps(
            {
                "batch_size": 512,
                "micro_batch_size": 64,
                "num_micro_batches": 8,
                "attn_on_gpu": False,
                "ffn_on_gpu": True,
                "r_w": 0.0,  # 0.1 of Mixtral's experts resident does not fit a T4 beside N=512 (refused)
                "r_c": 0.0,
            }
        )
    )
    runner = CliRunner()
    ok = runner.invoke(
        _app(),
        [
            "simulate",
            "--model",
            "mixtral-8x7b",
            "--hardware",
            "t4",
            "--policy",
            str(pol),
            "--prompt-len",
            "100",
            "--gen-len",
            "32",
        ],
    )
    assert ok.exit_code == 0, ok.output
    assert says(ok.output, "N=512 = mu 64 x 8")
    bad = runner.invoke(_app(), ["simulate", "--model", "mixtral-8x7b", "--schedule", "zigzag"])
    assert bad.exit_code == 2 and says(bad.output, "unknown schedule")
    cpu = runner.invoke(_app(), ["simulate", "--model", "mixtral-8x7b", "--hardware", "cpu-server"])
    assert cpu.exit_code == 2 and says(cpu.output, "no GPU")


def test_simulate_auto_dtype_on_a_t4_is_float16():
    res = CliRunner().invoke(_app(), ["simulate", "--model", "mixtral-8x7b", "--hardware", "s1",
                                      "--schedule", "cgopipe", "--gen-len", "32"])
    assert res.exit_code == 0, res.output
    assert says(res.output, "dtype float16")
