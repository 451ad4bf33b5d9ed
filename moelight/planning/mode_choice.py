"""Throughput mode (CGOPipe, big batches) or latency mode (a device expert cache, small batches):
the HRM predicts both for the job and `--mode auto` takes the faster, saying why."""

from __future__ import annotations

from dataclasses import replace

from moelight.errors import MoelightError


class ModeError(MoelightError):
    """A mode the job cannot run in (latency mode without a device, or over several ranks)."""


def cache_slots_of(size: float | None, total: int, planned: int) -> int:
    """--cache-size: a share of all experts (< 1), a slot count (>= 1), or None for the plan's."""
    if size is None:
        return planned
    return max(1, round(size * total)) if size < 1 else min(int(size), total)


def cache_too_small(size: float, total: int, experts: int) -> str:
    """Why --cache-size holds fewer slots than one layer's experts ('' when it holds enough): a layer's
    routing may ask for every expert of the layer at once."""
    slots = cache_slots_of(size, total, total)
    if slots >= experts:
        return ""
    share = (f" (or a share >= {experts / total:.3g} of the model's {total} routed experts)"
             if experts < total else "")  # a share is below 1: one MoE layer takes a count
    return (f"--cache-size {size:g}: {slots} expert slot(s), fewer than one layer's {experts} experts; give at least "
            f"{experts} slots{share}")


def apply_mode(plan, opts, mspec, workload, requests: int, device: str, ranks: int = 1):
    """The job plan in the mode `opts.mode` asks for (auto: the faster by the HRM)."""
    from moelight.expert_cache.policy_registry import OFFLOADING
    from optimizer.latency_mode import best_latency_batch, cache_slots, predict_latency_mode

    info = plan.info
    no_throughput = info.pop("no_throughput", "")  # the device runtime's placement does not fit
    cache_options = _cache_options(opts)
    if opts.mode == "throughput":
        if cache_options:  # set for nothing: say so rather than run without them
            raise ModeError(f"{', '.join(cache_options)}: latency mode's expert-cache options, and --mode is "
                            "throughput; drop them or use --mode auto / latency")
        info.update(mode="throughput", mode_reason="--mode throughput")
        return plan
    why_not = _no_latency_mode(device, plan.hardware, ranks)
    if not why_not and opts.mode == "auto" and opts.policy != "auto":
        why_not = f"--policy {opts.policy} is a throughput-mode policy"
    if why_not and cache_options:
        raise ModeError(f"{', '.join(cache_options)}: latency mode's expert-cache options, and latency mode cannot "
                        f"run: {why_not}")
    if why_not:
        if opts.mode == "latency" or no_throughput:
            raise ModeError(f"--mode {opts.mode}: {why_not}" + (f"; {no_throughput}" if no_throughput else ""))
        info.update(mode="throughput", mode_reason=f"throughput mode: {why_not}")
        return plan
    dtype, offload = plan.policy.dtype, opts.cache_policy_name() in OFFLOADING
    try:
        lat = (predict_latency_mode(plan.hardware, mspec, workload, requests, opts.batch_size, dtype,
                                    cpu_offload=offload) if opts.batch_size else
               best_latency_batch(plan.hardware, mspec, workload, requests, dtype, cpu_offload=offload))
    except ValueError as e:
        lat, error = None, str(e)
        if opts.batch_size and plan.hardware.has_gpu:  # the size the user set: name it, and one that fits
            error = _batch_too_big(plan.hardware, mspec, workload, opts.batch_size, dtype) or error
    else:
        error = "one GPU cannot hold the non-expert weights, the KV cache and one layer's experts"
    if lat is not None and opts.cache_size is not None:
        total = (mspec.num_layers - mspec.num_dense_layers) * mspec.num_experts
        slots = cache_slots_of(opts.cache_size, total, lat.slots)
        too_small = cache_too_small(opts.cache_size, total, mspec.num_experts)
        if too_small:
            raise ModeError(too_small)
        batch = opts.batch_size or 1  # the smallest batch leaves the most room for slots
        most = cache_slots(plan.hardware, mspec, workload, batch, dtype)
        if slots > most:  # beside the non-expert weights, the KV cache and activations: checked before loading
            raise ModeError(f"--cache-size {opts.cache_size:g}: {slots} expert slots do not fit on one "
                            f"{plan.hardware.gpu.name} beside the non-expert weights, the KV cache and activations of "
                            f"batch {batch}; at most {most} fit (give --cache-size {most} or less, or leave it out)")
        lat = (predict_latency_mode(plan.hardware, mspec, workload, requests, batch, dtype, slots=slots,
                                    cpu_offload=offload) if opts.batch_size else
               best_latency_batch(plan.hardware, mspec, workload, requests, dtype, cpu_offload=offload, slots=slots))
    thr = plan.prediction["end_to_end_tokens_per_s"]
    if lat is None:
        if opts.mode == "latency" or no_throughput:
            raise ModeError(f"--mode {opts.mode}: {error}" + (f"; {no_throughput}" if no_throughput else ""))
        info.update(mode="throughput", mode_reason=f"throughput mode: latency mode cannot run ({error})")
        return plan
    faster = lat.end_to_end_tokens_per_s > thr
    reason = (f"predicted {lat.end_to_end_tokens_per_s:.1f} tok/s end-to-end in latency mode (batch {lat.batch_size}, "
              f"{lat.slots} expert slots, hit rate {lat.hit_rate:.0%} assumed, {1e3 * lat.step_seconds:.1f} ms per "
              "token) " + (f"and {no_throughput}" if no_throughput else
                           f"against {thr:.1f} for throughput mode (CGOPipe, batch {plan.batch_size})"))
    info["latency_prediction"] = lat.to_dict()
    if opts.mode == "auto" and not faster and not no_throughput:
        info.update(mode="throughput", mode_reason=f"throughput mode: {reason}")
        if cache_options:  # the HRM's choice depends on the workload: run the faster mode, but say so
            info["warning"] = (f"{', '.join(cache_options)} unused: --mode auto chose throughput mode, which has no "
                               "expert cache; add --mode latency to run with them")
        return plan
    info.pop("schedule", None)  # no CGOPipe schedule runs
    if opts.throughput_options():  # auto (latency mode refuses them): say what the chosen mode leaves unused
        info["warning"] = (f"{', '.join(opts.throughput_options())} unused: --mode auto chose latency mode, which "
                           "runs one batch through the expert cache; add --mode throughput to run with them")
    info.update(mode="latency", mode_reason=("latency mode (asked): " if opts.mode == "latency" else "latency mode: ")
                + reason, cache={"slots": lat.slots, "policy": opts.cache_policy_name()})
    pred = dict(plan.prediction) | {
        "prefill_tokens_per_s": lat.prefill_tokens_per_s, "decode_tokens_per_s": lat.decode_tokens_per_s,
        "end_to_end_tokens_per_s": lat.end_to_end_tokens_per_s, "prefill_seconds": lat.prefill_seconds,
        "decode_seconds": lat.step_seconds * (workload.gen_len - 1), "binding": "expert fetches" if
        lat.fetch_seconds_per_layer > lat.compute_seconds_per_layer else "gpu", "tpot_ms": 1e3 * lat.step_seconds,
        "gpu_memory_bytes": lat.gpu_memory_bytes}
    info.update(batch_size=lat.batch_size, micro_batch_size=lat.batch_size, num_micro_batches=1)
    return replace(plan, batch_size=lat.batch_size, micro_batch_size=lat.batch_size, prediction=pred)


def _batch_too_big(hw, mspec, workload, batch: int, dtype: str) -> str:
    """Why latency mode cannot run the --batch-size asked for, with the largest that fits ('' when the batch
    is not what stops it): its KV cache and activations leave no room for one layer's experts."""
    from moelight.planning.size_overrides import largest_size
    from optimizer.latency_mode import cache_slots

    if cache_slots(hw, mspec, workload, batch, dtype):
        return ""
    best = largest_size(lambda b: cache_slots(hw, mspec, workload, b, dtype) > 0, batch)
    fits = (f"at most --batch-size {best} fits (or leave it to the planner)" if best else
            "no batch size fits")
    return (f"--batch-size {batch} does not fit {hw.name} in latency mode: one {hw.gpu.name} cannot hold the "
            f"non-expert weights, the KV cache and activations of batch {batch} and one layer's "
            f"{mspec.num_experts} experts; {fits}")


def _cache_options(opts) -> list[str]:
    """The latency-mode options the job sets (each applies to the device expert cache only)."""
    given = {"--cache-policy": opts.cache_policy != "auto", "--cache-size": opts.cache_size is not None,
             "--eamc": opts.eamc is not None, "--predictor": opts.predictor is not None,
             "--prefetch-per-layer": opts.prefetch_per_layer is not None}
    return [name for name, is_set in given.items() if is_set]


def _no_latency_mode(device: str, hw, ranks: int) -> str:
    if device == "cpu":
        return "the CPU executor holds every expert in memory already (latency mode needs --device cuda or emulated)"
    if not hw.has_gpu:
        return f"hardware {hw.name!r} has no GPU for an expert cache"
    if ranks > 1:
        return "latency mode runs on one device, not over tensor-parallel ranks"
    return ""
