"""`moelight run`: dataset in, results streamed out, report beside them.

Order matters for losing nothing: everything that can be checked without the model
(dataset, output file, tokenization, prompt lengths, memory) is checked first; each
finished request is written and flushed before the next batch starts; Ctrl-C closes the
writer and leaves a file that `--resume` continues. A job over several checkpoints (a CoE spec)
runs in coe_job.py, a job on a Ray cluster in ray/; both serve their requests as this one does.
"""

from __future__ import annotations

from pathlib import Path

from moelight.devices.device_base import DeviceOutOfMemory
from moelight.engine.session_start import open_session
from moelight.errors import MoelightError
from moelight.jobs.dataset_input import read_requests
from moelight.jobs.output_file import LazyResultWriter
from moelight.jobs.output_lock import output_lock
from moelight.jobs.report import RunReport
from moelight.jobs.run_options import RunOptions
from moelight.jobs.serving import serve_requests


class DeviceMemoryRunOut(MoelightError):
    """Device memory ran out mid-job, past the plan's check: one line on what to change, not a traceback."""


def run_job(opts: RunOptions) -> RunReport | None:
    """The job; None on a torchrun rank other than 0, which serves rank 0's job and writes nothing."""
    opts.validate()
    from moelight.parallel.rank_group import torchrun_rank

    rank = torchrun_rank()
    try:
        if rank is not None and rank[0] != 0:  # a follower rank writes nothing: rank 0 holds the output's lock
            return _run_job(opts)
        with output_lock(opts.output):
            return _run_job(opts)
    except DeviceOutOfMemory as e:
        kept = (f" and --resume: the results finished so far are kept in {opts.output}" if Path(opts.output).exists()
                else " (no result had finished: nothing was written)")
        raise DeviceMemoryRunOut(f"the job ran out of device memory: {e}; run it again with a smaller --batch-size, "
                                 f"--micro-batch-size or --max-prefill-tokens{kept}") from e


def _run_job(opts: RunOptions) -> RunReport | None:
    from moelight.jobs.coe_job import run_coe_job
    from moelight.jobs.run_options import is_coe_spec

    if is_coe_spec(opts.model):  # several checkpoints, one device: moelight/jobs/coe_job.py
        return run_coe_job(opts)
    if opts.ray is not None:  # a Ray Data pipeline of engines: moelight/jobs/ray/ray_job.py
        from moelight.jobs.ray.ray_job import run_ray_job

        return run_ray_job(opts)
    job = read_requests(opts)
    session = open_session(opts, opts.log)
    if session is None:
        return None
    with LazyResultWriter(opts, job.out_format, job.output.record) as writer:
        return serve_requests(session, opts, job.requests, job.skipped, writer, output=job.output,
                              refused=job.refused)
