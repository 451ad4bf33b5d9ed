"""`moelight profile`: measure this machine and cache it as the HRM hardware profile."""

from __future__ import annotations

from pathlib import Path

import typer

from hrm.hardware_presets import DEFAULT_PROFILE_PATH


def _describe(hw) -> str:
    g = 2.0**30
    c = hw.cpu
    lines = [f"CPU  {c.name}: {c.memory_bytes / g:.1f} GiB, read {c.bandwidth / 1e9:.1f} GB/s, "
             + ", ".join(f"{k} {v / 1e12:.2f} TFLOP/s" for k, v in hw.cpu.flops.items())]
    for dt, curve in c.gemm_flops.items():
        form = c.gemm_form if dt == "bfloat16" and c.gemm_form else "packed"  # the weights' form it measured
        lines.append(f"     GEMM {dt} ({form}, GFLOP/s by rows M): "
                     + ", ".join(f"{m:g}: {f / 1e9:.0f}" for m, f in curve))
    for dt, curve in c.expert_gemm_flops.items():
        lines.append(f"     routed experts {dt} (fused kernel, GFLOP/s by rows per expert): "
                     + ", ".join(f"{m:g}: {f / 1e9:.0f}" for m, f in curve))
    if c.attention_bandwidth or c.attention_flops:
        lines.append(f"     attention kernels: decode reads KV at {c.attention_bandwidth / 1e9:.1f} GB/s, "
                     "prefill "
                     + ", ".join(f"{k} {v / 1e9:.0f} GFLOP/s" for k, v in c.attention_flops.items()))
    if c.elementwise_bandwidth:
        lines.append(f"     element-wise ops between the matmuls: {c.elementwise_bandwidth / 1e9:.1f} GB/s")
    if c.layer_overhead_s or c.step_overhead_s:
        lines.append(f"     fixed costs: {c.layer_overhead_s * 1e3:.2f} ms per layer pass (beside its kernels), "
                     f"{c.step_overhead_s * 1e3:.2f} ms per micro-batch step")
    if c.sequence_step_s:
        lines.append(f"     host work per sequence: {c.sequence_step_s * 1e6:.1f} us per decode step")
    if c.logits_bandwidth:
        lines.append(f"     passes over a step's logits (widen, check, argmax): {c.logits_bandwidth / 1e9:.1f} GB/s")
    if c.kv_first_touch_bandwidth:
        lines.append("     first writes into a fresh KV cache pool (page faults): "
                     f"{c.kv_first_touch_bandwidth / 1e9:.2f} GB/s")
    if hw.staging_bandwidth:
        lines.append(f"     pageable -> pinned copy (the first paging hop): {hw.staging_bandwidth / 1e9:.1f} GB/s")
    if hw.has_gpu:
        gp = hw.gpu
        lines.append(f"GPU  {hw.gpu_count} x {gp.name}: {gp.memory_bytes / g:.1f} GiB, {gp.bandwidth / 1e9:.0f} GB/s, "
                     + ", ".join(f"{k} {v / 1e12:.1f} TFLOP/s" for k, v in gp.flops.items()))
        for dt, curve in gp.gemm_flops.items():
            lines.append(f"     expert GEMM {dt} (TFLOP/s by rows per expert): "
                         + ", ".join(f"{m:g}: {f / 1e12:.2f}" for m, f in curve)
                         + f"; weights stream at {gp.gemm_bandwidth / 1e9:.0f} GB/s at few rows")
        if gp.attention_bandwidth:
            lines.append(f"     attention: decode reads KV at {gp.attention_bandwidth / 1e9:.0f} GB/s, prefill "
                         + ", ".join(f"{k} {v / 1e12:.1f} TFLOP/s" for k, v in gp.attention_flops.items()))
        if gp.layer_overhead_s:
            lines.append(f"     dispatch: {gp.layer_overhead_s * 1e3:.2f} ms per layer pass (kernel launches)"
                         + (f", {gp.runtime_layer_s * 1e3:.2f} ms through the CGOPipe runtime"
                            if gp.runtime_layer_s else ""))
        lk = hw.link
        lines.append(f"link H2D {lk.h2d / 1e9:.1f} GB/s, D2H {lk.d2h / 1e9:.1f} GB/s pinned; pageable "
                     f"{lk.pageable_h2d / 1e9:.1f} / {lk.pageable_d2h / 1e9:.1f} GB/s; "
                     f"{lk.latency_s * 1e6:.1f} us per copy")
    else:
        lines.append("GPU  none (CUDA not available)")
    return "\n".join(lines)


def register(app: typer.Typer) -> None:
    @app.command("profile")
    def profile(
        output: Path = typer.Option(DEFAULT_PROFILE_PATH, "--output", "-o", help="JSON profile path"),
        quick: bool = typer.Option(False, "--quick", help="smaller buffers: faster, noisier"),
    ) -> None:
        """Measure CPU bandwidth, the engine's GEMM / attention speeds and overheads (GPU, link with CUDA)."""
        import moelight.engine  # noqa: F401  (lends the profile its probe of the host's work per sequence)
        from moelight.cli.errors import user_errors
        from moelight.jobs.path_checks import check_output_file
        from moelight.profiling.host_load import busy_warning
        from moelight.profiling.machine_profile import profile_machine

        with user_errors():
            check_output_file(output, "--output")
        hw = profile_machine(quick=quick)
        try:
            path = hw.save(output)
        except OSError as e:
            typer.echo(f"error: cannot write {output}: {e}", err=True)
            raise typer.Exit(2) from None
        typer.echo(_describe(hw))
        typer.echo(f"saved to {path}")
        warning = busy_warning(hw.notes)
        if warning:
            typer.echo(warning, err=True)
