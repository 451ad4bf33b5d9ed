"""A job never destroys its input or loses work: the output file, resume, interrupted runs, warnings.

Each case is what a user would type; every refusal exits 2 with one clear line, before any model
loads, and leaves the dataset byte-identical.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

import moelight.engine.generation
from moelight.cli import app
from tests.cli_text import says

pytestmark = pytest.mark.no_race_check  # a job's files; ordering: the runtimes' own tests

HW = ["--hardware", "cpu-server"]
TINY = ["--model", "tiny", "--load-format", "dummy", "--no-progress", "--gen-len", "4", *HW]


def run(*args):
    return CliRunner().invoke(app, ["run", *map(str, args)])


def refused(result, *needles):
    out = result.output
    assert result.exit_code == 2, (result.exit_code, out, result.exception)
    assert "Traceback" not in out
    for n in needles:
        assert says(out, n), (n, out)
    return out


def dataset(path: Path, n: int = 6, **extra) -> Path:
    path.write_text("".join(json.dumps({"id": f"r{i}", "prompt": f"prompt number {i}"} | extra) + "\n"
                            for i in range(n)))
    return path


def ids(path: Path) -> list[str]:
    return [json.loads(line)["id"] for line in path.read_text().splitlines()]


# ---- 1. the input is sacred ------------------------------------------------------------------

@pytest.mark.parametrize("flag", [[], ["--overwrite"], ["--resume"]])
@pytest.mark.parametrize("spelling", ["same", "dotted", "symlink", "hardlink"])
def test_an_output_that_is_the_dataset_is_refused_whatever_the_flags(tmp_path, monkeypatch, flag, spelling):
    data = dataset(tmp_path / "d.jsonl")
    before = data.read_bytes()
    monkeypatch.chdir(tmp_path)
    out = {"same": data, "dotted": Path("sub/../d.jsonl"), "symlink": tmp_path / "link.jsonl",
           "hardlink": tmp_path / "hard.jsonl"}[spelling]
    (tmp_path / "sub").mkdir()
    if spelling == "symlink":
        out.symlink_to(data)
    if spelling == "hardlink":
        os.link(data, out)
    refused(run("--dataset", data, "--output", out, *TINY, *flag), "is the dataset", "never writes over")
    assert data.read_bytes() == before


def test_a_parquet_dataset_cannot_be_its_own_output(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = tmp_path / "d.parquet"
    pq.write_table(pa.table({"prompt": ["a b c", "d e f"]}), data)
    before = data.read_bytes()
    refused(run("--dataset", data, "--output", data, *TINY, "--overwrite"), "is the dataset")
    assert data.read_bytes() == before


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    pytest.importorskip("transformers")
    from tests.checkpoints import make_hf_model, save_checkpoint

    return save_checkpoint(make_hf_model(seed=3), tmp_path_factory.mktemp("job_files") / "ck", "legacy", 1)


@pytest.fixture
def model_copy(checkpoint, tmp_path) -> Path:
    return Path(shutil.copytree(checkpoint, tmp_path / "model"))


def test_an_output_inside_the_model_folder_or_on_the_policy_file_is_refused(tmp_path, checkpoint):
    data = dataset(tmp_path / "d.jsonl")
    refused(run("--dataset", data, "--output", checkpoint / "out.jsonl", "--model", checkpoint, "--no-progress",
                *HW), "is inside the model folder")
    assert not (checkpoint / "out.jsonl").exists()
    policy = tmp_path / "p.jsonl"  # a policy file however it is named
    policy.write_text("{}")
    refused(run("--dataset", data, "--output", policy, *TINY, "--policy", policy, "--overwrite"),
            "is the policy file")


# ---- 2. every output path checked before anything heavy ----------------------------------------

def test_an_output_under_a_file_is_refused_before_loading(tmp_path, monkeypatch):
    data = dataset(tmp_path / "d.jsonl")
    (tmp_path / "afile").write_text("x")
    loads = []
    monkeypatch.setattr("moelight.engine.session.EngineSession.load", lambda self, *a: loads.append(1))
    refused(run("--dataset", data, "--output", tmp_path / "afile" / "x.jsonl", *TINY), "afile is a file")
    refused(run("--dataset", data, "--output", tmp_path, *TINY), "")  # a folder: refused by its extension
    (tmp_path / "o.jsonl.report.json").mkdir()
    refused(run("--dataset", data, "--output", tmp_path / "o.jsonl", *TINY), "is a folder")
    assert not loads


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_folder_is_refused(tmp_path):
    data = dataset(tmp_path / "d.jsonl")
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    refused(run("--dataset", data, "--output", ro / "o.jsonl", *TINY), "not writable")


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc, where root cannot write either")
def test_a_folder_that_cannot_be_created_or_written_is_refused_before_loading(tmp_path, monkeypatch):
    data = dataset(tmp_path / "d.jsonl")
    loads = []
    monkeypatch.setattr("moelight.engine.session.EngineSession.load", lambda self, *a: loads.append(1))
    refused(run("--dataset", data, "--output", "/proc/moelight-x/o.jsonl", *TINY), "cannot create the folder")
    refused(run("--dataset", data, "--output", "/proc/o.jsonl", *TINY), "the folder /proc is not writable")
    for args in (["--save-policy", "/proc/moelight-x/p.json"], ["--plot", "/proc/moelight-x"]):
        refused(CliRunner().invoke(app, ["plan", "--model", "tiny", "--hardware", "t4", *args]),
                "cannot create the folder /proc/moelight-x")
    assert not loads


def test_checking_an_output_folder_leaves_nothing_behind(tmp_path):
    data = dataset(tmp_path / "d.jsonl")
    refused(run("--dataset", data, "--output", tmp_path / "new" / "deeper" / "o.jsonl", "--model", "no-such-model",
                "--load-format", "dummy", *HW), "--model no-such-model")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.jsonl"]  # the check's folders and probe are gone


def test_a_new_output_folder_is_created_and_a_load_error_is_not_hidden(tmp_path, model_copy):
    data = dataset(tmp_path / "d.jsonl")
    res = run("--dataset", data, "--output", tmp_path / "new" / "deeper" / "o.jsonl", *TINY)
    assert res.exit_code == 0, res.output
    assert len(ids(tmp_path / "new" / "deeper" / "o.jsonl")) == 6
    weights = model_copy / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    res = run("--dataset", data, "--output", tmp_path / "other" / "o.jsonl", "--model", model_copy,
              "--no-progress", *HW)
    out = refused(res, "model.safetensors")
    assert "NotADirectory" not in out and "report.json" not in out
    assert not (tmp_path / "other").exists()  # refused with the model's files, before anything ran
    good = tmp_path / "new" / "deeper" / "o.jsonl"
    kept = (good.parent / "o.jsonl.report.json").read_text()
    res = run("--dataset", data, "--output", good, "--model", model_copy, "--no-progress", "--overwrite", *HW)
    refused(res, "model.safetensors")
    assert len(ids(good)) == 6 and (good.parent / "o.jsonl.report.json").read_text() == kept  # both untouched


def test_a_checkpoint_whose_config_names_no_eos_runs_to_max_tokens(tmp_path, model_copy):
    cfg = json.loads((model_copy / "config.json").read_text())
    (model_copy / "config.json").write_text(json.dumps(cfg | {"eos_token_id": None}))  # save_pretrained may write it
    out = tmp_path / "o.jsonl"
    res = run("--dataset", dataset(tmp_path / "d.jsonl", 3), "--output", out, "--model", model_copy, "--no-progress",
              "--gen-len", "3", *HW)
    assert res.exit_code == 0, res.output
    assert [json.loads(line)["completion_tokens"] for line in out.read_text().splitlines()] == [3, 3, 3]


def test_a_failed_run_records_its_error_and_keeps_the_report_of_the_results_already_there(tmp_path):
    from moelight.jobs.output_file import save_report
    from moelight.jobs.report import RunReport

    out = tmp_path / "o.jsonl"
    save_report(RunReport("m", "bfloat16", 3, 3, 3, written=3), out)
    kept = (tmp_path / "o.jsonl.report.json").read_text()
    notes = []
    failed = RunReport("m", "bfloat16", 3, 3, 3)
    save_report(failed, out, RuntimeError("the device went away\nmore detail"), notes.append)
    assert failed.error == "RuntimeError: the device went away"
    assert (tmp_path / "o.jsonl.report.json").read_text() == kept and "was kept" in notes[0]
    save_report(RunReport("m", "bfloat16", 3, 3, 3), tmp_path / "new.jsonl", RuntimeError("boom"))
    assert json.loads((tmp_path / "new.jsonl.report.json").read_text())["error"] == "RuntimeError: boom"


# ---- 3. resume knows its job ---------------------------------------------------------------------

def test_resume_refuses_another_jobs_output_and_says_what_differs(tmp_path):
    data = dataset(tmp_path / "d.jsonl")
    out = tmp_path / "o.jsonl"
    assert run("--dataset", data, "--output", out, *TINY).exit_code == 0
    assert (tmp_path / "o.jsonl.job.json").is_file()
    refused(run("--dataset", data, "--output", out, *TINY, "--resume", "--temperature", "0.7"),
            "belongs to another job", "--temperature: was 0.0, now 0.7")
    changed = dataset(tmp_path / "d.jsonl", n=6, max_tokens=2)  # same ids, different requests
    refused(run("--dataset", changed, "--output", out, *TINY, "--resume"), "changed under the same id", "r0")


def test_resume_refuses_an_openai_batch_output_for_a_plain_job(tmp_path):
    batch = tmp_path / "b.jsonl"
    batch.write_text("".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                                         "body": {"model": "m", "prompt": f"hello {i}", "max_tokens": 3}}) + "\n"
                             for i in range(3)))
    out = tmp_path / "o.jsonl"
    assert run("--dataset", batch, "--output", out, *TINY).exit_code == 0
    plain = dataset(tmp_path / "p.jsonl", n=3)
    refused(run("--dataset", plain, "--output", out, *TINY, "--resume"), "output format")
    (tmp_path / "o.jsonl.job.json").unlink()  # an older moelight's output: judged by its records' shape
    refused(run("--dataset", plain, "--output", out, *TINY, "--resume"), "openai shape")


def test_resume_of_an_output_without_a_record_warns(tmp_path):
    data = dataset(tmp_path / "d.jsonl")
    out = tmp_path / "o.jsonl"
    assert run("--dataset", data, "--output", out, *TINY).exit_code == 0
    lines = out.read_text().splitlines()
    out.write_text("\n".join(lines[:3]) + "\n")
    (tmp_path / "o.jsonl.job.json").unlink()
    res = run("--dataset", data, "--output", out, *TINY, "--resume")
    assert res.exit_code == 0 and says(res.output, "has no job record")
    assert sorted(ids(out)) == sorted(f"r{i}" for i in range(6))


def test_resume_refuses_a_file_that_holds_no_results(tmp_path):
    """A prompt file (another job's dataset) given as the output holds ids but no results: resuming it
    counted those ids finished, never generated them and appended to the file; it is refused untouched."""
    data = dataset(tmp_path / "d.jsonl")
    out = dataset(tmp_path / "prompts.jsonl", n=3)
    before = out.read_bytes()
    refused(run("--dataset", data, "--output", out, *TINY, "--resume"), "not a results file", "--overwrite")
    assert out.read_bytes() == before and not (tmp_path / "prompts.jsonl.job.json").exists()


# ---- 4. honest summaries --------------------------------------------------------------------------

def test_an_interrupted_run_reports_what_it_wrote_and_the_resumed_one_what_was_there(tmp_path, monkeypatch):
    data = dataset(tmp_path / "d.jsonl", n=12)
    out = tmp_path / "o.jsonl"
    original = moelight.engine.generation.Engine.generate

    def stop_after_5(self, prompts, params, seeds, batch, micro, on_finish=None, stats=None):
        seen = []

        def finish(res):
            on_finish(res)
            seen.append(res)
            if len(seen) == 5:
                raise KeyboardInterrupt

        return original(self, prompts, params, seeds, batch, micro, on_finish=finish, stats=stats)

    monkeypatch.setattr(moelight.engine.generation.Engine, "generate", stop_after_5)
    res = run("--dataset", data, "--output", out, *TINY, "--batch-size", "2")
    assert res.exit_code == 130
    report = json.loads((tmp_path / "o.jsonl.report.json").read_text())
    assert report["interrupted"] and report["written"] == 5 == len(ids(out))
    assert report["generated_tokens"] == 5 * 4 and report["prompt_tokens"] > 0
    assert says(res.output, "the 5 result(s) finished in this run are in the output")
    monkeypatch.setattr(moelight.engine.generation.Engine, "generate", original)
    res = run("--dataset", data, "--output", out, *TINY, "--resume")
    assert res.exit_code == 0, res.output
    report = json.loads((tmp_path / "o.jsonl.report.json").read_text())
    assert (report["already_in_output"], report["written"], report["requests"]) == (5, 7, 7)
    assert report["previous_runs"][0]["written"] == 5 and report["previous_runs"][0]["interrupted"]
    assert says(res.output, "written 7 of 7 results (+5 already in the output = 12)")


def test_ctrl_c_while_loading_says_nothing_was_written(tmp_path, monkeypatch):
    data = dataset(tmp_path / "d.jsonl")

    def interrupted(self, *args):
        raise KeyboardInterrupt

    monkeypatch.setattr("moelight.engine.session.EngineSession.load", interrupted)
    res = run("--dataset", data, "--output", tmp_path / "o.jsonl", *TINY)
    assert res.exit_code == 130 and says(res.output, "nothing was written")
    assert not (tmp_path / "o.jsonl").exists()


# ---- 5. no silent degradation ---------------------------------------------------------------------

# ---- 6. clear errors everywhere a user can reach ---------------------------------------------------

@pytest.mark.parametrize("args, needle", [
    (["--top-p", "0"], "--top-p 0.0: must be in (0, 1]"), (["--top-p", "1.5"], "--top-p 1.5"),
    (["--top-k", "-2"], "--top-k -2: must be 0 or -1 (off)"),
    (["--ray-replicas", "5-2"], "--ray-replicas only apply to a Ray job: add --ray"),
    (["--ray-gpus-per-replica", "1", "--ray-cpus-per-replica", "2"],
     "--ray-cpus-per-replica, --ray-gpus-per-replica only apply to a Ray job")])
def test_sampling_and_ray_options_are_checked_as_options_before_the_dataset(tmp_path, monkeypatch, args, needle):
    reads = []
    monkeypatch.setattr("workloads.load_dataset", lambda *a, **k: reads.append(1))
    refused(run("--dataset", dataset(tmp_path / "d.jsonl"), "--output", tmp_path / "o.jsonl", *TINY, *args), needle)
    assert not reads


def test_a_conversation_without_a_chat_template_is_refused_by_its_line_and_can_be_skipped(tmp_path):
    ckpt = Path(__file__).parent / "data" / "stdlib-moe"  # tokenizer.json without a chat template
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"id": "plain", "prompt": "def f():"}) + "\n"
                    + json.dumps({"id": "lone", "messages": [{"role": "user", "content": "import os"}]}) + "\n"
                    + json.dumps({"id": "chat", "messages": [{"role": "system", "content": "be brief"},
                                                             {"role": "user", "content": "hi"}]}) + "\n")
    common = ["--dataset", data, "--model", ckpt, "--no-progress", "--gen-len", "2", *HW]
    refused(run(*common, "--output", tmp_path / "o.jsonl"), f"{data}:3:", "has no chat_template")
    res = run(*common, "--output", tmp_path / "o.jsonl", "--skip-bad-lines")
    assert res.exit_code == 0, res.output
    assert sorted(ids(tmp_path / "o.jsonl")) == ["lone", "plain"]  # a lone user turn is its text

def test_a_corrupt_tokenizer_json_is_named(tmp_path, model_copy):
    from tests.test_tokenizer import build_tokenizer

    build_tokenizer(model_copy)
    (model_copy / "tokenizer.json").write_text((model_copy / "tokenizer.json").read_text()[:200])
    refused(run("--dataset", dataset(tmp_path / "d.jsonl"), "--output", tmp_path / "o.jsonl", "--model", model_copy,
                "--no-progress", *HW), "tokenizer.json: not a readable tokenizer.json")


def test_plan_and_simulate_check_their_output_paths(tmp_path):
    file = tmp_path / "exists.txt"
    file.write_text("x")
    refused(CliRunner().invoke(app, ["plan", "--model", "tiny", "--hardware", "t4", "--plot", str(file)]),
            "is a file, not a folder")
    refused(CliRunner().invoke(app, ["simulate", "--model", "mixtral-8x7b", "--hardware", "t4", "--gantt",
                                     str(tmp_path / "g.txt")]), "name the file with one of these suffixes")
    refused(CliRunner().invoke(app, ["plan", "--model", "tiny", "--hardware", "t4", "--save-policy",
                                     str(file / "p.json")]), "is a file")


def test_a_policy_json_with_wrong_fields_lists_every_problem_and_one_too_big_is_refused(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"N": 8, "mu": 2, "batch_size": "eight"}))
    out = refused(CliRunner().invoke(app, ["simulate", "--model", "mixtral-8x7b", "--hardware", "s1", "--policy",
                                           str(bad)]), "unknown field 'N'", "missing 'r_w'", "'batch_size' must be")
    assert "__init__" not in out
    big = tmp_path / "big.json"
    big.write_text(json.dumps({"batch_size": 6080, "micro_batch_size": 760, "num_micro_batches": 8,
                               "attn_on_gpu": False, "ffn_on_gpu": True, "r_w": 0.3, "r_c": 0.0}))
    refused(CliRunner().invoke(app, ["simulate", "--model", "mixtral-8x7b", "--hardware", "s1", "--policy",
                                     str(big)]), "does not fit s1", "GPU memory: needs", "short by")
    refused(run("--dataset", dataset(tmp_path / "d.jsonl"), "--output", tmp_path / "o.jsonl", "--model",
                "mixtral-8x7b", "--load-format", "dummy", "--hardware", "s1", "--device", "emulated", "--policy", big,
                "--no-progress"), "does not fit s1")
    for fields, needle in (({"batch_size": 0, "micro_batch_size": 0}, "must be at least 1"),
                           ({"dtype": "int3"}, "'dtype': unknown dtype 'int3'")):
        silly = tmp_path / "silly.json"
        silly.write_text(json.dumps({"batch_size": 4, "micro_batch_size": 4, "num_micro_batches": 1,
                                     "attn_on_gpu": False, "ffn_on_gpu": False, "r_w": 0.0, "r_c": 0.0} | fields))
        refused(run("--dataset", dataset(tmp_path / "d.jsonl"), "--output", tmp_path / "o.jsonl", *TINY,
                    "--device", "emulated", "--policy", silly, "--overwrite"), "not a policy JSON", needle)


def test_a_coe_spec_naming_a_missing_folder_names_the_spec_and_the_entry(tmp_path):
    spec = tmp_path / "coe.json"
    spec.write_text(json.dumps({"models": {"code": str(tmp_path / "nowhere"), "chat": "tiny"},
                                "router": {"default": "chat"}}))
    refused(run("--dataset", dataset(tmp_path / "d.jsonl"), "--output", tmp_path / "o.jsonl", "--model", spec,
                "--no-progress", *HW), str(spec), "'code'", "neither a model folder nor a preset")


def test_dataset_hints_use_cli_syntax(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"id": "a", "prompt": "ok"}\n{"id": "b", "prompt": \n')
    out = refused(run("--dataset", data, "--output", tmp_path / "o.jsonl", *TINY), "--skip-bad-lines")
    assert "skip_bad_lines=True" not in out
    odd = tmp_path / "odd.jsonl"
    odd.write_text('{"question": "what?"}\n')
    out = refused(run("--dataset", odd, "--output", tmp_path / "o.jsonl", *TINY), "--format")
    assert "format=" not in out


# ---- 7. README examples on a GPU-less host ---------------------------------------------------------

def test_latency_mode_on_the_emulated_device_without_hardware_emulates_a_named_gpu(tmp_path):
    if shutil.which("nvidia-smi"):
        pytest.skip("a host with a GPU plans for it")
    res = CliRunner().invoke(app, ["run", "--dataset", str(dataset(tmp_path / "d.jsonl", n=2)), "--output",
                                   str(tmp_path / "o.jsonl"), "--model", "tiny", "--load-format", "dummy",
                                   "--gen-len", "3", "--mode", "latency", "--device", "emulated", "--no-progress"])
    assert res.exit_code == 0, res.output
    assert says(res.output, "emulating the t4 preset")
