"""`moelight run --ray`: the local job's contract (same results, resume, report) as a Ray Data pipeline.

    read and check records (the driver, or Ray tasks for a large file) -> check prompts and plan N
      (before any model loads) -> map_batches(MoelightReplica) over an actor pool
      -> the driver writes each result once

Exactly once: Ray Data retries a batch whose actor died on a restarted actor (its actor pools
run with max_restarts=-1, max_task_retries=-1) and emits a batch's rows only when its task
succeeds, so a killed replica's half-done batch never reaches the output; the driver is the one
writer and writes an id only once (the set of written ids starts from a resumed output's). Each
result is flushed as it arrives, so an interrupted job loses nothing and `--resume` continues it.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import fields, replace

from tqdm import tqdm

import workloads
from moelight.engine.session import EngineSession
from moelight.jobs.interrupt_flag import interrupt_flag
from moelight.jobs.output_file import LazyResultWriter, output_present, prepare_output, save_report
from moelight.jobs.prompts import check_prompts, prompt_error
from moelight.jobs.ray.ray_dataset import read_dataset
from moelight.jobs.ray.ray_report import RayRunReport, ReplicaFigures
from moelight.jobs.ray.replica import MoelightReplica, PromptChecker
from moelight.jobs.ray.resources import (
    configure_ray_data,
    connect,
    per_replica_resources,
    warn_if_pool_cannot_start,
)
from moelight.jobs.run_options import parse_replicas
from moelight.jobs.serving import describe_output
from moelight.loading.resolved_model import resolve
from moelight.sampling.checks import SamplingChecker
from workloads.results import result_from_row

PLAN_SAMPLE = 4096  # requests the driver plans the batch size N from
DRIVER_CHECK_MAX = PLAN_SAMPLE  # a job this small is checked and split by the driver itself
CHECK_BATCH = 1024  # requests per prompt-check task


def opts_fields(opts) -> dict:
    """The RunOptions a replica needs (no Ray options, no callables)."""
    skip = {"log", "ray", "ray_replicas", "ray_cpus_per_replica", "ray_gpus_per_replica"}
    return {f.name: getattr(opts, f.name) for f in fields(opts) if f.name not in skip}


class DriverPlan:
    """The driver's side of planning: the model resolved once (one tokenizer in this process), the
    batch size N for the job, and the solved policy the replicas may reuse."""

    def __init__(self, opts) -> None:
        self.opts = replace(opts, progress=False, log=None)
        self.resolved = resolve(opts.model, opts.load_format, opts.dtype, opts.tokenizer)
        self.checker = SamplingChecker(self.resolved.tokenizer, self.resolved.config.vocab_size, self.resolved.eos)
        self.plan = None

    def check(self, requests):
        """check_prompts on requests: (prompts, params, problems) as a local run finds them."""
        return check_prompts(requests, self.resolved.tokenizer, self.resolved.config.context_length,
                             self.opts, checker=self.checker)

    def batch_size(self, prompts, params, remaining: int, max_replicas: int) -> int:
        """The planner's N for checked prompts, no more than an even share of what is left, so every
        replica gets work."""
        if prompts and (self.opts.policy == "auto" or not self.opts.batch_size):
            session = EngineSession(self.opts, resolved=self.resolved)  # plans; loads nothing
            self.plan = session.plan(prompts, params, self.opts.turn)
        n = self.opts.batch_size or (self.plan.batch_size if self.plan else 1)
        return max(1, min(n, math.ceil(remaining / max_replicas)))

    def for_replicas(self) -> dict | None:
        """What a replica needs to reuse the solved policy (None: each replica plans its own)."""
        if self.plan is None or self.plan.solved is None or self.opts.policy != "auto":
            return None
        return {"policy": self.plan.solved.to_dict(), "hardware": self.plan.hardware.to_dict(),
                "device": self.plan.info["device"], "host_in_use": self.plan.info.get("host_in_use", 0)}


def check_all_prompts(opts, ds, fields_: dict):
    """Tokenize every request in Ray tasks (no weights); raise as a local run would, or drop them."""
    from ray.data import ActorPoolStrategy

    bad = ds.map_batches(PromptChecker, fn_constructor_kwargs={"opts_fields": fields_}, batch_size=CHECK_BATCH,
                         batch_format="pyarrow", compute=ActorPoolStrategy(size=1), num_cpus=1).take_all()
    if not bad:
        return ds, []
    if not opts.skip_bad_lines:
        raise prompt_error([r["problem"] for r in bad])
    bad_ids = {r["id"] for r in bad}
    return ds.filter(lambda r: r["id"] not in bad_ids), [r["problem"] for r in bad]


def checked_batches(opts, source, driver: DriverPlan, fields_: dict, max_replicas: int):
    """(dataset of one block per batch or None, requests in it, prompts dropped (why, by line), batch size N) for
    what `read_dataset` gave (Requests the driver parsed, or a lazy dataset of request rows).

    Bad prompts raise here, before any replica loads. One block per batch, in the object store
    before the engines start: the pool hands blocks to idle replicas, and an upstream task left to
    run beside them would wait for a CPU they hold. A job no bigger than the planner's sample is
    checked and split by the driver, which holds it already: Ray tasks would only add start-up.
    """
    import ray

    if isinstance(source, list) and len(source) <= DRIVER_CHECK_MAX:
        prompts, params, problems = driver.check(source)
        if problems and not opts.skip_bad_lines:
            raise prompt_error([m for _, m in problems])
        bad, dropped = {rid for rid, _ in problems}, [m for _, m in problems]
        keep = [r.to_row() for r in source if r.id not in bad]
        if not keep:
            return None, 0, dropped, 0
        batch = driver.batch_size(prompts, params, len(keep), max_replicas)
        return ray.data.from_items(keep, override_num_blocks=math.ceil(len(keep) / batch)), len(keep), dropped, batch
    ds = ray.data.from_items([r.to_row() for r in source]) if isinstance(source, list) else source
    ds, bad_prompts = check_all_prompts(opts, ds, fields_)
    remaining = ds.count()
    if remaining == 0:
        return None, 0, bad_prompts, 0
    sample = [workloads.Request.from_row(r) for r in ds.take(PLAN_SAMPLE)]
    prompts, params, _ = driver.check(sample)
    batch = driver.batch_size(prompts, params, remaining, max_replicas)
    return ds.repartition(math.ceil(remaining / batch)).materialize(), remaining, bad_prompts, batch


def warm_up_ray_data():
    """Start Ray Data's helper actors (stats, autoscaling coordinator, usage) now, beside the driver's
    parse and plan, which leave a core idle: each is a Python process that spends ~1 s of CPU importing
    Ray Data, and started with the pipeline they would take it from the replicas' load and prefill."""
    import threading

    import ray

    t = threading.Thread(target=lambda: ray.data.range(1).map_batches(lambda b: b).materialize(), daemon=True,
                         name="moelight-ray-warm-up")
    t.start()
    return t


def run_ray_job(opts) -> RayRunReport:
    """The job on Ray; the report is saved beside the output whatever happens after generation starts."""
    from ray.data import ActorPoolStrategy

    t_job = time.perf_counter()
    lo, hi = parse_replicas(opts.ray_replicas)
    if output_present(opts.output) and not (opts.resume or opts.overwrite):
        prepare_output(opts, workloads.output_format(opts.output))  # says what to pass, before Ray starts
    # the driver is the one writer: the output is on its disk; which ids it holds is read now
    finished = workloads.finished_ids(opts.output) if opts.resume and output_present(opts.output) else set()
    address = connect(opts.ray, opts.log)
    configure_ray_data(opts.progress)
    warm = warm_up_ray_data()
    try:
        source, fmt, problems, _ = read_dataset(opts, finished)
        out_format = workloads.output_format(opts.output, fmt)
        output = prepare_output(opts, out_format, source if isinstance(source, list) else None)
        if isinstance(source, list):
            source = [r for r in source if r.id not in output.done]
        fields_ = opts_fields(opts)
        driver = DriverPlan(opts)
        ds, remaining, bad_prompts, batch = checked_batches(opts, source, driver, fields_, hi)
    finally:  # a bad dataset ends the job here: Ray must not shut down under the warm-up's tasks
        warm.join()
    skipped = [*map(str, problems), *bad_prompts]
    report = RayRunReport(model=opts.model, dtype=opts.dtype, requests=remaining, batch_size=0, micro_batch_size=0,
                          skipped_requests=len(skipped), skipped=skipped, ray_address=address)
    describe_output(report, opts, output)
    if remaining == 0:  # a parquet output a stopped run left as its stream is written all the same
        report.wall_seconds = time.perf_counter() - t_job
        try:
            LazyResultWriter(opts, out_format, output.record).close()
        except BaseException as e:
            save_report(report, opts.output, e, opts.log)
            raise
        save_report(report, opts.output)
        return report
    cpus, gpus = per_replica_resources(opts, hi)
    warn_if_pool_cannot_start(lo, cpus, gpus, opts.log)
    if opts.log:
        opts.log(f"ray: {remaining} requests in batches of {batch} over {lo if lo == hi else f'{lo}-{hi}'} "
                 f"replica(s) of {cpus:g} CPU(s), {gpus:g} GPU(s) each")
    results = ds.map_batches(
        MoelightReplica, fn_constructor_kwargs={"opts_fields": fields_, "num_cpus": cpus,
                                                "driver_plan": driver.for_replicas()},
        batch_size=batch, batch_format="pyarrow",
        compute=ActorPoolStrategy(min_size=lo, max_size=hi, max_tasks_in_flight_per_actor=1),
        num_cpus=cpus, num_gpus=gpus)
    figures: dict[str, ReplicaFigures] = {}
    written: set[str] = set(finished)
    bar = tqdm(total=remaining, unit="req", disable=not opts.progress, desc="written")
    t0 = time.perf_counter()
    failing: BaseException | None = None
    writer = LazyResultWriter(opts, out_format, output.record)
    try:
        with writer, interrupt_flag() as stop:
            for rows in results.iter_batches(batch_size=None, batch_format="pyarrow"):
                _write_rows(rows.to_pylist(), writer, written, figures, bar)
                if stop.is_set():
                    raise KeyboardInterrupt
    except KeyboardInterrupt:
        report.interrupted = True
    except BaseException as e:
        failing = e
        raise
    finally:
        bar.close()
        report.fold(figures, time.perf_counter() - t0)
        report.written = writer.written
        report.dtype = next((r.report.policy.get("dtype", opts.dtype) for r in figures.values() if r.report),
                            opts.dtype)
        report.wall_seconds = time.perf_counter() - t_job
        save_report(report, opts.output, failing, opts.log)
    return report


def _write_rows(rows: list[dict], writer, written: set[str], figures: dict[str, ReplicaFigures], bar) -> None:
    for row in rows:
        if row["batch_report"]:
            figures.setdefault(row["replica"], ReplicaFigures(row["replica"])).add(json.loads(row["batch_report"]))
        if row["id"] in written:  # never twice, whatever Ray re-ran
            continue
        writer.write(result_from_row(row))
        written.add(row["id"])
        bar.update(1)
