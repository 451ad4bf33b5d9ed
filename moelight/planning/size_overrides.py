"""Batch and micro-batch sizes the user set (`--batch-size`, `--micro-batch-size`, `LLM(batch_size=...)`),
checked against the HRM's memory model before anything loads, as a `--policy` file's are: a size the
planner would never pick must not reach the loader and fail mid-job."""

from __future__ import annotations

import math

from moelight.planning.hardware_choice import PlanError


def sized_policy(policy, batch: int, micro: int, requests: int):
    """`policy` with the sizes that run: N capped at the requests (a larger batch is never filled),
    micro-batches of at most `micro`, N = mu x n_mb as optimizer.fit_policy derives them."""
    from optimizer import Policy

    n = max(1, min(batch, requests) if requests > 0 else batch)
    n_mb = math.ceil(n / max(1, min(micro, n)))
    mu = math.ceil(n / n_mb)
    return Policy(mu * n_mb, mu, n_mb, policy.attn_on_gpu, policy.ffn_on_gpu, policy.r_w, policy.r_c, policy.dtype)


def check_sizes_fit(policy, hw, mspec, workload, batch: int, micro: int, requests: int,
                    batch_set: bool, micro_set: bool) -> None:
    """PlanError naming the option the user set, what does not fit (per component) and the largest
    size of that option that fits, when the policy run with these sizes breaks the memory model."""
    problems = _problems(policy, hw, mspec, workload, batch, micro, requests)
    if not problems:
        return
    given = [f"{o} {v}" for o, v, s in (("--batch-size", batch, batch_set), ("--micro-batch-size", micro, micro_set))
             if s]
    advice = []
    if batch_set:
        best = largest_size(lambda b: not _problems(policy, hw, mspec, workload, b, min(micro, b), requests), batch)
        advice.append(f"at most --batch-size {best} fits with the other settings" if best
                      else "no batch size fits with this micro-batch size")
    if micro_set:
        best = largest_size(lambda m: not _problems(policy, hw, mspec, workload, batch, m, requests), micro)
        advice.append(f"at most --micro-batch-size {best} fits with the other settings" if best
                      else "no micro-batch size fits with this batch size")
    verb = "do" if len(given) > 1 else "does"
    raise PlanError(f"{' and '.join(given)} {verb} not fit {hw.name} (r_w={policy.r_w:.3f}, r_c={policy.r_c:.3f}):\n  "
                    + "\n  ".join(problems)
                    + f"\n{'; '.join(advice)} (or leave the sizes to the planner: it picks ones that fit)")


def _problems(policy, hw, mspec, workload, batch: int, micro: int, requests: int) -> list[str]:
    from optimizer import evaluate_policy

    return evaluate_policy(hw, mspec, workload, sized_policy(policy, batch, micro, requests)).memory_problems()


def largest_size(fits, high: int) -> int:
    """The largest size in 1..high that `fits` accepts (memory grows with the size), 0 when none does."""
    if not fits(1):
        return 0
    low = 1
    while low < high:
        mid = (low + high + 1) // 2
        if fits(mid):
            low = mid
        else:
            high = mid - 1
    return low
