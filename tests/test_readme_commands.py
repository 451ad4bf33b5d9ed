"""Every command block of the README runs as written, at small sizes, on a host without a GPU.

Blocks marked ```text are synopses (placeholders, not commands); ```bash and ```python blocks are
run here with the substitutions below (tiny presets and small sizes for the paper's models; the
committed trained model for a user's `DIR`; small files for the user's datasets). The two
commands of "Two commands on a fresh machine" are run for their `moelight` part: installing is
`.ci/run`'s business, and the test command is this suite.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from moelight.cli import app, with_ray_default

pytestmark = pytest.mark.no_race_check  # the README runs; ordering: the runtimes' own tests

ROOT = Path(__file__).resolve().parents[1]
TRAINED = ROOT / "tests" / "data" / "stdlib-moe"
# README text -> what runs here (each a whole word or option value)
SUBSTITUTIONS = [
    ("--num-requests 256", "--num-requests 6"), ("--gen-len 64", "--gen-len 3"), ("--gen-len 256", "--gen-len 3"),
    ("bench-1b", "tiny"), ("/models/Mixtral-8x7B-v0.1", "tiny"), (" DIR ", f" {shlex.quote(str(TRAINED))} "),
    ("--num-cpus 16", "--num-cpus 2"), ("--ray-replicas 2-8", "--ray-replicas 1"),
    ("--ray-cpus-per-replica 8", "--ray-cpus-per-replica 1"),
    ("max_tokens=64", "max_tokens=3"), ("max_tokens=16", "max_tokens=3"), ("replicas=(1, 4)", "replicas=1"),
    ("num_cpus=8", "num_cpus=1"), ("batch_size=512", "batch_size=4"), ("gen_len\": 128", "gen_len\": 3"),
    # quoted: the clone's path may hold spaces
    (" workloads/examples/prompts.jsonl", f" {shlex.quote(str(ROOT / 'workloads' / 'examples' / 'prompts.jsonl'))}"),
]
SKIPPED = ("pip install", "python -m pytest")  # the install step and this very suite


def blocks() -> list[tuple[str, str]]:
    """(language, body) of every fenced block of the README, in order."""
    text = (ROOT / "README.md").read_text()
    return [(m.group(1), m.group(2)) for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M)]


def substituted(text: str) -> str:
    text = f" {text} "
    for a, b in SUBSTITUTIONS:
        text = text.replace(a, b)
    return text.strip()


def commands(body: str) -> list[str]:
    """Shell commands of a block: continuation lines joined, comments dropped, `a && b` split."""
    joined = re.sub(r"\\\n\s*", " ", body)
    out = []
    for line in joined.splitlines():
        line = line.split("  #")[0].strip()
        out += [c.strip() for c in line.split("&&") if c.strip()]
    return [c for c in out if not c.startswith(SKIPPED)]


def run_moelight(command: str) -> str:
    args = shlex.split(substituted(command))
    assert args[0] == "moelight", command
    res = CliRunner().invoke(app, with_ray_default(args[1:]))
    assert res.exit_code == 0, (command, res.output, res.exception)
    return res.output


def test_every_block_is_a_command_a_program_or_a_marked_synopsis():
    kinds = [lang for lang, _ in blocks()]
    assert set(kinds) <= {"bash", "python", "text"}, kinds
    assert kinds.count("text") == 1  # the CLI reference's synopsis


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """The user's files the README names, small: datasets, and their folders."""
    monkeypatch.chdir(tmp_path)
    code = ["def main():", "import os", "class Parser:", "for line in lines:", "return value"]
    for name in ("build.jsonl", "held.jsonl", "job.jsonl", "prompts.jsonl"):
        Path(name).write_text("".join(json.dumps({"prompt": p + f" # {name} {i}"}) + "\n"
                                      for i, p in enumerate(code)))
    Path("synth.jsonl").write_text(json.dumps({"prompt": "Name a color.", "n": 2, "temperature": 0.9, "stop": ["\n"],
                                               "max_tokens": 24, "structured_outputs": {"json": {
                                                   "type": "object", "properties": {"c": {"type": "integer"}},
                                                   "required": ["c"]}}}) + "\n")
    Path("tasks").mkdir()
    Path("mc.jsonl").write_text("".join(json.dumps({"q": q, "choices": [" a", " b"], "answer": i % 2}) + "\n"
                                        for i, q in enumerate(code)))
    Path("tasks/tiny_mc.yaml").write_text(f"""task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {tmp_path / 'mc.jsonl'}
output_type: multiple_choice
test_split: test
doc_to_text: "{{{{q}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
""")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    return tmp_path


def test_the_main_job_and_the_small_batch_commands_run(workdir):
    # every bash block but the cluster's (its own test) and the GPU's (it needs one: tests/test_gpu_smoke.py
    # runs the smoke benchmark's dry run)
    bash = [body for lang, body in blocks() if lang == "bash" and "ray start" not in body and "-m cuda" not in body]
    ran = 0
    for body in bash:
        for command in commands(body):
            run_moelight(command)
            ran += 1
    assert ran >= 8  # the main job; trace, trace, eamc, simulate-cache, run in latency mode; eval, a synthetic job
    assert Path("out/results.jsonl").is_file() and Path("out.jsonl").is_file() and Path("eamc.npz").is_file()
    assert "tiny_mc" in json.loads(Path("eval.json").read_text())["results"]
    assert len(json.loads(Path("synth_out.jsonl").read_text())["outputs"]) == 2
    assert any(Path("plots").iterdir())


def test_the_python_api_blocks_run(workdir):
    bodies = [body for lang, body in blocks() if lang == "python" and "build_processor" not in body]
    assert len(bodies) >= 2
    for body in bodies:
        exec(compile(substituted(body), "README.md", "exec"), {})  # noqa: S102 - the README's own examples


def test_the_cluster_commands_and_the_processor_run(workdir, monkeypatch):
    ray = pytest.importorskip("ray")
    import pyarrow as pa
    import pyarrow.parquet as pq

    bash = next(body for lang, body in blocks() if lang == "bash" and "ray start" in body)
    python = next(body for lang, body in blocks() if lang == "python" and "build_processor" in body)
    pq.write_table(pa.table({"qid": ["a", "b", "c"], "question": ["why?", "how?", "what?"]}), "questions.parquet")
    ray_cli = [sys.executable, "-m", "ray.scripts.scripts"]
    try:
        for command in commands(bash):
            if command.startswith("ray start"):
                args = shlex.split(substituted(command))[2:]
                subprocess.run([*ray_cli, "start", *args, "--include-dashboard", "false", "--disable-usage-stats"],
                               check=True, capture_output=True)
            else:
                run_moelight(command)
        assert len(Path("answers.jsonl").read_text().splitlines()) == 5
        monkeypatch.setenv("RAY_ADDRESS", "auto")
        exec(compile(substituted(python), "README.md", "exec"), {})  # noqa: S102 - the README's own example
        assert pq.read_table("answers/").num_rows == 3
    finally:
        ray.shutdown()
        subprocess.run([*ray_cli, "stop", "--force"], capture_output=True)
