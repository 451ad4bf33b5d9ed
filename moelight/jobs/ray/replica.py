"""One moelight engine per Ray actor: the model loads once, every batch Ray hands it is one job.

`map_batches(MoelightReplica, ...)` builds one per pool slot. A batch (the planner's N requests,
or --batch-size) arrives as Arrow request rows, is generated with the same code as a local run
(`jobs.serving.prepare_requests` / `generate_prepared`) and returns as result rows; the batch's
report rides on its first row so the driver can report per replica. The driver's solved policy
is reused when this replica plans for the same hardware spec and device (the MILP would only
solve the same problem again); otherwise the replica plans its own.

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

from moelight.jobs import serving
from moelight.jobs.prompts import check_prompts, prompt_error
from moelight.jobs.run_options import RunOptions
from moelight.sampling.checks import SamplingChecker
from workloads import Request
from workloads.results import result_to_row


def request_rows(batch) -> list[Request]:
    """A batch of request rows (a pyarrow Table from Ray Data, or a dict of columns) -> Requests."""
    if hasattr(batch, "to_pylist"):
        return [Request.from_row(row) for row in batch.to_pylist()]
    names = list(batch)
    n = len(batch[names[0]]) if names else 0
    return [Request.from_row({k: batch[k][i] for k in names}) for i in range(n)]


class _Collect:
    """A writer that keeps results in memory: the driver writes them once."""

    def __init__(self) -> None:
        self.results: list[dict] = []

    def write(self, result: dict) -> None:
        self.results.append(result)


class MoelightReplica:
    """A Ray Data actor: `__init__` resolves the model and loads its weights, `__call__` runs a batch.

    Bad requests (a prompt too long, a sampling field out of range) are the driver's business under
    `moelight run --ray`, which checks every prompt first. The processor (moelight/ray/) checks them
    here: `error_rows` returns each as a row with its error in ERROR_COLUMN, beside the batch's
    answers; `bad_row_remedy` is the way past them that its PromptError names."""

    def __init__(self, opts_fields: dict, num_cpus: float | None = None, driver_plan: dict | None = None,
                 error_rows: bool = False, bad_row_remedy: str | None = None) -> None:
        self.engine_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moelight-engine")
        self.opts = replace(RunOptions(**opts_fields), progress=False, log=None)
        self.error_rows, self.bad_row_remedy = error_rows, bad_row_remedy
        if error_rows or bad_row_remedy:  # the bad ones come back from prepare_requests, not raised there
            self.opts = replace(self.opts, skip_bad_lines=True)
        self.engine_thread.submit(self._load, num_cpus, driver_plan).result()

    def _load(self, num_cpus: float | None, driver_plan: dict | None) -> None:
        import torch

        from moelight.engine.session import EngineSession

        if num_cpus:
            torch.set_num_threads(max(1, int(num_cpus)))
        self.session = EngineSession(self.opts)
        self.solved = _reusable(driver_plan, self.opts, self.session.device)
        self.session.load()
        self.replica = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self.threads = torch.get_num_threads()

    def __call__(self, batch) -> dict:
        return self.engine_thread.submit(self._generate, batch).result()

    def _generate(self, batch) -> dict:
        job = serving.prepare_requests(self.session, self.opts, request_rows(batch), solved=self.solved)
        if job.skipped and not self.error_rows and self.bad_row_remedy:
            raise prompt_error(list(job.skipped.values()), self.bad_row_remedy)
        out = _Collect()
        if job.plan is not None:
            serving.generate_prepared(self.session, self.opts, job, out)
        job.report.close(self.session)
        summary = json.dumps(job.report.to_dict() | {"threads": self.threads,
                                                     "load_seconds": self.session.load_seconds})
        rows = [result_to_row(r) for r in out.results]
        errors = [""] * len(rows)
        if self.error_rows:
            rows += [result_to_row(_EMPTY | {"id": rid, "finish_reason": "error"}) for rid in job.skipped]
            errors += list(job.skipped.values())
        n = len(rows)
        columns = {k: [r[k] for r in rows] for k in (rows[0] if rows else result_to_row(_EMPTY))}
        if self.error_rows:
            columns[ERROR_COLUMN] = errors
        return columns | {"replica": [self.replica] * n, "batch_report": [summary] + [""] * (n - 1)}


ERROR_COLUMN = "__inference_error__"  # Ray Data LLM's name: "" on an answered row, the error on a bad one
_EMPTY = {"id": "", "output": "", "output_token_ids": [], "finish_reason": "stop", "prompt_tokens": 0,
          "completion_tokens": 0}


def _reusable(driver_plan: dict | None, opts, device: str):
    """The driver's solved policy when this replica would plan for the same hardware and device."""
    if not driver_plan:
        return None
    from moelight.planning.hardware_choice import hardware_for_device
    from optimizer import Policy

    mine = hardware_for_device(opts.hardware, device, host_in_use=driver_plan.get("host_in_use", 0))
    if opts.gpus is not None:
        mine = mine.with_gpus(opts.gpus)
    if device != driver_plan["device"] or mine.to_dict() != driver_plan["hardware"]:
        return None
    return Policy.from_dict(driver_plan["policy"])


class PromptChecker:
    """A Ray Data task pool that tokenizes every request (no weights) and returns the bad ones, so a
    prompt that cannot run is reported before any replica loads a model."""

    def __init__(self, opts_fields: dict) -> None:
        from moelight.loading.resolved_model import resolve

        self.opts = replace(RunOptions(**opts_fields), progress=False, log=None)
        resolved = resolve(self.opts.model, self.opts.load_format, self.opts.dtype, self.opts.tokenizer)
        self.tokenizer, self.context = resolved.tokenizer, resolved.config.context_length
        self.checker = SamplingChecker(resolved.tokenizer, resolved.config.vocab_size, resolved.eos)

    def __call__(self, batch) -> dict:
        _, _, problems = check_prompts(request_rows(batch), self.tokenizer, self.context, self.opts,
                                       checker=self.checker)
        return {"id": [rid for rid, _ in problems], "problem": [m for _, m in problems]}
