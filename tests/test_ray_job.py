"""`moelight run --ray` and the `moelight.ray` processor on a local Ray cluster (2 CPUs, loopback only):
the tokens of a local run, two replicas, a replica killed mid-job, resume after an interrupted job,
bad records reported before any model loads."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from moelight.cli import with_ray_default  # noqa: E402
from moelight.engine.options import OptionError  # noqa: E402
from moelight.errors import PromptError  # noqa: E402
from moelight.jobs.dataset_job import run_job  # noqa: E402
from moelight.jobs.output_file import report_path  # noqa: E402
from moelight.jobs.run_options import RunOptions  # noqa: E402
from workloads import DatasetError, load_dataset  # noqa: E402

ENGINE = dict(model="tiny", load_format="dummy", dtype="float32", hardware="cpu-server", gen_len=12,
              progress=False)
LONG = dict(ENGINE, gen_len=24)


@pytest.fixture(scope="module")
def cluster():
    """The module's cluster; its address lets a job in another process join it instead of starting one."""
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


def _prompts(path: Path, n: int, extra: dict | None = None) -> Path:
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"id": f"r{i}", "prompt": f"request {i}: " + "the sea " * (i % 5 + 1)}
                               | (extra or {})) + "\n")
    return path


def _tokens(path: Path) -> dict[str, list[int]]:
    return {r["id"]: r["output_token_ids"] for r in map(json.loads, path.read_text().splitlines())}


def _ids(path: Path) -> list[str]:
    return [json.loads(line)["id"] for line in path.read_text().splitlines()]


def _local_run(factory, name: str, n: int, opts: dict) -> tuple[Path, dict[str, list[int]]]:
    """`n` prompts and the local run's output for them."""
    d = factory.mktemp(name)
    data = _prompts(d / "prompts.jsonl", n)
    run_job(RunOptions(dataset=data, output=d / "local.jsonl", **opts))
    return data, _tokens(d / "local.jsonl")


@pytest.fixture(scope="module")
def long_job(tmp_path_factory):
    """32 requests of 24 tokens (a job long enough to stop in its middle) and the local run's output."""
    return _local_run(tmp_path_factory, "ray_long_job", 32, LONG)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """24 requests and the local run's output for them."""
    return _local_run(tmp_path_factory, "ray_job", 24, ENGINE)


def test_one_replica_gives_the_local_runs_results(cluster, job, tmp_path):
    data, local = job
    out = tmp_path / "out.jsonl"
    report = run_job(RunOptions(dataset=data, output=out, ray="local", **ENGINE))
    assert _tokens(out) == local
    assert len(_ids(out)) == len(local)
    saved = json.loads(report_path(out).read_text())
    assert saved["requests"] == 24 and saved["generated_tokens"] == 24 * 12
    assert len(saved["replicas"]) == 1 and saved["replicas"][0]["requests"] == 24
    assert saved["replicas"][0]["policy"]["source"] == "auto"  # the replica planned its own batches
    assert report.end_to_end_tokens_per_s > 0 and report.decode_tokens_per_s > 0


def test_two_replicas_share_the_job(cluster, job, tmp_path):
    data, local = job
    out = tmp_path / "out.jsonl"
    report = run_job(RunOptions(dataset=data, output=out, ray="local", ray_replicas="2", **ENGINE))
    assert _tokens(out) == local
    assert sorted(Counter(_ids(out)).values()) == [1] * 24
    assert len(report.replicas) == 2 and all(r["requests"] > 0 for r in report.replicas)
    assert sum(r["requests"] for r in report.replicas) == 24
    assert all(r["threads"] == 1 for r in report.replicas)  # 2 CPUs shared by the pool


def test_a_pool_the_cluster_cannot_hold_is_reported(cluster):
    from moelight.jobs.ray.ray_job import warn_if_pool_cannot_start

    said: list[str] = []
    assert warn_if_pool_cannot_start(2, 1.0, 0.0, said.append) is None
    assert warn_if_pool_cannot_start(3, 1.0, 0.0, said.append) is not None
    assert warn_if_pool_cannot_start(1, 1.0, 1.0, said.append) is not None
    assert len(said) == 2 and "3 replica(s) of 1 CPU(s)" in said[0] and "(2 CPUs, 0 GPUs)" in said[0]
    assert "--ray-replicas" in said[1]


def _replica_pids() -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmd = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if b"MoelightReplica" in cmd:
                pids.append(int(entry.name))
    return pids


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the replica's process in /proc")
def test_a_replica_killed_mid_job_leaves_every_id_once(cluster, long_job, tmp_path):
    data, local = long_job
    opts = LONG
    out = tmp_path / "out.jsonl"
    done: dict = {}
    worker = threading.Thread(target=lambda: done.update(report=run_job(RunOptions(
        dataset=data, output=out, ray="local", ray_replicas="2", batch_size=2, **opts))))
    worker.start()
    killed = None
    deadline = time.time() + 120
    while time.time() < deadline and killed is None and worker.is_alive():
        if out.exists() and out.read_text().count("\n") >= 2 and _replica_pids():
            killed = _replica_pids()[0]
            os.kill(killed, signal.SIGKILL)
        time.sleep(0.05)
    worker.join(240)
    assert killed is not None, "the job ended before a replica could be killed"
    assert not worker.is_alive()
    assert sorted(Counter(_ids(out)).values()) == [1] * 32
    assert _tokens(out) == local
    assert len(done["report"].replicas) >= 2


def test_resume_after_an_interrupted_job(cluster, long_job, tmp_path):
    data, local = long_job
    opts = LONG
    out = tmp_path / "out.jsonl"
    # the interrupted job joins the module's cluster (the first Ctrl-C is the driver's, whichever cluster it is on)
    cmd = [sys.executable, "-m", "moelight", "run", "--dataset", str(data), "--output", str(out), "--model", "tiny",
           "--load-format", "dummy", "--dtype", "float32", "--hardware", "cpu-server", "--gen-len", "24",
           "--batch-size", "2", "--no-progress", "--ray", cluster]
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if out.exists() and out.read_text().count("\n") >= 2:
            proc.send_signal(signal.SIGINT)
            break
        time.sleep(0.05)
    text = proc.communicate(timeout=120)[0]
    assert proc.returncode == 130, text
    first = _ids(out)
    assert 2 <= len(first) < 32
    assert json.loads(report_path(out).read_text())["interrupted"] is True
    report = run_job(RunOptions(dataset=data, output=out, ray="local", resume=True, **opts))
    assert report.requests == 32 - len(first)  # the finished ids were read back and skipped
    assert sorted(Counter(_ids(out)).values()) == [1] * 32
    assert _tokens(out) == local


def test_bad_records_are_reported_as_locally_before_any_model_loads(cluster, tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"id": "a", "prompt": "fine"}\n{"id": "b", "prompt": \n{"id": "a", "prompt": "again"}\n'
                    '{"id": "c"}\n')
    with pytest.raises(DatasetError) as local:
        load_dataset(data, hint_style="cli")  # as `moelight run` reads it
    out = tmp_path / "out.jsonl"
    with pytest.raises(DatasetError) as remote:
        run_job(RunOptions(dataset=data, output=out, ray="local", model="no-such-model-dir", load_format="dummy",
                           progress=False))
    assert str(remote.value) == str(local.value)
    assert not out.exists()
    # the job ended: Ray Data's warm-up has ended too (a shutdown under it printed Ray's tracebacks)
    assert not [t for t in threading.enumerate() if t.name == "moelight-ray-warm-up" and t.is_alive()]


def test_no_cluster_at_the_address_is_an_option_error(monkeypatch):
    from moelight.engine.options import OptionError
    from moelight.jobs.ray.resources import connect

    def no_cluster(**kwargs):
        raise ConnectionError("Could not find any running Ray instance.")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", no_cluster)
    with pytest.raises(OptionError, match=r"--ray auto: no Ray cluster found there .*ray start --head"):
        connect("auto")


@pytest.mark.parametrize("checked_by", ["driver", "ray tasks"])
def test_a_prompt_too_long_is_reported_as_locally(cluster, tmp_path, monkeypatch, checked_by):
    if checked_by == "ray tasks":  # a job bigger than the planner's sample: PromptChecker actors check it
        monkeypatch.setattr("moelight.jobs.ray.ray_job.DRIVER_CHECK_MAX", 1)
    data = tmp_path / "long.jsonl"
    data.write_text(json.dumps({"id": "ok", "prompt": "short"}) + "\n"
                    + json.dumps({"id": "long", "prompt": "x " * 5000}) + "\n")
    msgs = []
    for extra in ({}, {"ray": "local"}):
        with pytest.raises(PromptError) as e:
            run_job(RunOptions(dataset=data, output=tmp_path / f"o{len(msgs)}.jsonl", **ENGINE, **extra))
        msgs.append(str(e.value))
    assert msgs[0] == msgs[1] and "long.jsonl:2: prompt has" in msgs[0]
    report = run_job(RunOptions(dataset=data, output=tmp_path / "skip.jsonl", ray="local", skip_bad_lines=True,
                                **ENGINE))
    assert _ids(tmp_path / "skip.jsonl") == ["ok"] and report.skipped_requests == 1
    assert len(report.skipped) == 1 and report.skipped[0].startswith(f"{data}:2: prompt has")


def test_a_replica_runs_torch_on_one_thread_of_its_own(tmp_path, monkeypatch):
    """Ray Data builds the replica on the actor's main thread and calls it from another; torch work on
    both would make two OpenMP teams, more threads than CPUs, and libgomp would stop spin-waiting."""
    import moelight.jobs.serving
    from moelight.engine.session import EngineSession
    from moelight.jobs.ray.ray_job import opts_fields
    from moelight.jobs.ray.replica import MoelightReplica
    from workloads.request import Request

    seen: dict[str, int] = {}
    load, generate = EngineSession.load, moelight.jobs.serving.generate_prepared
    monkeypatch.setattr(EngineSession, "load", lambda self, *a: (seen.setdefault("load", threading.get_ident()),
                                                             load(self, *a))[1])
    monkeypatch.setattr(moelight.jobs.serving, "generate_prepared", lambda *a, **k: (
        seen.setdefault("generate", threading.get_ident()), generate(*a, **k))[1])
    opts = RunOptions(dataset=tmp_path / "unused.jsonl", output=tmp_path / "o.jsonl", **ENGINE)
    replica = MoelightReplica(opts_fields(opts), num_cpus=1)
    rows = [Request(id=f"r{i}", prompt=f"hello {i}", source=f"x:{i}").to_row() for i in range(3)]
    out: dict = {}
    caller = threading.Thread(target=lambda: out.update(replica({k: [r[k] for r in rows] for k in rows[0]})))
    caller.start()
    caller.join(120)
    assert out["id"] == ["r0", "r1", "r2"]
    assert seen["load"] == seen["generate"]
    assert seen["load"] not in (threading.get_ident(), caller.ident)


def test_openai_batch_and_parquet_keep_the_local_shapes(cluster, tmp_path):
    batch = tmp_path / "batch.jsonl"
    with open(batch, "w") as f:
        for i in range(6):
            f.write(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
                                "body": {"model": "tiny", "messages": [{"role": "user", "content": f"hi {i}"}],
                                         "max_tokens": 8}}) + "\n")
    outs = {}
    for name, extra in (("local", {}), ("ray", {"ray": "local"})):
        out = tmp_path / f"{name}.jsonl"
        run_job(RunOptions(dataset=batch, output=out, **ENGINE, **extra))
        lines = [json.loads(line) for line in out.read_text().splitlines()]
        outs[name] = {r["custom_id"]: (sorted(r), r["response"]["body"]["choices"][0]["message"]["content"])
                      for r in lines}
    assert outs["ray"] == outs["local"]
    import pyarrow.parquet as pq

    for name, extra in (("local", {}), ("ray", {"ray": "local"})):
        run_job(RunOptions(dataset=tmp_path / "batch.jsonl", output=tmp_path / f"{name}.parquet", **ENGINE, **extra))
    local, remote = (pq.read_table(tmp_path / f"{n}.parquet") for n in ("local", "ray"))
    assert local.schema.names == remote.schema.names
    key = sorted(zip(local.column("id").to_pylist(), local.column("output").to_pylist(), strict=True))
    assert sorted(zip(remote.column("id").to_pylist(), remote.column("output").to_pylist(), strict=True)) == key


def test_sampling_fields_travel_through_ray_as_locally(cluster, tmp_path):
    """n samples, stop strings, seeds, penalties, logprobs, prompt_logprobs and a JSON response format
    reach the replicas, and their records come back whole."""
    extra = {"n": 2, "temperature": 0.9, "seed": 5, "stop": ["ea"], "logprobs": 2, "prompt_logprobs": 1,
             "presence_penalty": 0.5, "max_tokens": 8}
    data = _prompts(tmp_path / "p.jsonl", 5, extra)
    with open(data, "a") as f:
        f.write(json.dumps({"id": "js", "prompt": "a JSON object:", "max_tokens": 12,
                            "response_format": {"type": "json_object"}}) + "\n")
    outs = {}
    for name, more in (("local", {}), ("ray", {"ray": "local"})):
        out = tmp_path / f"{name}.jsonl"
        run_job(RunOptions(dataset=data, output=out, **ENGINE, **more))
        outs[name] = {r["id"]: {k: v for k, v in r.items() if k != "model"}
                      for r in map(json.loads, out.read_text().splitlines())}
    assert outs["ray"] == outs["local"]
    r0 = outs["ray"]["r0"]
    assert len(r0["outputs"]) == 2 and r0["outputs"][0]["logprobs"] and r0["prompt_logprobs"]


def test_the_processor_runs_a_ray_dataset(cluster, job):
    from moelight.ray import ProcessorConfig, build_processor

    data, local = job
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    config = ProcessorConfig(model="tiny", engine_options={"load_format": "dummy", "dtype": "float32",
                                                           "hardware": "cpu-server"},
                             sampling={"gen_len": 12}, replicas=2, batch_size=8)
    processor = build_processor(config, preprocess=lambda row: {"id": row["key"], "prompt": row["text"]},
                                postprocess=lambda row: {"key": row["id"], "tokens": list(row["output_token_ids"])})
    ds = ray.data.from_items([{"key": r["id"], "text": r["prompt"]} for r in rows])
    got = {r["key"]: r["tokens"] for r in processor(ds).take_all()}
    assert got == local


def test_ray_options_are_checked_first(tmp_path):
    data = _prompts(tmp_path / "p.jsonl", 2)
    base = dict(dataset=data, output=tmp_path / "o.jsonl", **ENGINE)
    for extra, message in (({"ray_replicas": "3-1"}, "1 <= MIN <= MAX"), ({"ray_replicas": "x"}, "a count"),
                           ({"gpus": 2}, "one device"), ({"ray_cpus_per_replica": -1}, ">= 0")):
        with pytest.raises(OptionError, match=message):
            replace(RunOptions(**base), ray="local", **extra).validate()
    coe = tmp_path / "coe.json"
    coe.write_text(json.dumps({"models": {"a": "tiny"}, "router": {"default": "a"}}))
    with pytest.raises(OptionError, match="CoE"):
        RunOptions(**(base | {"model": str(coe)}), ray="local").validate()


def test_ray_without_an_address_starts_a_local_cluster():
    assert with_ray_default(["run", "--ray", "--ray-replicas", "2"]) == ["run", "--ray", "local", "--ray-replicas", "2"]
    assert with_ray_default(["run", "--ray"]) == ["run", "--ray", "local"]
    assert with_ray_default(["run", "--ray", "auto"]) == ["run", "--ray", "auto"]


def test_the_processor_answers_the_good_rows_beside_a_bad_one_when_asked(cluster, job):
    """A prompt longer than the context: without should_continue_on_error the dataset fails with an
    error naming that option (not the CLI's --skip-bad-lines); with it, the bad row comes back with its
    error in __inference_error__, past postprocess, and every other row is answered as locally."""
    from moelight.ray import ProcessorConfig, build_processor

    data, local = job
    rows = [json.loads(line) for line in data.read_text().splitlines()][:6] + [{"id": "long", "prompt": "x " * 5000}]
    kept = {r["id"]: local[r["id"]] for r in rows[:6]}
    engine = {"load_format": "dummy", "dtype": "float32", "hardware": "cpu-server"}
    post = lambda row: {"key": row["id"], "tokens": list(row["output_token_ids"])}  # noqa: E731
    strict = build_processor(ProcessorConfig(model="tiny", engine_options=engine, sampling={"gen_len": 12},
                                             batch_size=8), postprocess=post)
    with pytest.raises(Exception, match=r"should_continue_on_error=True") as e:
        strict(ray.data.from_items(rows)).take_all()
    assert "row id long: prompt has" in str(e.value) and "--skip-bad-lines" not in str(e.value)
    lenient = build_processor(ProcessorConfig(model="tiny", engine_options=engine, sampling={"gen_len": 12},
                                              batch_size=8, should_continue_on_error=True), postprocess=post)
    out = lenient(ray.data.from_items(rows)).take_all()
    bad = [r for r in out if r["__inference_error__"]]
    assert len(bad) == 1 and bad[0]["id"] == "long" and "prompt has" in bad[0]["__inference_error__"]
    assert {r["key"]: r["tokens"] for r in out if not r["__inference_error__"]} == kept
