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


def test_simulate_json_holds_the_policy_prediction_and_every_schedule(tmp_path):
    """--json (there was none): the policy, the HRM's predicted and each schedule's simulated tok/s, its step
    times and lane busy shares, cgopipe's speed-up and the Gantt chart's path, with nothing else on stdout."""
    png = tmp_path / "g.png"
    res = CliRunner().invoke(_app(), ["simulate", "--model", "mixtral-8x7b", "--hardware", "t4", "--schedule", "all",
                                      "--quantize", "int4", "--gantt", str(png), "--json"])
    assert res.exit_code == 0, res.output
    d = json.loads(res.stdout)
    assert d["policy"]["batch_size"] == d["policy"]["micro_batch_size"] * d["policy"]["num_micro_batches"]
    assert d["predicted"]["e2e_tok_s"] > 0 and d["predicted"]["step_seconds"] > 0
    sim = {r["schedule"]: r for r in d["simulated"]}
    assert list(sim) == ["cgopipe", "flexgen", "flexgen-cpu", "overlap-unpaged"]
    for r in sim.values():
        assert r["e2e_tok_s"] > 0 and r["step_seconds"] > r["layer_seconds"] > 0 and r["prefill_seconds"] > 0
        assert set(r["lane_busy"]) <= {"gpu", "cpu", "h2d", "d2h", "pin"} and 0 < r["lane_busy"]["gpu"] <= 1
    assert d["cgopipe_speedup"]["flexgen"] == sim["cgopipe"]["e2e_tok_s"] / sim["flexgen"]["e2e_tok_s"]
    assert d["gantt"] == str(png) and png.stat().st_size > 0 and d["quantize"]["format"] == "int4"
