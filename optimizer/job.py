"""HRM prediction for a whole job as the engine runs it, and fitting a policy to a job.

The planner reasons about one batch of N sequences cut into micro-batches of exactly mu.
A job of R requests runs as ceil(R / N) batches (the last one smaller) and the engine
cuts each batch of n sequences into ceil(n / mu) balanced micro-batches, so a micro-batch
holds n / ceil(n / mu) sequences on average. `predict_job` sums the HRM times of those
batches, giving throughputs defined as DESIGN.md section 9 measures them.
"""

from __future__ import annotations

import math

from hrm.hardware import HardwareSpec
from hrm.model import ModelSpec
from hrm.workload import WorkloadSpec
from optimizer.cost_model import ALPHA, binding_roof, build_point_model
from optimizer.policy import Policy


def fit_policy(policy: Policy, requests: int) -> Policy:
    """The policy with N capped at the number of requests (a larger batch is never filled);
    mu and the micro-batch count are re-derived so that N = mu x n_mb still holds."""
    if requests < 1 or policy.batch_size <= requests:
        return policy
    n_mb = math.ceil(requests / min(policy.micro_batch_size, requests))
    mu = math.ceil(requests / n_mb)
    return Policy(mu * n_mb, mu, n_mb, policy.attn_on_gpu, policy.ffn_on_gpu, policy.r_w, policy.r_c,
                  policy.dtype)


def batch_sizes(requests: int, batch_size: int) -> list[int]:
    """Sizes of the engine's batches (moelight.engine.batching.split_batches)."""
    full, rest = divmod(requests, batch_size)
    return [batch_size] * full + ([rest] if rest else [])


def predict_job(hw: HardwareSpec, model: ModelSpec, workload: WorkloadSpec, policy: Policy, requests: int,
                batch_size: int | None = None, micro_batch_size: int | None = None,
                alpha: float = ALPHA) -> dict:
    """Predicted prefill / decode / end-to-end tok/s and GPU / host memory of `requests` requests run
    with `policy` (batch_size / micro_batch_size override its N and mu: what the engine actually uses)."""
    n_big = batch_size or policy.batch_size
    mu_cap = micro_batch_size or policy.micro_batch_size
    g = workload.gen_len
    t_pre = t_dec = 0.0
    prompt_tok = dec_tok = gen_tok = 0.0
    layer = None
    gpu_bytes = cpu_bytes = 0.0  # the largest batch's (the memory the run must hold)
    for n in batch_sizes(requests, n_big):
        n_mb = math.ceil(n / max(1, min(mu_cap, n)))
        pm = build_point_model(hw, model, workload, policy.dtype, n / n_mb, n_mb, policy.A_g, policy.F_g,
                               alpha)
        x, y = policy.r_w, policy.r_c
        t_pre += float(pm.prefill_time(x, y))
        t_dec += (g - 1) * float(pm.decode_step_time(x, y))
        prompt_tok += n * workload.computed_prompt  # as the run report counts prefill: positions computed
        dec_tok += n * (g - 1)
        gen_tok += n * g
        if layer is None:
            layer = {k: float(v) for k, v in pm.layer_times(x, y).items()}
        gpu_bytes = max(gpu_bytes, float(pm.gpu_total().at(x, y)))
        cpu_bytes = max(cpu_bytes, float(pm.cpu_total().at(x, y)))
    total = t_pre + t_dec
    return {
        "prefill_tokens_per_s": prompt_tok / t_pre if t_pre > 0 else 0.0,
        "decode_tokens_per_s": dec_tok / t_dec if t_dec > 0 else 0.0,
        "end_to_end_tokens_per_s": gen_tok / total if total > 0 else 0.0,
        "prefill_seconds": t_pre,
        "decode_seconds": t_dec,
        "generation_seconds": total,
        "binding": binding_roof(layer),
        "layer_times_ms": {k: 1e3 * v for k, v in layer.items()},
        "batches": len(batch_sizes(requests, n_big)),
        "gpu_memory_bytes": gpu_bytes,  # per the HRM's memory model, beside the runtime's measured peak
        "cpu_memory_bytes": cpu_bytes,
    }
