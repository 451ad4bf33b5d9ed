"""Where a `moelight run` decode step's time goes, beside the HRM's term for each part.

Runs the CLI's `run` in this process with timers around the engine's pieces (only inside decode
steps): the norms, rotary, the packed projections (q/k/v/o, also q/k/v fused, and the LM head), KV writes, decode
attention, routing, the fused experts, the logits' float32 copy, sampling and the rest of the
engine's step. CPU ops are synchronous, so a wall-clock timer around a call is its cost; the
wrappers add ~1 us a call (~100 calls a step). Then the HRM's terms for the same job (the plan's
micro-batch, the profile given with --hardware) are printed per step.

    PYTHONPATH=$PWD python benchmarks/attribute_decode_step.py --hardware P.json [--quantize int8] \
        [-- extra run options]
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time


def _wrap(owner, name: str, key, totals, active) -> None:
    """Time owner.name into active[0][key(args)] (the decode totals, or the prefill ones) while active[0]."""
    fn = getattr(owner, name)

    def timed(*args, **kwargs):
        if active[0] is None:
            return fn(*args, **kwargs)
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        active[0][key(args, out) if callable(key) else key] += time.perf_counter() - t0
        return out

    setattr(owner, name, timed)


POOL_BYTES: list[int] = []  # bytes of every KV pool the job allocated
PREFILL_TOTALS: dict = collections.defaultdict(float)  # the same parts' seconds inside prefill passes
PREFILL_PASSES: list[tuple[int, int, float]] = []  # (tokens, sequences, seconds) of every prefill pass
ROWS_SEEN: list[list[int]] = []  # rows per expert of every fused-expert call inside decode steps


def instrument(totals: dict, active: list) -> None:
    from moelight.engine import generation
    from moelight.models import causal_lm, layers
    from moelight.runtime import cpu_linear, fused_experts, fused_qkv, kv_cache, plain_executor
    from moelight.sampling import sampler

    def linear_key(args, out):
        return "lm_head" if out.shape[-1] > 8192 else "projections"

    _wrap(layers.RMSNorm, "forward", "norms", totals, active)
    if hasattr(layers.RMSNorm, "residual"):  # the residual add fused with the post-attention norm: counted as norms
        _wrap(layers.RMSNorm, "residual", "norms", totals, active)
    _wrap(layers, "apply_rotary", "rotary", totals, active)
    _wrap(cpu_linear.PackedLinear, "forward", linear_key, totals, active)
    _wrap(fused_qkv.FusedQKV, "__call__", "projections", totals, active)  # q/k/v in one call at few rows
    _wrap(kv_cache.RaggedKVCache, "write", "kv_write", totals, active)
    _wrap(kv_cache.RaggedKVCache, "attend", "attention", totals, active)
    _wrap(layers.SparseMoE, "route", "router", totals, active)
    _wrap(fused_experts.FusedExperts, "fused_mix", "experts", totals, active)
    mix = fused_experts.FusedExperts.fused_mix

    def counted(self, x, weights, experts):  # rows per expert: the router's balance on these weights
        if active[0] is totals:
            import torch

            counts = torch.bincount(experts.reshape(-1), minlength=len(self)).tolist()
            totals["rows_max"] += max(counts)
            totals["rows_min"] += min(counts)
            totals["expert_calls"] += 1
            ROWS_SEEN.append(counts)
        return mix(self, x, weights, experts)

    fused_experts.FusedExperts.fused_mix = counted
    _wrap(causal_lm.MoECausalLM, "logits", "logits_total", totals, active)
    _wrap(sampler.Sampler, "__call__", "sampling", totals, active)
    _wrap(plain_executor.PlainExecutor, "decode", "executor_decode", totals, active)
    _wrap(generation._Run, "_accept", "accept", totals, active)  # the check, sampling, per-sequence appends
    from moelight.engine import block_manager

    _wrap(block_manager.BlockManager, "copy_on_write", "kv_bookkeeping", totals, active)
    _wrap(block_manager.BlockManager, "layout", "kv_bookkeeping", totals, active)
    run_cls = generation._Run
    step = run_cls._decode_step
    prefill = plain_executor.PlainExecutor.prefill

    def timed_prefill(self, cache, tokens, seq_lens, *args, **kwargs):  # each prefill pass: tokens, sequences, s
        t0 = time.perf_counter()
        active[0] = PREFILL_TOTALS
        try:
            out = prefill(self, cache, tokens, seq_lens, *args, **kwargs)
        finally:
            active[0] = None
        PREFILL_PASSES.append((int(tokens.numel()), int(seq_lens.numel()), time.perf_counter() - t0))
        return out

    plain_executor.PlainExecutor.prefill = timed_prefill
    pool = kv_cache.RaggedKVCache.pool.__func__

    def sized_pool(cls, cfg, total_tokens, dtype):  # the job's KV pool: what its first writes fault in
        POOL_BYTES.append(cls.bytes_needed(cfg, total_tokens, dtype))
        return pool(cls, cfg, total_tokens, dtype)

    kv_cache.RaggedKVCache.pool = classmethod(sized_pool)

    def decode_step(self, batches):
        active[0] = totals
        t0 = time.perf_counter()
        try:
            return step(self, batches)
        finally:
            totals["step"] += time.perf_counter() - t0
            totals["steps"] += 1
            active[0] = None

    run_cls._decode_step = decode_step


def hrm_terms(report: dict, hardware: str, quantize: str | None) -> dict[str, float]:
    """The HRM's seconds per decode step, by term, for the job the report describes."""
    from hrm import costs
    from hrm import operators as ops
    from hrm.dtypes import dtype_bytes
    from hrm.hardware import HardwareSpec
    from hrm.model_presets import get_model
    from hrm.workload import WorkloadSpec

    hw = HardwareSpec.load(hardware)
    m = get_model(report["model"])
    if quantize:
        from moelight.models.expert_format import quantize_format

        m = quantize_format(quantize, (m.hidden_size, m.intermediate_size)).held_in(m)
    w = report["policy"]["workload"]
    wl = WorkloadSpec(w["prompt_len"], w["gen_len"], w["max_prompt_len"], shared_prefix=w.get("shared_prefix", 0.0))
    dt, b, cpu = "bfloat16", dtype_bytes("bfloat16"), hw.cpu
    mu = report["micro_batch_size"]
    c = wl.mean_context
    L = m.num_layers
    terms = {
        "projections": L * float(costs.op_time(ops.qkv_proj(m, mu, b), cpu, dt)
                                 + costs.op_time(ops.o_proj(m, mu, b), cpu, dt)),
        "attention": L * costs.attention_time(hw, m, mu, c, "cpu", dt),
        "router": L * float(costs.op_time(ops.router(m, mu, b), cpu, dt)),
        "experts": L * float(costs.moe_ffn_time(m, mu, cpu, dt)),
        "elementwise": L * float(costs.elementwise_time(ops.pre_attention_elementwise(m, mu, b), cpu)
                                 + costs.elementwise_time(ops.post_attention_elementwise(m, mu, b), cpu)),
        "layer_dispatch": L * costs.runtime_layer_time(hw, 1.0, "cpu"),
        "lm_head": costs.lm_head_time(hw, m, mu, "cpu", dt),
        "step_overhead": costs.step_overhead_time(hw, 1.0, "cpu"),
        "sequence_step": costs.sequence_step_time(hw, report["batch_size"]),
    }
    if ROWS_SEEN:  # the same kernel rate at the rows each expert actually got (the router's balance)
        steps = max(1, len(ROWS_SEEN) // L)
        terms["experts_at_measured_rows"] = sum(
            float(costs.expert_time(m, r, cpu, dt)) for counts in ROWS_SEEN for r in counts if r) / steps
    if hasattr(costs, "logits_passes_time"):  # absent before the HRM charged them
        terms["logits_passes"] = costs.logits_passes_time(hw, m, report["batch_size"])
    return terms


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hardware", required=True)
    ap.add_argument("--quantize", default=None)
    ap.add_argument("--output", default="/tmp/attribute_decode_step.jsonl")
    ap.add_argument("rest", nargs="*")
    a = ap.parse_args()
    totals: dict = collections.defaultdict(float)
    active: list = [None]
    instrument(totals, active)
    argv = ["moelight", "run", "--dataset", "workloads/examples/prompts.jsonl", "--model", "bench-1b",
            "--load-format", "dummy", "--num-requests", "256", "--gen-len", "64", "--ignore-eos",
            "--output", a.output, "--overwrite", "--hardware", a.hardware, *a.rest]
    if a.quantize:
        argv += ["--quantize", a.quantize]
    from moelight.cli import main as cli_main

    sys.argv = argv
    try:
        cli_main()
    except SystemExit as e:
        if e.code:
            raise
    report = json.load(open(a.output + ".report.json"))
    n = totals["steps"]
    calls = max(1.0, totals.pop("expert_calls", 0.0))
    rows_max, rows_min = totals.pop("rows_max", 0) / calls, totals.pop("rows_min", 0) / calls
    print(f"rows per expert per call: max {rows_max:.1f}, min {rows_min:.1f}")
    per = {k: v / n for k, v in totals.items() if k != "steps"}
    per["logits_float_and_norm"] = per.get("logits_total", 0) - per.get("lm_head", 0) - 0.0
    inside = sum(per.get(k, 0) for k in ("norms", "rotary", "projections", "kv_write", "attention", "router",
                                         "experts"))
    per["layer_rest"] = per.get("executor_decode", 0) - per.get("logits_total", 0) - inside
    per["engine_rest"] = per["step"] - per.get("executor_decode", 0) - per.get("sampling", 0)
    hrm = hrm_terms(report, a.hardware, a.quantize)
    print("prefill passes (tokens, sequences, ms):", [(t, q, round(1e3 * d, 1)) for t, q, d in PREFILL_PASSES],
          f"prefill {report['prefill_seconds']:.3f} s; KV pool(s) {[round(b / 1e6) for b in POOL_BYTES]} MB")
    print("  inside prefill, ms:", {k: round(1e3 * v, 1) for k, v in PREFILL_TOTALS.items()})
    print(f"\n{n:.0f} decode steps, ms per step (measured | HRM)")
    for k in ("step", "executor_decode", "experts", "attention", "projections", "lm_head", "norms", "rotary",
              "kv_write", "router", "logits_float_and_norm", "layer_rest", "sampling", "engine_rest", "accept",
              "kv_bookkeeping"):
        print(f"  {k:24s} {1e3 * per.get(k, 0):8.2f}")
    print("  HRM:")
    for k, v in hrm.items():
        print(f"  {k:24s} {1e3 * v:8.2f}")
    print(f"  {'HRM sum':24s} {1e3 * (sum(hrm.values()) - hrm.get('experts_at_measured_rows', 0)):8.2f}")
    if ROWS_SEEN:
        import numpy as np

        rows = np.sort(np.array(ROWS_SEEN), axis=1).mean(axis=0)
        print("mean rows per expert, sorted:", " ".join(f"{r:.1f}" for r in rows))
        json.dump(ROWS_SEEN, open(a.output + ".rows.json", "w"))


if __name__ == "__main__":
    main()
