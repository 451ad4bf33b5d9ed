"""Measure the GPU-side HRM terms on this machine (`moelight profile` with CUDA).

Every term the presets take from publications (hrm/hardware_presets.py) is measured here
with the kernels and copies the runtime uses, so a user's own GPU replaces the preset:
- the link: pinned and pageable H2D / D2H at several sizes, fitted as a fixed cost per
  copy plus bytes / rate (the small copies give the cost, the large ones the rate);
- the first paging hop: pageable -> pinned copy rate with the threads torch gives the
  runtime's copy lane (measured on any host: no GPU needed);
- GPU memory bandwidth (device copy), sustained matmul FLOP/s per dtype (a large GEMM
  repeated long enough for the clock to settle under the power cap);
- the expert GEMMs at the rows per expert a micro-batch produces, grouped as the runtime runs
  them (models/grouped_experts.py: one grouped GEMM per matrix where the GPU has it, one GEMM per
  expert elsewhere), over more weights than the L2 holds; the weights' streaming rate at few rows
  is the HRM's gemm_bandwidth, FLOP/s by rows its GEMM curve;
- decode attention's KV read rate (the runtime's batched kernel) and prefill attention's FLOP/s on the GPU;
- the dispatch cost of a layer pass: launches of tiny kernels, times the kernels of a layer.
"""

from __future__ import annotations

from moelight.profiling.timing import best_time

# an eager layer pass of the CGOPipe runtime, as its run report counts them (launches_per_layer_pass): ~65 with
# the experts in one group, ~90 with a resident and a paged group; independent of the expert count
KERNELS_PER_LAYER = 90
COPY_SIZES = (64 * 2**10, 2**20, 16 * 2**20, 128 * 2**20)
EXPERT_ROWS = (4, 16, 64, 256, 1024)


def fit_copy_cost(sizes, seconds) -> tuple[float, float]:
    """(fixed seconds per copy, bytes/s) of copies timed at `sizes`: the rate from the two largest,
    the fixed cost what the smallest takes beyond its bytes at that rate (never negative)."""
    (s1, t1), (s2, t2) = sorted(zip(sizes, seconds, strict=True))[-2:]
    rate = (s2 - s1) / max(t2 - t1, 1e-12) if t2 > t1 else s2 / t2
    rate = min(rate, s2 / t2 * 4)  # noise guard: no more than 4x the plain large-copy rate
    s0, t0 = min(zip(sizes, seconds, strict=True))
    return max(0.0, t0 - s0 / rate), rate


def measure_staging(quick: bool = False) -> float:
    """Bytes/s of the pageable -> pinned copy on a host thread (the runtime's pin lane), with
    torch's thread count; a plain buffer stands in for pinned memory without CUDA."""
    import threading

    import torch

    n = (64 if quick else 256) * 2**20
    src = torch.ones(n, dtype=torch.uint8)
    pinned = torch.cuda.is_available()
    dst = torch.empty(n, dtype=torch.uint8, pin_memory=pinned)
    result: list[float] = []

    def lane() -> None:  # a separate thread, as the executor's pin lane is
        result.append(n / best_time(lambda: dst.copy_(src), 3 if quick else 5, lambda: None))

    t = threading.Thread(target=lane)
    t.start()
    t.join()
    return result[0]


def measure_link(quick: bool = False):
    """An hrm Link: pinned and pageable rates per direction and the fixed cost per copy."""
    import torch

    from hrm.hardware import Link

    dev, sync = torch.device("cuda:0"), torch.cuda.synchronize
    sizes = COPY_SIZES[:-1] if quick else COPY_SIZES
    rates, latency = {}, []
    for pinned in (True, False):
        for direction in ("h2d", "d2h"):
            times = []
            for size in sizes:
                host = torch.empty(size, dtype=torch.uint8, pin_memory=pinned)
                gpu = torch.empty(size, dtype=torch.uint8, device=dev)
                src, dst = (host, gpu) if direction == "h2d" else (gpu, host)
                times.append(best_time(lambda d=dst, s=src, nb=pinned: d.copy_(s, non_blocking=nb), 5, sync))
            fixed, rate = fit_copy_cost(sizes, times)
            rates[(pinned, direction)] = rate
            if pinned:
                latency.append(fixed)
    return Link(h2d=rates[(True, "h2d")], d2h=rates[(True, "d2h")], pageable_h2d=rates[(False, "h2d")],
                pageable_d2h=rates[(False, "d2h")], latency_s=sum(latency) / len(latency))


def measure_expert_gemm(dtype, quick: bool = False) -> tuple[float, list[list[float]]]:
    """(weight bytes/s at few rows per expert, [[rows, FLOP/s], ...]) of the experts' three GEMMs
    (gate/up [2f, h] then down [h, f]) over 8 experts, more bytes than the L2 holds, run as the runtime
    runs them on this GPU and dtype (grouped_experts.py: grouped_mm, else the padded bmm, else a loop)."""
    import torch
    import torch.nn.functional as F

    from moelight.models.grouped_experts import PADDED_MAX_TOKENS, grouped_mm_supported

    dev, sync = torch.device("cuda:0"), torch.cuda.synchronize
    h, f, n_exp = (2048, 4096, 4) if quick else (4096, 8192, 8)
    gu = [torch.randn(2 * f, h, device=dev, dtype=dtype) for _ in range(n_exp)]
    dn = [torch.randn(h, f, device=dev, dtype=dtype) for _ in range(n_exp)]
    weight_bytes = n_exp * 3 * h * f * gu[0].element_size()
    grouped = grouped_mm_supported(dev, dtype)
    gu_stack, dn_stack = torch.stack(gu), torch.stack(dn)
    curve, stream = [], []
    for rows in EXPERT_ROWS[:-1] if quick else EXPERT_ROWS:
        x = torch.randn(rows, h, device=dev, dtype=dtype)

        if grouped:
            xs = x.repeat(n_exp, 1)
            offs = torch.arange(1, n_exp + 1, device=dev, dtype=torch.int32) * rows

            def experts(xs=xs, offs=offs) -> None:
                g, u = torch._grouped_mm(xs, gu_stack.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
                torch._grouped_mm(F.silu(g) * u, dn_stack.transpose(-2, -1), offs=offs)
        elif rows <= PADDED_MAX_TOKENS:  # the padded bmm the runtime runs where _grouped_mm has no grouped kernel
            xb = x.expand(n_exp, rows, h)

            def experts(xb=xb) -> None:
                g, u = torch.bmm(xb, gu_stack.transpose(-2, -1)).chunk(2, dim=-1)
                torch.bmm(F.silu(g) * u, dn_stack.transpose(-2, -1))
        else:  # the per-expert loop, as the runtime runs larger passes there
            def experts(x=x) -> None:
                for a, b in zip(gu, dn, strict=True):
                    g, u = F.linear(x, a).chunk(2, dim=-1)
                    F.linear(F.silu(g) * u, b)

        t = best_time(experts, 3 if quick else 5, sync)
        curve.append([float(rows), 6.0 * h * f * rows * n_exp / t])
        if rows <= 64:
            stream.append(weight_bytes / t)
    return max(stream), curve


def measure_gpu_attention(dtype, quick: bool = False) -> tuple[float, float]:
    """(decode attention KV bytes/s, prefill attention FLOP/s) on the GPU, Mixtral's head layout."""
    import torch
    import torch.nn.functional as F

    from moelight.devices.device_attention import batched_decode_attention

    dev, sync = torch.device("cuda:0"), torch.cuda.synchronize
    hq, hkv, d = 32, 8, 128
    seqs, ctx = (16, 256) if quick else (64, 512)
    total = seqs * ctx
    k = torch.randn(hkv, total, d, device=dev, dtype=dtype)
    v = torch.randn_like(k)
    q = torch.randn(seqs, hq, d, device=dev, dtype=dtype)
    offsets = torch.arange(seqs, dtype=torch.int64, device=dev) * ctx
    lengths = torch.full((seqs,), ctx, dtype=torch.int64, device=dev)
    t = best_time(lambda: batched_decode_attention(q, k, v, offsets, lengths, ctx, d**-0.5), 5, sync)
    kv_bw = 2.0 * total * hkv * d * k.element_size() / t
    p = 512 if quick else 2048
    qp = torch.randn(4, hq, p, d, device=dev, dtype=dtype)
    kp = torch.randn(4, hq, p, d, device=dev, dtype=dtype)
    t = best_time(lambda: F.scaled_dot_product_attention(qp, kp, kp, is_causal=True), 5, sync)
    return kv_bw, 2.0 * hq * d * p * p * 4 / t


def measure_launch_overhead(quick: bool = False) -> float:
    """Seconds per eager kernel launch (a tiny in-place add, enqueued back to back)."""
    import torch

    x = torch.zeros(1, device="cuda:0")
    n = 200 if quick else 2000

    def burst() -> None:
        for _ in range(n):
            x.add_(1.0)

    return best_time(burst, 3, torch.cuda.synchronize) / n
