"""One moelight engine per Ray actor: the model loads once, every batch Ray hands it is one job.

`map_batches(MoelightReplica, ...)` builds one per pool slot. A batch (the planner's N requests,
or --batch-size) is planned for the resources Ray gave the actor (its CPUs set torch's threads on
a CPU-only actor; a GPU actor plans for the device it sees), generated with the same code as a
local run (`runner.prepare_requests` / `generate_prepared`), and returned as result rows; the
batch's report rides on its first row so the driver can report per replica.

Every torch call of a replica runs on one thread of its own. Ray Data constructs the class on the
actor's main thread and calls it from another; torch work on both would give the process two
OpenMP teams, more threads than the CPUs Ray granted, and libgomp then stops spin-waiting between
parallel regions: each region's threads sleep and wake (~10k context switches/s), which cost the
engine ~30% of its decode rate in an actor on a 2-CPU host.
"""

from __future__ import annotations

import json
import os
import socket
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from moelight.jobs.ray.ray_dataset import request_from_json

RESULT_COLUMNS = ("id", "result", "replica", "batch_report")


def _options(opts_fields: dict):
    from moelight.jobs.dataset_job import RunOptions

    return RunOptions(**opts_fields)


class _Collect:
    """A writer that keeps results in memory: the driver writes them once."""

    def __init__(self) -> None:
        self.results: list[dict] = []

    def write(self, result: dict) -> None:
        self.results.append(result)


class MoelightReplica:
    """A Ray Data actor: `__init__` resolves the model and loads its weights, `__call__` runs a batch."""

    def __init__(self, opts_fields: dict, num_cpus: float | None = None) -> None:
        self.engine_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moelight-engine")
        self.opts = replace(_options(opts_fields), progress=False, log=None)
        self.engine_thread.submit(self._load, num_cpus).result()

    def _load(self, num_cpus: float | None) -> None:
        import torch

        from moelight.engine.session import EngineSession

        if num_cpus:
            torch.set_num_threads(max(1, int(num_cpus)))
        self.session = EngineSession(self.opts)
        self.session.load()
        self.replica = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self.threads = torch.get_num_threads()

    def __call__(self, batch: dict) -> dict:
        return self.engine_thread.submit(self._generate, batch).result()

    def _generate(self, batch: dict) -> dict:
        from moelight.jobs.dataset_job import generate_prepared, prepare_requests
        from moelight.planning.memory_check import peak_rss_bytes

        requests = [request_from_json(text) for text in batch["request"]]
        job = prepare_requests(self.session, self.opts, requests)
        out = _Collect()
        if job.plan is not None:
            generate_prepared(self.session, self.opts, job, out)
        report = job.report
        report.cache = self.session.cache_stats()
        report.peak_memory_bytes = peak_rss_bytes()
        summary = json.dumps(report.to_dict() | {"threads": self.threads, "load_seconds": self.session.load_seconds})
        n = len(out.results)
        return {"id": [r["id"] for r in out.results], "result": [json.dumps(r) for r in out.results],
                "replica": [self.replica] * n, "batch_report": [summary] + [""] * (n - 1)}


class PromptChecker:
    """A Ray Data task pool that tokenizes every request (no weights) and returns the bad ones, so a
    prompt that cannot run is reported before any replica loads a model."""

    def __init__(self, opts_fields: dict) -> None:
        from moelight.engine.session import EngineSession

        self.opts = replace(_options(opts_fields), progress=False, log=None)
        session = EngineSession(self.opts)  # resolves config and tokenizer, loads nothing
        self.tokenizer, self.context = session.tokenizer, session.config.max_position_embeddings

    def __call__(self, batch: dict) -> dict:
        from moelight.jobs.dataset_job import check_prompts

        requests = [request_from_json(text) for text in batch["request"]]
        _, _, problems = check_prompts(requests, self.tokenizer, self.context, self.opts)
        return {"id": [rid for rid, _ in problems], "problem": [m for _, m in problems]}
