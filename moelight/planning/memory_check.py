"""Memory checks made before anything is loaded: a job that cannot fit says so up front."""

from __future__ import annotations

import functools
import math
import os
import resource

import torch

from cpu_kernels.dispatch import packs_expert_by_expert
from moelight.errors import MoelightError
from moelight.models.config import ModelConfig
from moelight.runtime.cpu_linear import extra_linear_bytes, load_transient_per_param, packed_linears
from moelight.runtime.fused_experts import fused_enabled

HEADROOM = 0.9  # leave 10% of available memory for activations, allocator slack and the OS
# what a process grows by between its first plan and its peak beyond the HRM's terms (weights, KV cache,
# activations): the planner's and engine's imports, the kernels, thread pools. 54 MiB measured for one short
# request of a tiny model (x86_64, torch 2.x, 2 cores); tests/test_process_memory.py holds a run to it
RUNTIME_GROWTH = 64 * 2**20
# packing expert by expert, above one expert: the pages straddling experts, and a huge page ahead in each of the
# six packed arrays being written (runtime/fused_experts.expert_alloc)
EXPERT_PACK_SLACK = 16 * 2**20


class OutOfMemoryPlan(MoelightError):
    pass


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def weight_bytes(cfg: ModelConfig, dtype: torch.dtype, on_cpu: bool = False, plain_weights: bool = True) -> int:
    """Every weight in `dtype`, routed experts in `cfg.expert_format` where the run holds them quantized (on
    the CPU in bf16 only: float32 / float16 expand them to a dense copy);
    `on_cpu`: the CPU engine's packed matmuls, float32 copies of bf16 weights where it makes them
    (cpu_linear.linear_form), and with `plain_weights` the plain bf16 weights beside them that the few-row
    decode matmuls read (extra_linear_bytes; cpu_linear.keeps_plain_weights says which jobs keep them)."""
    extra = 0
    if on_cpu:
        extra = sum(extra_linear_bytes(dtype, k, plain_weights) * n for k, n, _ in packed_linear_sizes(cfg))
    form = cfg.expert_format
    if form is None or (on_cpu and dtype != torch.bfloat16):  # the CPU engine expands them (pack_model)
        return parameter_count(cfg) * dtype_bytes(dtype) + extra
    e, h, f = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
    sparse = sum(cfg.is_sparse(i) for i in range(cfg.num_layers))
    dense_experts = sparse * e * 3 * h * f
    held = sparse * e * (form.matrix_bytes(2 * f, h) + form.matrix_bytes(h, f))
    return (parameter_count(cfg) - dense_experts) * dtype_bytes(dtype) + held + extra


def cpu_engine_extra_bytes(cfg: ModelConfig, dtype: torch.dtype, on_cpu: bool) -> int:
    """What the CPU engine holds beyond the weights as the HRM counts them (hrm.ModelSpec): float32 copies of
    bf16 matmuls where it makes them (cpu_linear.linear_form), a dense copy of quantized experts in a
    float32 run. The planner plans with that much less host memory, so its batch is one the check accepts."""
    if not on_cpu:
        return 0
    return max(0, weight_bytes(cfg, dtype, True, plain_weights=False) - weight_bytes(cfg, dtype))


def _meta_model(cfg: ModelConfig):
    """The family's model on the meta device: its parameters' shapes, nothing allocated."""
    from moelight.models.causal_lm import MoECausalLM

    with torch.device("meta"):
        return MoECausalLM(cfg)


@functools.lru_cache(maxsize=32)
def packed_linear_sizes(cfg: ModelConfig) -> tuple[tuple[int, int, int], ...]:
    """(input width, parameters, the largest matmul's parameters) of the matmuls the CPU engine packs
    (runtime/cpu_linear.packed_linears), per input width: how they are held depends on it (linear_form), and
    asking per matmul cost DeepSeek-V3's 428 of them ~1 s per check."""
    widths: dict[int, list[int]] = {}
    for _, _, lin in packed_linears(_meta_model(cfg)):
        widths.setdefault(lin.in_features, []).append(sum(p.numel() for p in lin.parameters()))
    return tuple((k, sum(ns), max(ns)) for k, ns in sorted(widths.items()))


@functools.lru_cache(maxsize=32)
def parameter_count(cfg: ModelConfig) -> int:
    """Every parameter of the family's model (shared experts, dense layers, biases, q/k norms
    included)."""
    return sum(p.numel() for name, p in _meta_model(cfg).named_parameters()
               if not (cfg.tie_word_embeddings and name == "lm_head.weight"))


def load_transient_bytes(cfg: ModelConfig, dtype: torch.dtype, on_cpu: bool = False, plain_weights: bool = True) -> int:
    """The load's peak above the loaded weights: the CPU engine packs one weight at a time with the old and
    the new copy alive together (runtime/cpu_linear.pack_model), so the largest of its packed matmuls' transients
    (cpu_linear.load_transient_per_param: Qwen3-30B-A3B's LM head, 0.58 GiB in bf16, is the largest) or the
    routed experts' (expert_pack_transient_bytes), whichever is larger. 0 off the CPU."""
    if not on_cpu:
        return 0
    linears = max((load_transient_per_param(dtype, k, plain_weights) * largest
                   for k, _, largest in packed_linear_sizes(cfg)), default=0)
    return max(linears, expert_pack_transient_bytes(cfg, dtype))


def expert_pack_transient_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """What packing a layer's routed experts adds above the weights held: one expert and a few pages where the
    fused kernel's C++ packer takes them (bf16 or quantized experts in a bf16 run) and hands each expert's
    loaded pages back once it is packed (runtime/expert_sources.py); else one layer's, new beside old (the
    per-expert oneDNN loop, float32 runs, the torch reference packer)."""
    layer = layer_expert_bytes(cfg, dtype)
    fused = dtype == torch.bfloat16 and (cfg.expert_format is not None or fused_enabled(dtype, "none"))
    if layer and fused and packs_expert_by_expert():
        return min(layer, layer // cfg.num_experts + EXPERT_PACK_SLACK)  # never more than the layer
    return layer


def run_activation_bytes(cfg: ModelConfig, dtype: torch.dtype, batch: int, prefill_tokens: int,
                         argmax_only: bool = False) -> int:
    """What the CPU engine holds beside the weights and the KV pool at its largest: a prefill pass of
    `prefill_tokens` tokens (or a decode step of `batch` rows) and `batch` sequences' logits sampled at once
    (`argmax_only`: every row greedy), by the function the planner's CPU-only placements count them with
    (hrm/operators.host_run_activation_bytes)."""
    from hrm.operators import host_run_activation_bytes
    from moelight.planning.held_model import held_model_spec

    m = held_model_spec(cfg)
    return int(host_run_activation_bytes(m, dtype_bytes(dtype), prefill_tokens, batch, argmax_only))


def layer_expert_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """One sparse layer's routed experts as the run holds them (quantized, or in `dtype`)."""
    e, h, f, form = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size, cfg.expert_format
    if not any(cfg.is_sparse(i) for i in range(cfg.num_layers)):
        return 0
    if form is None or dtype != torch.bfloat16:
        return e * 3 * h * f * dtype_bytes(dtype)
    return e * (form.matrix_bytes(2 * f, h) + form.matrix_bytes(h, f))


def kv_bytes(cfg: ModelConfig, tokens: int, dtype: torch.dtype, ranks: int = 1) -> int:
    """The host KV cache of `tokens` token slots. Tensor-parallel ranks split GQA's KV heads (the cache
    once in all), and each keep a whole copy of MLA's latent (moelight/parallel/__init__.py)."""
    copies = ranks if cfg.mla is not None else 1
    return copies * cfg.num_layers * cfg.kv_elements_per_token * tokens * dtype_bytes(dtype)


def _proc_bytes(path: str, field: str) -> int | None:
    """A `field:  N kB` line of a /proc file, in bytes; None where there is no such file or line."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def available_bytes() -> int:
    """MemAvailable from /proc/meminfo (what can be allocated without swapping)."""
    found = _proc_bytes("/proc/meminfo", "MemAvailable")
    return found if found is not None else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def peak_rss_bytes() -> int:
    """This process's peak resident memory: VmHWM of /proc/self/status where there is one. getrusage's
    ru_maxrss is kept across exec, so a job started from a large process (a notebook, a test runner: 7 GB)
    reported its parent's peak as its own."""
    found = _proc_bytes("/proc/self/status", "VmHWM")
    if found is not None:
        return found
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak_rss() -> int:
    """Reset this process's peak (VmHWM) to its resident memory now (Linux's /proc/self/clear_refs "5"), so a
    phase measured after it has a peak of its own (the memory benchmarks and probes); the resident bytes now."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return process_bytes()


def held_before_job(loaded: int) -> int:
    """Host memory this process holds or will hold that no HRM term counts: resident memory now less the model
    it holds (`loaded` bytes), and before its first load, what the engine adds (RUNTIME_GROWTH)."""
    return max(0, process_bytes() - loaded) + (0 if loaded else RUNTIME_GROWTH)


def process_bytes() -> int:
    """This process's resident memory now (/proc/self/statm; elsewhere its peak, which is no less)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return peak_rss_bytes()


def check_fits(cfg: ModelConfig, dtype: torch.dtype, batch_kv_tokens: int, available: int | None = None,
               ranks: int = 1, on_cpu: bool = False, hint: str = "use a smaller --batch-size",
               plain_weights: bool = True, batch: int = 0, prefill_tokens: int = 0, argmax_only: bool = False) -> dict:
    """Raise OutOfMemoryPlan naming the shortfall if the job's peak does not fit: the weights, and on the CPU
    engine the larger of the load's transient (load_transient_bytes) and what the run adds, one batch's KV
    pool (`batch_kv_tokens` slots) and its largest pass's activations (`batch` sequences, prefill chunks of
    `prefill_tokens`, `argmax_only`: every row greedy: run_activation_bytes); elsewhere weights + KV cache.
    `hint`: what to do when the weights fit (the batch's source: an option the user set names itself);
    `plain_weights`: as weight_bytes."""
    available = available_bytes() if available is None else available
    need_w = weight_bytes(cfg, dtype, on_cpu, plain_weights)
    need_kv = kv_bytes(cfg, batch_kv_tokens, dtype, ranks)
    need_act = (run_activation_bytes(cfg, dtype, batch, prefill_tokens, argmax_only)
                if on_cpu and (batch or prefill_tokens) else 0)
    need_load = load_transient_bytes(cfg, dtype, on_cpu, plain_weights)
    need = need_w + max(need_load, need_kv + need_act)
    budget = int(HEADROOM * available)
    if need > budget:
        gib = 2**30
        if need_w + need_load >= budget:
            hint = "use a machine with more memory, a smaller model or a lower-precision --dtype"
        if need_load > need_kv + need_act:
            terms = f"weights {need_w / gib:.2f} GiB + packing's transient {need_load / gib:.2f} GiB"
        else:
            terms = (f"weights {need_w / gib:.2f} GiB + KV cache {need_kv / gib:.2f} GiB "
                     f"(batch of {batch_kv_tokens} token slots)"
                     + (f" + activations {need_act / gib:.2f} GiB" if need_act else ""))
        raise OutOfMemoryPlan(
            f"does not fit in CPU memory: {terms} > {budget / gib:.2f} GiB usable "
            f"({HEADROOM:.0%} of {available / gib:.2f} GiB available), short by "
            f"{(need - budget) / gib:.2f} GiB; {hint}"
        )
    return {"weights_bytes": need_w, "kv_cache_bytes": need_kv, "activation_bytes": need_act,
            "load_transient_bytes": need_load, "peak_bytes": need, "budget_bytes": budget}


def run_sizes(workload, requests: int, batch: int, micro: int) -> dict:
    """check_fits's sizes for a batch as the planner counts them, from the plan's workload (hrm WorkloadSpec):
    the KV pool the engine reserves (pool_tokens), the batch's sequences and the prompt tokens of its largest
    prefill pass (prefill_pass_tokens: a pass never holds more than one micro-batch), and whether every row takes
    its argmax (argmax_only: the sampler copies no logits)."""
    batch = min(batch, requests)
    micro = min(micro, batch)
    return {"batch_kv_tokens": math.ceil(workload.pool_tokens(batch)), "batch": batch,
            "prefill_tokens": math.ceil(workload.prefill_pass_tokens(micro)), "argmax_only": workload.argmax_only}
