"""`moelight run --ray`: the local job's contract (same results, resume, report) as a Ray Data pipeline.

    read (Ray tasks, our parsers) -> check records and prompts (before any model loads)
      -> map_batches(MoelightReplica) over an actor pool -> the driver writes each result once

Exactly once: Ray Data retries a batch whose actor died on a restarted actor (its actor pools
run with max_restarts=-1, max_task_retries=-1) and emits a batch's rows only when its task
succeeds, so a killed replica's half-done batch never reaches the output; the driver is the one
writer and writes an id only once (the set of written ids starts from a resumed output's). Each
result is flushed as it arrives, so an interrupted job loses nothing and `--resume` continues it.
"""

from __future__ import annotations

import json
import logging
import math
import time
import warnings
from dataclasses import fields, replace

from tqdm import tqdm

import workloads
from moelight.engine.options import OptionError
from moelight.jobs.ray.ray_dataset import read_dataset, request_from_json
from moelight.jobs.ray.ray_report import RayRunReport, ReplicaFigures
from moelight.jobs.ray.replica import MoelightReplica, PromptChecker
from workloads.resume import PARQUET_SUFFIXES, record_id

PLAN_SAMPLE = 4096  # requests the driver plans the batch size N from
DRIVER_CHECK_MAX = PLAN_SAMPLE  # a job this small is checked and split by the driver itself
CHECK_BATCH = 1024  # requests per prompt-check task
MIN_POOL_WAIT_S = 3600  # how long the pool may take to load its minimum of replicas (big models load slowly)


def parse_replicas(text: str) -> tuple[int, int]:
    """'N' (a fixed pool) or 'MIN-MAX' (an autoscaling pool) -> (min, max)."""
    try:
        lo, _, hi = str(text).partition("-")
        bounds = (int(lo), int(hi or lo))
    except ValueError:
        raise OptionError(f"--ray-replicas {text!r}: give a count (2) or bounds for autoscaling (1-4)") from None
    if bounds[0] < 1 or bounds[1] < bounds[0]:
        raise OptionError(f"--ray-replicas {text!r}: need 1 <= MIN <= MAX")
    return bounds


def connect(address: str | None, log=None) -> str:
    """ray.init for --ray: 'local' starts a cluster on this machine, anything else connects."""
    import ray

    if not ray.is_initialized():
        target = None if address in (None, "", "local") else address
        ray.init(address=target, log_to_driver=False, include_dashboard=False,
                 configure_logging=False, ignore_reinit_error=True)
    ctx = ray.get_runtime_context()
    where = ctx.gcs_address if hasattr(ctx, "gcs_address") else "local"
    if log:
        log(f"ray: connected to {where} ({ray.cluster_resources().get('CPU', 0):.0f} CPUs, "
            f"{ray.cluster_resources().get('GPU', 0):.0f} GPUs)")
    return where


def configure_ray_data(progress: bool) -> None:
    """Ray Data's progress bars when asked for, its warnings, not its per-dataset INFO lines; and a
    pool that deals no batch before its minimum of replicas has loaded, so a fixed pool of N shares
    the job instead of the first replica up taking every batch while the others still load."""
    import ray

    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = progress
    ctx.wait_for_min_actors_s = max(ctx.wait_for_min_actors_s, MIN_POOL_WAIT_S)
    logging.getLogger("ray.data").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message="Use 'expr' instead of 'fn'", category=UserWarning)


def opts_fields(opts) -> dict:
    """The RunOptions a replica needs (no Ray options, no callables)."""
    skip = {"log", "ray", "ray_replicas", "ray_cpus_per_replica", "ray_gpus_per_replica"}
    return {f.name: getattr(opts, f.name) for f in fields(opts) if f.name not in skip}


def per_replica_resources(opts, max_replicas: int) -> tuple[float, float]:
    """(CPUs, GPUs) each replica asks Ray for: as given, or the cluster's CPUs shared by the pool."""
    import ray

    gpus = opts.ray_gpus_per_replica or 0.0
    cpus = opts.ray_cpus_per_replica
    if cpus is None:
        cpus = max(1.0, math.floor(ray.cluster_resources().get("CPU", 1) / max_replicas))
    return float(cpus), float(gpus)


def warn_if_pool_cannot_start(replicas: int, cpus: float, gpus: float, log=None) -> str | None:
    """Say so when the cluster, as it is now, cannot hold the pool's minimum: the job then waits for
    it to grow (an autoscaling cluster) up to MIN_POOL_WAIT_S, and fails with Ray's timeout after."""
    import ray

    have = ray.cluster_resources()
    if replicas * cpus <= have.get("CPU", 0) and replicas * gpus <= have.get("GPU", 0):
        return None
    message = (f"ray: {replicas} replica(s) of {cpus:g} CPU(s) and {gpus:g} GPU(s) need more than the cluster has "
               f"now ({have.get('CPU', 0):g} CPUs, {have.get('GPU', 0):g} GPUs); the job waits up to "
               f"{MIN_POOL_WAIT_S // 60} min for it to grow. Ask for fewer replicas (--ray-replicas), fewer CPUs or "
               "GPUs each (--ray-cpus-per-replica, --ray-gpus-per-replica), or a range (1-4) to start with what fits")
    if log:
        log(message)
    else:
        warnings.warn(message, stacklevel=2)
    return message


def _driver_session(opts):
    from moelight.engine.session import EngineSession

    return EngineSession(replace(opts, progress=False, log=None))  # tokenizer and config, no weights


def _checked(session, opts, rows: list[dict]):
    """check_prompts on request rows: (prompts, params, problems) as a local run finds them."""
    from moelight.jobs.dataset_job import check_prompts

    requests = [request_from_json(r["request"]) for r in rows]
    return check_prompts(requests, session.tokenizer, session.config.max_position_embeddings, opts)


def plan_batch_size(opts, session, prompts, params, remaining: int, max_replicas: int) -> int:
    """The planner's N for checked prompts (the replicas plan their own policy per batch), no more
    than an even share of what is left, so every replica gets work."""
    if opts.batch_size:
        n = opts.batch_size
    else:
        n = session.plan(prompts, params, opts.turn).batch_size if prompts else 1
    return max(1, min(n, math.ceil(remaining / max_replicas)))


def check_all_prompts(opts, ds, fields_: dict):
    """Tokenize every request in Ray tasks (no weights); raise as a local run would, or drop them."""
    from ray.data import ActorPoolStrategy

    from moelight.jobs.dataset_job import prompt_error

    bad = ds.map_batches(PromptChecker, fn_constructor_kwargs={"opts_fields": fields_}, batch_size=CHECK_BATCH,
                         compute=ActorPoolStrategy(size=1), num_cpus=1).take_all()
    if not bad:
        return ds, 0
    if not opts.skip_bad_lines:
        raise prompt_error([r["problem"] for r in bad])
    bad_ids = {r["id"] for r in bad}
    return ds.filter(lambda r: r["id"] not in bad_ids), len(bad_ids)


def checked_batches(opts, source, fields_: dict, max_replicas: int):
    """(dataset of one block per batch or None, requests in it, prompts dropped, batch size N) for
    the requests `read_dataset` gave (a lazy dataset, or the rows when the driver holds them).

    Bad prompts raise here, before any replica loads. One block per batch, in the object store
    before the engines start: the pool hands blocks to idle replicas, and an upstream task left to
    run beside them would wait for a CPU they hold. A job no bigger than the planner's sample is
    checked and split by the driver, which holds it already: Ray tasks would only add start-up.
    """
    import ray

    rows = source if isinstance(source, list) else source.take(PLAN_SAMPLE + 1)
    if len(rows) <= DRIVER_CHECK_MAX:
        return _driver_batches(opts, rows, max_replicas)
    ds = ray.data.from_items(source) if isinstance(source, list) else source
    ds, bad_prompts = check_all_prompts(opts, ds, fields_)
    remaining = ds.count()
    if remaining == 0:
        return None, 0, bad_prompts, 0
    session = _driver_session(opts)
    prompts, params, _ = _checked(session, opts, rows[:PLAN_SAMPLE])
    batch = plan_batch_size(opts, session, prompts, params, remaining, max_replicas)
    return ds.repartition(math.ceil(remaining / batch)).materialize(), remaining, bad_prompts, batch


def _driver_batches(opts, rows: list[dict], max_replicas: int):
    import ray

    from moelight.jobs.dataset_job import prompt_error

    session = _driver_session(opts)
    prompts, params, problems = _checked(session, opts, rows)
    if problems and not opts.skip_bad_lines:
        raise prompt_error([m for _, m in problems])
    bad = {rid for rid, _ in problems}
    keep = [r for r in rows if r["id"] not in bad]
    if not keep:
        return None, 0, len(bad), 0
    batch = plan_batch_size(opts, session, prompts, params, len(keep), max_replicas)
    return ray.data.from_items(keep, override_num_blocks=math.ceil(len(keep) / batch)), len(keep), len(bad), batch


def run_ray_job(opts) -> RayRunReport:
    """The job on Ray; the report is saved beside the output whatever happens after generation starts."""
    from ray.data import ActorPoolStrategy

    from moelight.jobs.dataset_job import LazyResultWriter, report_path

    t_job = time.perf_counter()
    lo, hi = parse_replicas(opts.ray_replicas)
    address = connect(opts.ray, opts.log)
    configure_ray_data(opts.progress)
    if opts.output.exists() and not (opts.resume or opts.overwrite):
        raise workloads.OutputExistsError(
            f"{opts.output}: output exists; pass --resume to continue it or --overwrite to replace it")
    finished = finished_ids(opts.output) if opts.resume and opts.output.exists() else set()
    source, fmt, problems, _ = read_dataset(opts, finished, driver_max=DRIVER_CHECK_MAX)
    out_format = workloads.output_format(opts.output, fmt)
    fields_ = opts_fields(opts)
    ds, remaining, bad_prompts, batch = checked_batches(opts, source, fields_, hi)
    report = RayRunReport(model=opts.model, dtype=opts.dtype, requests=remaining, batch_size=0, micro_batch_size=0,
                          skipped_requests=len(problems) + bad_prompts, ray_address=address)
    if remaining == 0:
        report.wall_seconds = time.perf_counter() - t_job
        report.save(report_path(opts.output))
        return report
    cpus, gpus = per_replica_resources(opts, hi)
    warn_if_pool_cannot_start(lo, cpus, gpus, opts.log)
    if opts.log:
        opts.log(f"ray: {remaining} requests in batches of {batch} over {lo if lo == hi else f'{lo}-{hi}'} "
                 f"replica(s) of {cpus:g} CPU(s), {gpus:g} GPU(s) each")
    results = ds.map_batches(
        MoelightReplica, fn_constructor_kwargs={"opts_fields": fields_, "num_cpus": cpus}, batch_size=batch,
        compute=ActorPoolStrategy(min_size=lo, max_size=hi, max_tasks_in_flight_per_actor=1),
        num_cpus=cpus, num_gpus=gpus)
    figures: dict[str, ReplicaFigures] = {}
    written: set[str] = set(finished)
    bar = tqdm(total=remaining, unit="req", disable=not opts.progress, desc="written")
    t0 = time.perf_counter()
    try:
        with LazyResultWriter(opts, out_format) as writer:
            for rows in results.iter_batches(batch_size=None, batch_format="default"):
                _write_rows(rows, writer, written, figures, bar)
    except KeyboardInterrupt:
        report.interrupted = True
    finally:
        bar.close()
        report.fold(figures, time.perf_counter() - t0)
        report.dtype = next((r.policy.get("dtype", opts.dtype) for r in figures.values()), opts.dtype)
        report.wall_seconds = time.perf_counter() - t_job
        report.save(report_path(opts.output))
    return report


def _write_rows(rows: dict, writer, written: set[str], figures: dict[str, ReplicaFigures], bar) -> None:
    for rid, result, replica, batch_report in zip(rows["id"], rows["result"], rows["replica"],
                                                  rows["batch_report"], strict=True):
        if batch_report:
            figures.setdefault(replica, ReplicaFigures(replica)).add(json.loads(batch_report))
        if rid in written:  # never twice, whatever Ray re-ran
            continue
        writer.write(json.loads(result))
        written.add(rid)
        bar.update(1)


def finished_ids(output) -> set[str]:
    """Ids a previous run wrote, read through Ray (jsonl lines; parquet and its jsonl sidecar)."""
    import ray

    parquet = output.suffix.lower() in PARQUET_SUFFIXES
    paths = [p for p in ([workloads.sidecar_path(output)] if parquet else [output]) if p.exists()]
    ids: set[str] = set()
    if parquet and output.exists():
        ids |= {str(r["id"]) for r in ray.data.read_parquet(str(output), columns=["id"]).take_all()}
    for p in paths:
        lines = ray.data.read_text(str(p.resolve())).map(_id_of_line).filter(lambda r: r["id"] != "")
        ids |= {r["id"] for r in lines.take_all()}
    return ids


def _id_of_line(row: dict) -> dict:
    """A result line's id ('' for a torn last line or a blank); OpenAI batch lines use custom_id."""
    try:
        obj = json.loads(row["text"])
    except json.JSONDecodeError:
        return {"id": ""}
    rid = record_id(obj) if isinstance(obj, dict) else None
    return {"id": "" if rid is None else rid}
