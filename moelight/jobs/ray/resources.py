"""The Ray cluster a job runs on: connecting, the pool's size, what each replica asks for."""

from __future__ import annotations

import logging
import math
import warnings

from moelight.engine.options import OptionError

MIN_POOL_WAIT_S = 3600  # how long the pool may take to load its minimum of replicas (big models load slowly)


def connect(address: str | None, log=None) -> str:
    """ray.init for --ray: 'local' starts a cluster on this machine, anything else connects."""
    import ray

    if not ray.is_initialized():
        target = None if address in (None, "", "local") else address
        try:
            ray.init(address=target, log_to_driver=False, include_dashboard=False,
                     configure_logging=False, ignore_reinit_error=True)
        except ConnectionError as e:
            raise OptionError(f"--ray {address}: no Ray cluster found there ({str(e).splitlines()[0]}); start one "
                              "(`ray start --head`), give its address, or pass --ray alone to run a local one "
                              "for the job") from None
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
