"""A tensor-parallel job through the front ends: `moelight run --gpus N` spawns its ranks (or
torchrun starts them), rank 0 alone writes the results, every rank takes rank 0's sampled tokens,
and a failing rank ends the job with one error while every finished result stays on disk, whether
its peers' collectives fail (gloo) or wait for an abort (NCCL's behaviour, emulated)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

pytest.importorskip("transformers")

from moelight import LLM, SamplingParams  # noqa: E402
from moelight.cli import app  # noqa: E402
from moelight.parallel import TensorParallelError  # noqa: E402
from moelight.pipeline.pipeline_executor import PipelineExecutor  # noqa: E402
from tests.checkpoints import make_hf_model, save_checkpoint  # noqa: E402
from tests.cli_text import says  # noqa: E402
from tests.test_cli_run import read_jsonl, report_of, write_jsonl  # noqa: E402

# 8 heads, 4 KV heads, expert width 48: 2 and 4 ranks divide it, 3 does not
SHAPE = dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=4, intermediate_size=48,
             num_hidden_layers=2, vocab_size=320)
JOB = ["--hardware", "t4", "--device", "emulated", "--dtype", "float32", "--gen-len", "6", "--ignore-eos",
       "--temperature", "0", "--no-progress"]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """A checkpoint, a prompt file, and the single-device results of the job."""
    root = tmp_path_factory.mktemp("tp_job")
    ckpt = save_checkpoint(make_hf_model(seed=4, **SHAPE), root / "ckpt")
    records = [{"id": f"q{i}", "prompt": "Name a prime number " + "and another " * i} for i in range(7)]
    data = write_jsonl(root / "prompts.jsonl", records)
    ref = _run(root / "ref.jsonl", ckpt, data, "--gpus", "1")
    assert ref.exit_code == 0, ref.output
    return ckpt, data, _tokens(root / "ref.jsonl")


def _run(out: Path, ckpt: Path, data: Path, *extra: str):
    args = ["run", "--dataset", str(data), "--model", str(ckpt), "--output", str(out), *JOB, *extra]
    return CliRunner().invoke(app, args)


def _tokens(path: Path) -> dict[str, list[int]]:
    return {r["id"]: r["output_token_ids"] for r in read_jsonl(path)}


@pytest.mark.parametrize("n", [2, 4])
def test_ranks_write_the_single_device_results(tmp_path, job, n):
    ckpt, data, ref = job
    res = _run(tmp_path / "out.jsonl", ckpt, data, "--gpus", str(n))
    assert res.exit_code == 0, res.output
    assert _tokens(tmp_path / "out.jsonl") == ref
    assert report_of(tmp_path / "out.jsonl")["policy"]["tensor_parallel"] == n
    assert says(res.output, f"tensor parallel over {n} ranks")


def test_a_rank_count_that_does_not_divide_the_model_is_refused_before_loading(tmp_path, job):
    ckpt, data, _ = job
    res = _run(tmp_path / "out.jsonl", ckpt, data, "--gpus", "3")
    assert res.exit_code == 2
    assert says(res.output, "needs 3 to divide the model's attention heads 8, KV heads 4")
    assert says(res.output, "use --gpus with one of 1, 2, 4")
    assert not (tmp_path / "out.jsonl").exists()


@pytest.mark.parametrize("collectives", ["fail", "block"])
def test_a_follower_failing_mid_job_ends_it_and_keeps_finished_results(tmp_path, job, monkeypatch, collectives):
    """With "block", rank 0's all-reduce with the dead rank waits as NCCL's does (for the group's
    timeout, 120 s here): only rank 0's monitor, aborting the communicator, ends it in time."""
    ckpt, data, ref = job
    out = tmp_path / "out.jsonl"
    monkeypatch.setenv("MOELIGHT_TP_FAULT", "1:decode:8")  # rank 1 dies in its 8th decode pass
    if collectives == "block":
        monkeypatch.setenv("MOELIGHT_TP_BLOCKING_COLLECTIVES", "1")
        monkeypatch.setenv("MOELIGHT_TP_TIMEOUT", "120")
    t0 = time.perf_counter()
    res = _run(out, ckpt, data, "--gpus", "2", "--batch-size", "2")
    assert time.perf_counter() - t0 < 100  # ended by the abort, not by the collective's timeout
    assert res.exit_code == 2, res.output
    assert says(res.output, "tensor-parallel rank 1 of 2 failed: RuntimeError: fault injected")
    assert "Traceback" not in res.output
    done = _tokens(out)
    assert 0 < len(done) < len(ref)  # the first batch finished and is on disk
    assert all(ref[i] == t for i, t in done.items())
    if collectives == "block":
        return  # what is on disk is the same as with "fail": resuming it once proves the resume
    monkeypatch.delenv("MOELIGHT_TP_FAULT")
    res = _run(out, ckpt, data, "--gpus", "2", "--resume")
    assert res.exit_code == 0, res.output
    assert _tokens(out) == ref and len(read_jsonl(out)) == len(ref)  # every id once


@pytest.mark.parametrize("collectives", ["fail", "block"])
def test_a_follower_killed_by_a_signal_is_named_with_its_signal(tmp_path, job, monkeypatch, collectives):
    """kill -9 (or the OOM killer): the rank cannot report its error; rank 0 names it by its exit code
    rather than re-raising its own broken collective (gloo's "Connection reset by peer")."""
    ckpt, data, ref = job
    out = tmp_path / "out.jsonl"
    monkeypatch.setenv("MOELIGHT_TP_FAULT", "1:decode:8:kill")
    if collectives == "block":
        monkeypatch.setenv("MOELIGHT_TP_BLOCKING_COLLECTIVES", "1")
        monkeypatch.setenv("MOELIGHT_TP_TIMEOUT", "120")
    res = _run(out, ckpt, data, "--gpus", "2", "--batch-size", "2")
    assert res.exit_code == 2, res.output
    assert says(res.output, "tensor-parallel rank 1 of 2 failed: killed by SIGKILL (exit code -9)")
    assert "Traceback" not in res.output
    done = _tokens(out)
    assert 0 < len(done) < len(ref) and all(ref[i] == t for i, t in done.items())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_on_gpus_a_dead_follower_is_caught_by_the_monitor_not_ncc_ls_watchdog(tmp_path, job, monkeypatch):
    """Over NCCL a collective with a dead rank waits; rank 0's monitor aborts the communicator."""
    ckpt, data, _ = job
    gpu = [a if a != "emulated" else "cuda" for a in JOB]
    ok = CliRunner().invoke(app, ["run", "--dataset", str(data), "--model", str(ckpt), "--output",
                                  str(tmp_path / "ref.jsonl"), *gpu, "--gpus", "2", "--batch-size", "2"])
    assert ok.exit_code == 0, ok.output
    ref = _tokens(tmp_path / "ref.jsonl")
    monkeypatch.setenv("MOELIGHT_TP_FAULT", "1:decode:8")
    monkeypatch.setenv("MOELIGHT_TP_TIMEOUT", "300")
    t0 = time.perf_counter()
    res = CliRunner().invoke(app, ["run", "--dataset", str(data), "--model", str(ckpt), "--output",
                                   str(tmp_path / "out.jsonl"), *gpu, "--gpus", "2", "--batch-size", "2"])
    assert time.perf_counter() - t0 < 200 and res.exit_code == 2, res.output
    assert says(res.output, "tensor-parallel rank 1 of 2 failed: RuntimeError: fault injected")
    done = _tokens(tmp_path / "out.jsonl")
    assert 0 < len(done) < len(ref) and all(ref[i] == t for i, t in done.items())


def test_followers_take_rank_0s_tokens(tmp_path, job, monkeypatch):
    """Rank 1's logits made to prefer other tokens: it still decodes rank 0's tokens (else its
    hidden states, and so the all-reduced sums, would go astray)."""
    ckpt, data, ref = job
    monkeypatch.setenv("MOELIGHT_TP_FAULT", "1:logits")
    res = _run(tmp_path / "out.jsonl", ckpt, data, "--gpus", "2")
    assert res.exit_code == 0, res.output
    assert _tokens(tmp_path / "out.jsonl") == ref


def test_spawned_ranks_use_their_own_gpu_whatever_an_outer_launcher_set(monkeypatch):
    """LOCAL_RANK inherited from an outer launcher must not put every spawned rank on one GPU."""
    import moelight.parallel.rank_group as rank_group

    monkeypatch.setenv("LOCAL_RANK", "0")
    seen = []
    monkeypatch.setattr(rank_group.dist, "init_process_group", lambda *a, **k: None)
    monkeypatch.setattr(rank_group.dist, "new_group", lambda *a, **k: object())
    for rank, init in ((1, "tcp://127.0.0.1:1"), (1, None)):
        seen.append(rank_group.join_group("emulated", rank, 2, init).torch_device_index)
    assert seen == [1, 0]  # spawned: its rank; torchrun's: its LOCAL_RANK


def test_the_api_keeps_its_ranks_across_calls_and_a_rank_0_failure_ends_them(job, monkeypatch):
    ckpt, _, _ = job
    llm = LLM(str(ckpt), gpus=2, device="emulated", hardware="t4", dtype="float32")
    one = LLM(str(ckpt), gpus=1, device="emulated", hardware="t4", dtype="float32")
    try:
        params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
        for prompts in (["Hello there", "What is 2+2?"], ["A longer prompt " * 4, "x", "yes or no"]):
            got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
            assert got == [o.outputs[0].token_ids for o in one.generate(prompts, params)]
        followers = list(llm.session.group.processes)
        assert len(followers) == 1 and followers[0].is_alive()
        from moelight.parallel.sharding import TensorParallelError

        with pytest.raises(TensorParallelError, match="already open in this process"):  # and the first one lives
            LLM(str(ckpt), gpus=2, device="emulated", hardware="t4", dtype="float32")
        got = [o.outputs[0].token_ids for o in llm.generate(["x"], params)]
        assert got == [o.outputs[0].token_ids for o in one.generate(["x"], params)]

        def broken(self, *args, **kwargs):
            raise RuntimeError("rank 0 broke")

        monkeypatch.setattr(PipelineExecutor, "decode", broken)  # this process only: rank 0
        t0 = time.perf_counter()
        with pytest.raises(RuntimeError, match="rank 0 broke"):
            llm.generate(["Hello there"], params)
        llm.close()
        assert time.perf_counter() - t0 < 30
        assert not followers[0].is_alive()  # ended, though it was waiting in a collective
    finally:
        llm.close()
        one.close()


def test_torchrun_starts_the_ranks(tmp_path, job):
    ckpt, data, ref = job
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port),
           "-m", "moelight", "run", "--dataset", str(data), "--model", str(ckpt), "--output",
           str(tmp_path / "out.jsonl"), *JOB]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _tokens(tmp_path / "out.jsonl") == ref
    assert report_of(tmp_path / "out.jsonl")["policy"]["tensor_parallel"] == 2
    assert proc.stdout.count("results:") == 1  # rank 1 served rank 0's job and wrote nothing


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_torchrun_peer_that_never_comes_ends_the_wait_in_time_and_sigterm_stops_it(tmp_path, job):
    """RANK and WORLD_SIZE inherited from an outer launcher (or a torchrun peer that never started):
    rank 0 says where it waits, gives up after the rendezvous timeout (not the 2-hour load timeout)
    with an error that says what to do, and SIGTERM stops it while it waits."""
    ckpt, data, _ = job
    port = _free_port()
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    cmd = [sys.executable, "-m", "moelight", "run", "--dataset", str(data), "--model", str(ckpt), *JOB]
    out = tmp_path / "a.jsonl"
    proc = subprocess.run([*cmd, "--output", str(out)], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                          env={**env, "MOELIGHT_TP_RENDEZVOUS_TIMEOUT": "3"})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert says(proc.stderr, f"waiting for the other 1 rank(s) at 127.0.0.1:{port}")
    assert says(proc.stderr, f"waited 3 s at 127.0.0.1:{port} and not every rank came")
    assert says(proc.stderr, "unset RANK and WORLD_SIZE") and "Traceback" not in proc.stderr

    out, log = tmp_path / "b.jsonl", tmp_path / "b.log"
    with open(log, "w") as f:
        waiting = subprocess.Popen([*cmd, "--output", str(out)], cwd=tmp_path, stdout=f, stderr=f, env=env)
    try:
        deadline = time.monotonic() + 90
        while "waiting for" not in log.read_text() and time.monotonic() < deadline and waiting.poll() is None:
            time.sleep(0.2)
        waiting.send_signal(signal.SIGTERM)
        assert waiting.wait(timeout=30) == 143, log.read_text()
    finally:
        waiting.kill()
    assert says(log.read_text(), "interrupted before any result was written")
    assert not Path(f"{out}.lock").exists()


def test_a_spawned_rank_that_dies_starting_ends_the_wait_at_once_and_names_the_main_guard(tmp_path, job):
    """A script without a `__main__` guard: each spawned rank re-runs it and dies in multiprocessing's
    bootstrapping; rank 0 stops waiting as soon as the rank has exited, with its exit code and the cause."""
    ckpt, _, _ = job
    script = tmp_path / "no_guard.py"
    script.write_text("from moelight import LLM\n"
                      f"LLM({str(ckpt)!r}, gpus=2, device='emulated', hardware='t4', dtype='float32')\n")
    t0 = time.monotonic()
    env = {**os.environ, "MOELIGHT_TP_RENDEZVOUS_TIMEOUT": "60",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env=env)
    assert proc.returncode != 0 and time.monotonic() - t0 < 40, proc.stderr
    assert "TensorParallelError" in proc.stderr
    assert "the spawned rank 1 exited with code 1 while starting" in proc.stderr
    assert 'if __name__ == "__main__":' in proc.stderr.splitlines()[-1]


def test_torchrun_world_and_gpus_must_agree(monkeypatch):
    from moelight.engine.options import EngineOptions
    from moelight.engine.session import tensor_parallel_degree

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert tensor_parallel_degree(EngineOptions("tiny"), "emulated") == 2
    with pytest.raises(TensorParallelError, match="torchrun started 2 ranks but --gpus is 4"):
        tensor_parallel_degree(EngineOptions("tiny", gpus=4), "emulated")
    with pytest.raises(TensorParallelError, match="runs on --device cuda or emulated"):
        tensor_parallel_degree(EngineOptions("tiny"), "cpu")


def test_ranks_load_their_shards_at_once_within_one_copy_of_the_model(job, monkeypatch):
    """Each rank reads only what its shard needs into memory: the host needs the model once, and
    a host that cannot hold it is told before any rank starts."""
    import moelight.parallel.rank_group as rank_group
    import moelight.planning.memory_check as memory
    from moelight.loading.model_source import resolve_model
    from moelight.planning.memory_check import OutOfMemoryPlan, weight_bytes

    ckpt, _, _ = job
    src = resolve_model(str(ckpt), "auto", "float32")
    need = weight_bytes(src.config, src.dtype) / memory.HEADROOM
    monkeypatch.setattr(memory, "available_bytes", lambda: int(1.2 * need))
    llm = LLM(str(ckpt), gpus=2, device="emulated", hardware="t4", dtype="float32")
    llm.close()
    monkeypatch.setattr(memory, "available_bytes", lambda: int(0.8 * need))
    started = []
    monkeypatch.setattr(rank_group, "start_group", lambda *a: started.append(a))
    with pytest.raises(OutOfMemoryPlan, match="does not fit in CPU memory"):
        LLM(str(ckpt), gpus=2, device="emulated", hardware="t4", dtype="float32")
    assert not started


@pytest.fixture(scope="module")
def wide_job(tmp_path_factory):
    """A checkpoint whose expert width (64) leaves each of 2 ranks a whole int4 group of 32 columns."""
    root = tmp_path_factory.mktemp("tp_quantized")
    ckpt = save_checkpoint(make_hf_model(seed=5, **{**SHAPE, "intermediate_size": 64}), root / "ckpt")
    records = [{"id": f"q{i}", "prompt": "List three colours " + "then two more " * i} for i in range(5)]
    return ckpt, write_jsonl(root / "prompts.jsonl", records)


# the experts on the devices, half of them paged each layer pass (as codes), two micro-batches
PAGED = {"batch_size": 6, "micro_batch_size": 3, "num_micro_batches": 2, "attn_on_gpu": False,
         "ffn_on_gpu": True, "r_w": 0.5, "r_c": 0.0, "dtype": "float32"}


@pytest.mark.parametrize("method, policy", [("int8", None), ("int4-g32", PAGED)])
def test_quantized_experts_over_ranks_write_the_single_device_quantized_results(tmp_path, wide_job, method, policy):
    """--quantize with --gpus 2: each rank holds its part of the experts' codes (int4 in groups of 32,
    which the ranks' 32 columns fit) and the job writes the tokens one device writes with the same
    codes: under the planner's policy (the FFN on the host here), and with the experts on the devices,
    half of them paged as codes."""
    import json

    ckpt, data = wide_job
    extra = ()
    if policy is not None:
        (tmp_path / "policy.json").write_text(json.dumps(policy))
        extra = ("--policy", str(tmp_path / "policy.json"))
    one = _run(tmp_path / "one.jsonl", ckpt, data, "--gpus", "1", "--quantize", method, *extra)
    assert one.exit_code == 0, one.output
    two = _run(tmp_path / "two.jsonl", ckpt, data, "--gpus", "2", "--quantize", method.split("-")[0], *extra)
    assert two.exit_code == 0, two.output
    held = "int8" if method == "int8" else "uint4 (--quantize int4 (group 32))"
    assert says(two.output, f"routed experts held as {held}")
    assert _tokens(tmp_path / "two.jsonl") == _tokens(tmp_path / "one.jsonl")
    report = report_of(tmp_path / "two.jsonl")
    assert report["policy"]["tensor_parallel"] == 2
    if policy is not None:
        assert report["policy"]["ffn_on_gpu"] and report["policy"]["r_w"] == 0.5, report["policy"]
