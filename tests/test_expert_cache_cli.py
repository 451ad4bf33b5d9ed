"""The small-batch mode's commands end to end on the committed trained checkpoint: `moelight trace`,
`moelight eamc`, `moelight simulate-cache` (with its plot), `moelight run --mode latency` with the
EAM collection, `moelight plan --mode auto`, and their errors for bad traces and collections."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from moelight.cli import app
from moelight.expert_cache.routing_trace import Trace, TraceError
from tests.cli_text import says
from tests.test_cli_run import read_jsonl, report_of, write_jsonl

pytestmark = pytest.mark.no_race_check  # the commands; ordering: test_expert_cache_runtime

CKPT = Path(__file__).parent / "data" / "stdlib-moe"
CODE = ["def parse(text):\n    ", "class Config:\n    def __init__(self", "    return sorted(", "import re\n\n",
        "    if not isinstance(value, int):\n        raise"]


def invoke(*args) -> object:
    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    root = tmp_path_factory.mktemp("cache_cli")
    data = write_jsonl(root / "prompts.jsonl", [{"id": f"c{i}", "prompt": p} for i, p in enumerate(CODE)])
    res = invoke("trace", "--model", CKPT, "--dataset", data, "--output", root / "trace.parquet", "--gen-len", "5",
                 "--ignore-eos", "--dtype", "float32", "--hidden", "--no-progress")
    assert res.exit_code == 0, res.output
    res = invoke("eamc", "--trace", root / "trace.parquet", "--output", root / "eamc.npz", "--capacity", "3")
    assert res.exit_code == 0, res.output
    return root, data


def test_trace_holds_every_token_and_layer(traced):
    root, _ = traced
    t = Trace.load(root / "trace.parquet", hidden=True)
    assert t.model.moe_layers == [0, 1, 2, 3] and t.model.num_experts == 8 and t.model.top_k == 2
    assert [r.request_id for r in t.requests] == [f"c{i}" for i in range(len(CODE))]
    for r in t.requests:
        assert r.tokens == r.prompt_len + 4  # 5 new tokens, the last never fed back
        assert (r.experts[:, :3] >= 0).all()  # every token routed in layers 0-2
        assert (r.experts[: r.prompt_len - 1, 3] == -1).all()  # prefill's last layer runs the last token only
        assert (r.experts[r.prompt_len - 1 :, 3] >= 0).all()
        assert r.hidden.shape == (r.tokens, 4, 128)
        assert r.weights[:, :3].sum(-1) == pytest.approx(1.0, abs=1e-5)  # Mixtral renormalises top-2
    saved = t.save(root / "again.parquet")
    again = Trace.load(saved)
    assert all((a.experts == b.experts).all() for a, b in zip(again.requests, t.requests, strict=True))


def test_simulate_cache_reports_every_policy_and_plots(traced):
    root, _ = traced
    res = invoke("simulate-cache", "--trace", root / "trace.parquet", "--model", CKPT, "--hardware", "t4",
                 "--eamc", root / "eamc.npz", "--cache-size", "0.25,0.5", "--batch", "1,2",
                 "--json", root / "sim.json", "--plot", root / "plots")
    assert res.exit_code == 0, res.output
    rows = json.loads((root / "sim.json").read_text())
    assert {r["policy"] for r in rows} == {"on-demand", "lru", "lfu", "moe-infinity", "combined"}
    assert {(r["batch"], r["slots"]) for r in rows} == {(b, s) for b in (1, 2) for s in (8, 16)}
    assert all(0 <= r["hit_rate"] <= 1 and r["tpot_ms"]["p50"] > 0 for r in rows)
    assert (root / "plots" / "cache_sweep_batch1.png").is_file()


def test_run_in_latency_mode_with_moe_infinity_reports_the_cache(traced, tmp_path):
    root, data = traced
    common = ["run", "--dataset", data, "--model", CKPT, "--gen-len", "5", "--ignore-eos", "--dtype", "float32",
              "--device", "emulated", "--hardware", "t4", "--no-progress"]
    res = invoke(*common, "--output", tmp_path / "lat.jsonl", "--mode", "latency", "--eamc", root / "eamc.npz",
                 "--cache-policy", "moe-infinity", "--cache-size", "12", "--batch-size", "1")
    assert res.exit_code == 0, res.output
    assert says(res.output, "expert cache of 12 slots (moe-infinity)") and says(res.output, "latency mode (asked)")
    rep = report_of(tmp_path / "lat.jsonl")
    assert rep["policy"]["mode"] == "latency" and rep["cache"]["policy"] == "moe-infinity"
    assert rep["cache"]["accesses"] == rep["cache"]["hits"] + rep["cache"]["misses"] > 0
    assert set(rep["tpot_ms"]) == {"p50", "p90", "p99"}
    res = invoke(*common, "--output", tmp_path / "thr.jsonl", "--mode", "throughput")
    assert res.exit_code == 0, res.output
    assert [r["output_token_ids"] for r in read_jsonl(tmp_path / "lat.jsonl")] == \
        [r["output_token_ids"] for r in read_jsonl(tmp_path / "thr.jsonl")]


def test_a_cache_smaller_than_one_layers_experts_is_refused_by_its_option(traced, tmp_path):
    _, data = traced  # stdlib-moe: 4 layers of 8 experts, 32 routed experts in all
    common = ["run", "--dataset", data, "--model", CKPT, "--gen-len", "2", "--device", "emulated", "--hardware",
              "t4", "--no-progress", "--mode", "latency", "--output", tmp_path / "o.jsonl"]
    for size, slots in (("3", 3), ("0.125", 4)):
        res = invoke(*common, "--cache-size", size)
        assert res.exit_code == 2 and "Traceback" not in res.output, res.output
        assert says(res.output, f"--cache-size {size}: {slots} expert slot(s), fewer than one layer's 8 experts")
        assert says(res.output, "give at least 8 slots (or a share >= 0.25")


def test_a_model_of_one_moe_layer_is_not_told_to_give_a_share_it_cannot(tmp_path):
    """With one MoE layer a layer's experts are all of them: no share below 1 holds them, so the hint
    asks for a count only."""
    from tests.checkpoints import make_hf_model, save_checkpoint

    folder = save_checkpoint(make_hf_model(num_hidden_layers=1), tmp_path / "one")
    data = write_jsonl(tmp_path / "d.jsonl", [{"id": "a", "prompt": "hi"}])
    res = invoke("run", "--dataset", data, "--model", folder, "--gen-len", "2", "--device", "emulated", "--hardware",
                 "t4", "--no-progress", "--mode", "latency", "--output", tmp_path / "o.jsonl", "--cache-size", "0.75")
    assert res.exit_code == 2 and says(res.output, "give at least 4 slots"), res.output
    assert "share" not in res.output.split("give at least")[1], res.output


@pytest.mark.parametrize("extra, needle", [
    (["--device", "cpu", "--hardware", "cpu-server", "--cache-size", "0.5"], "cannot run: the CPU executor"),
    (["--device", "emulated", "--mode", "throughput", "--cache-policy", "lru"], "--mode is throughput"),
])
def test_expert_cache_options_where_no_cache_runs_are_refused(tmp_path, extra, needle):
    """--cache-size / --cache-policy set for a job that runs no expert cache would be ignored: refused."""
    data = write_jsonl(tmp_path / "d.jsonl", [{"id": "a", "prompt": "hi"}])
    hardware = [] if "--hardware" in extra else ["--hardware", "t4"]
    res = invoke("run", "--dataset", data, "--model", "tiny", "--load-format", "dummy", "--gen-len", "2",
                 *hardware, "--no-progress", "--output", tmp_path / "o.jsonl", *extra)
    assert res.exit_code == 2 and says(res.output, needle) and "Traceback" not in res.output, res.output
    assert not (tmp_path / "o.jsonl").exists()


def test_auto_mode_is_explained_in_plan(traced):
    small = invoke("plan", "--model", "mixtral-8x7b", "--hardware", "t4", "--mode", "auto", "--requests", "1")
    assert small.exit_code == 0 and says(small.output, "mode: latency (the faster for this job)")
    big = invoke("plan", "--model", "mixtral-8x7b", "--hardware", "t4", "--mode", "auto", "--requests", "4000")
    assert big.exit_code == 0 and says(big.output, "mode: throughput (the faster for this job)")


def test_bad_traces_and_collections_are_named(traced, tmp_path):
    root, data = traced
    with pytest.raises(TraceError, match="no such trace file"):
        Trace.load(tmp_path / "missing.parquet")
    pq.write_table(pa.table({"x": [1]}), tmp_path / "other.parquet")
    with pytest.raises(TraceError, match="not a moelight routing trace"):
        Trace.load(tmp_path / "other.parquet")
    table = pq.read_table(root / "trace.parquet")
    bad = table.set_column(table.column_names.index("experts"), "experts",
                           pa.array([[9, 0]] * table.num_rows, type=pa.list_(pa.int16())))
    pq.write_table(bad, tmp_path / "bad.parquet")
    with pytest.raises(TraceError, match="expert id 9 outside 0..7"):
        Trace.load(tmp_path / "bad.parquet")
    res = invoke("simulate-cache", "--trace", tmp_path / "bad.parquet", "--model", CKPT)
    assert res.exit_code == 2 and says(res.output, "expert id 9 outside")
    wrong = invoke("run", "--dataset", data, "--model", "tiny", "--load-format", "dummy", "--output",
                   tmp_path / "o.jsonl", "--device", "emulated", "--hardware", "t4", "--mode", "latency",
                   "--eamc", root / "eamc.npz", "--no-progress")
    assert wrong.exit_code == 2 and says(wrong.output, "this model routes 2 x 4")
    missing = invoke("run", "--dataset", data, "--model", "tiny", "--load-format", "dummy", "--output",
                     tmp_path / "o.jsonl", "--cache-policy", "moe-infinity", "--no-progress")
    assert missing.exit_code == 2 and says(missing.output, "--cache-policy moe-infinity needs --eamc")
    cpu = invoke("run", "--dataset", data, "--model", "tiny", "--load-format", "dummy", "--output",
                 tmp_path / "o.jsonl", "--device", "cpu", "--mode", "latency", "--no-progress")
    assert cpu.exit_code == 2 and says(cpu.output, "the CPU executor holds every expert")


def test_simulate_cache_names_a_gpu_level_without_the_dtypes_rate(traced, tmp_path):
    """A hardware file whose GPU has no FLOP/s for --dtype nor float32: one error naming it (a KeyError traceback)."""
    from dataclasses import replace

    from hrm import get_hardware

    t4 = get_hardware("t4")
    hw = replace(t4, gpu=replace(t4.gpu, flops={"bfloat16": 6e13})).save(tmp_path / "bf16.json")
    res = invoke("simulate-cache", "--trace", traced[0] / "trace.parquet", "--model", CKPT, "--hardware", hw,
                 "--policy", "lru", "--cache-size", "0.5", "--batch", "1")
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert says(res.output, f"--hardware {hw}") and says(res.output, "gpu.flops holds bfloat16"), res.output


def test_train_predictor_and_the_papers_policies_through_the_commands(traced, tmp_path):
    root, data = traced
    files = {}
    for kind in ("promoe", "duoserve", "coserve"):
        files[kind] = tmp_path / f"{kind}.npz"
        res = invoke("train-predictor", "--trace", root / "trace.parquet", "--kind", kind, "--output", files[kind],
                     "--epochs", "3")
        assert res.exit_code == 0 and says(res.output, f"{kind}:"), res.output
    res = invoke("simulate-cache", "--trace", root / "trace.parquet", "--model", CKPT, "--policy",
                 "promoe,duoserve,coserve", "--cache-size", "0.5", "--json", tmp_path / "sim.json",
                 *[a for k in files for a in ("--predictor", files[k])])
    assert res.exit_code == 0, res.output
    assert [r["policy"] for r in json.loads((tmp_path / "sim.json").read_text())] == ["promoe", "duoserve", "coserve"]
    run = invoke("run", "--dataset", data, "--model", CKPT, "--gen-len", "4", "--dtype", "float32", "--device",
                 "emulated", "--hardware", "t4", "--no-progress", "--output", tmp_path / "o.jsonl", "--mode",
                 "latency", "--cache-policy", "promoe", "--predictor", files["promoe"], "--cache-size", "16")
    assert run.exit_code == 0, run.output
    assert report_of(tmp_path / "o.jsonl")["cache"]["policy"] == "promoe"
    wrong = invoke("run", "--dataset", data, "--model", CKPT, "--dtype", "float32", "--device", "emulated",
                   "--hardware", "t4", "--no-progress", "--output", tmp_path / "w.jsonl", "--mode", "latency",
                   "--cache-policy", "duoserve", "--predictor", files["promoe"])
    assert wrong.exit_code == 2 and says(wrong.output, "--predictor ")
    assert says(wrong.output, "a promoe predictor; the duoserve policy needs")
    assert not says(wrong.output, "policy (auto")  # refused with the options, before any planning
    none = invoke("run", "--dataset", data, "--model", CKPT, "--output", tmp_path / "n.jsonl", "--cache-policy",
                  "coserve", "--no-progress")
    assert none.exit_code == 2 and says(none.output, "--cache-policy coserve needs --predictor FILE")
    bad = invoke("train-predictor", "--trace", root / "trace.parquet", "--kind", "oracle", "--output", tmp_path / "x")
    assert bad.exit_code == 2 and says(bad.output, "promoe, duoserve, coserve")


def test_traces_too_small_to_learn_from_are_refused(traced, tmp_path):
    """An empty trace gives no EAM, one request leaves nothing to learn from after the held-out tenth,
    and a ProMoE stride as deep as the model predicts no layer: each is said, not written as an empty file."""
    import pyarrow.compute as pc

    root, _ = traced
    table = pq.read_table(root / "trace.parquet")
    pq.write_table(table.filter(pc.equal(table.column("request"), 0)).replace_schema_metadata(
        table.schema.metadata), tmp_path / "one.parquet")
    pq.write_table(table.slice(0, 0).replace_schema_metadata(table.schema.metadata), tmp_path / "empty.parquet")
    res = invoke("eamc", "--trace", tmp_path / "empty.parquet", "--output", tmp_path / "e.npz")
    assert res.exit_code == 2 and says(res.output, "holds no request"), res.output
    res = invoke("train-predictor", "--trace", tmp_path / "one.parquet", "--kind", "duoserve", "--output",
                 tmp_path / "p.npz")
    assert res.exit_code == 2 and says(res.output, "holds 1 request(s)"), res.output
    res = invoke("train-predictor", "--trace", root / "trace.parquet", "--kind", "promoe", "--stride", "9",
                 "--output", tmp_path / "p.npz")
    assert res.exit_code == 2 and says(res.output, "--stride 9: the model has 4 MoE layers"), res.output
    assert not (tmp_path / "e.npz").exists() and not (tmp_path / "p.npz").exists()


def test_trace_takes_the_options_its_errors_name(tmp_path):
    """A prompt too long says "pass --skip-bad-lines", a folder without tokenizer.json "--tokenizer byte":
    trace has both, so one bad prompt does not block a trace."""
    data = write_jsonl(tmp_path / "d.jsonl", [{"id": "ok", "prompt": "def f(): pass"},
                                              {"id": "long", "prompt": "x " * 5000}])
    common = ["trace", "--model", CKPT, "--dataset", data, "--output", tmp_path / "t.parquet", "--gen-len", "2",
              "--dtype", "float32", "--no-progress"]
    refused = invoke(*common)
    assert refused.exit_code == 2 and says(refused.output, "--skip-bad-lines"), refused.output
    res = invoke(*common, "--skip-bad-lines")
    assert res.exit_code == 0 and says(res.output, "traced 1 sequences"), res.output
    assert [r.request_id for r in Trace.load(tmp_path / "t.parquet").requests] == ["ok"]
    res = invoke("trace", "--model", "tiny", "--load-format", "dummy", "--tokenizer", "byte", "--dataset", data,
                 "--output", tmp_path / "b.parquet", "--gen-len", "2", "--no-progress", "--skip-bad-lines")
    assert res.exit_code == 0, res.output


def test_trace_records_each_sample_of_a_request_with_n(tmp_path):
    """n samples are n sequences: each traced on its own (`id#k`), with its own draws."""
    data = write_jsonl(tmp_path / "d.jsonl", [{"id": "a", "prompt": "def f(): pass", "n": 3, "temperature": 1.0},
                                              {"id": "b", "prompt": "import os"}])
    res = invoke("trace", "--model", CKPT, "--dataset", data, "--output", tmp_path / "t.parquet", "--gen-len", "6",
                 "--dtype", "float32", "--ignore-eos", "--no-progress")
    assert res.exit_code == 0 and says(res.output, "traced 4 sequences"), res.output
    requests = Trace.load(tmp_path / "t.parquet").requests
    assert [r.request_id for r in requests] == ["a#0", "a#1", "a#2", "b"]
    assert all(r.tokens == r.prompt_len + 5 for r in requests)  # the last token is sampled, never routed
    decoded = [r.experts[requests[0].prompt_len:].tolist() for r in requests[:3]]
    assert decoded[0] != decoded[1] or decoded[1] != decoded[2]


def test_simulate_cache_refuses_a_bad_dtype_and_a_host_without_gpu(traced, tmp_path):
    """One line naming the option, exit 2, no traceback: not a ValueError from the simulator."""
    root, _ = traced
    sim = ["simulate-cache", "--trace", root / "trace.parquet", "--model", CKPT, "--cache-size", "0.5"]
    bad = invoke(*sim, "--hardware", "t4", "--dtype", "bogus")
    assert bad.exit_code == 2 and says(bad.output, "--dtype 'bogus' is not one of"), bad.output
    cpu = invoke(*sim, "--hardware", "cpu-server")
    assert cpu.exit_code == 2 and says(cpu.output, "--hardware cpu-server:"), cpu.output
    from hrm import get_hardware

    profile = get_hardware("cpu-server").save(tmp_path / "cpu_profile.json")
    saved = invoke(*sim, "--hardware", profile)
    assert saved.exit_code == 2 and says(saved.output, "has no GPU, and an expert cache lives on one"), saved.output
    assert invoke(*sim, "--hardware", "t4", "--dtype", "bf16").exit_code == 0


@pytest.mark.parametrize("command", [["eamc", "--capacity", "3"], ["train-predictor", "--kind", "coserve"]])
def test_eamc_and_train_predictor_replace_an_output_only_with_overwrite(traced, tmp_path, command):
    root, _ = traced
    out = tmp_path / "made.npz"
    out.write_text("an earlier file")
    args = [command[0], "--trace", root / "trace.parquet", "--output", out, *command[1:]]
    res = invoke(*args)
    assert res.exit_code == 2 and says(res.output, f"--output {out}: exists; pass --overwrite"), res.output
    assert out.read_text() == "an earlier file"
    res = invoke(*args, "--overwrite")
    assert res.exit_code == 0 and out.read_bytes()[:2] == b"PK", res.output  # an npz


def test_simulate_cache_labels_what_it_simulated_and_refuses_unread_files(traced, tmp_path):
    """A batch over the trace's sequences runs as that many (labelled so, once), a count over the
    model's experts as every expert (once), each with a note; an --eamc no named policy reads is
    refused as `run` refuses it."""
    root, _ = traced  # 5 traced sequences of a model with 32 routed experts
    sim = ["simulate-cache", "--trace", root / "trace.parquet", "--model", CKPT, "--hardware", "t4", "--policy", "lru"]
    res = invoke(*sim, "--cache-size", "32,100", "--batch", "1000,5", "--json", tmp_path / "s.json")
    assert res.exit_code == 0, res.output
    rows = json.loads((tmp_path / "s.json").read_text())
    assert [(r["batch"], r["slots"]) for r in rows] == [(5, 32)]
    assert says(res.output, "note: --batch 1000,5: the trace holds 5 sequence(s)")
    assert says(res.output, "note: --cache-size 32,100: the model has 32 routed experts")
    res = invoke(*sim, "--eamc", root / "eamc.npz")
    assert res.exit_code == 2 and says(res.output, "only --policy moe-infinity reads it"), res.output
