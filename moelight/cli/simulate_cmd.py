"""`moelight simulate`: time a CGOPipe (or comparison) schedule with HRM costs, no GPU needed."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import typer

from moelight.cli.errors import user_errors
from moelight.cli.held_experts import QUANTIZE_HELP, check_quantize, held_config, held_line
from moelight.cli.workload_options import PREFILL_CHUNK_OPTION, SHARED_PREFIX_OPTION
from moelight.errors import ConfigError
from moelight.loading.hub_cache import model_folder
from moelight.planning.held_model import held_model_spec

SCHEDULE_HELP = "cgopipe | flexgen | flexgen-cpu | overlap-unpaged | all"
BOUNDS = {"schedule": "the task graph's critical path", "link": "the host links (transfers and all-reduce traffic)",
          "host": "host memory bandwidth (staging copies, the links' DMA, CPU attention)"}


def format_result(res) -> str:
    p = res.policy
    util = ", ".join(f"{k} {v:.1%}" for k, v in res.utilisation.items())
    return "\n".join(
        [
            f"schedule {res.schedule}: {res.model} on {res.hardware}",
            f"  decode step bound by {BOUNDS[res.bound]}",
            f"  policy N={p.batch_size} = mu {p.micro_batch_size} x {p.num_micro_batches}, r_w={p.r_w:.4f}, "
            f"dtype {p.dtype}",
            f"  per layer (decode) {res.layer_seconds * 1e3:.2f} ms, step {res.step_seconds:.3f} s, "
            f"prefill {res.prefill_seconds:.2f} s per batch",
            f"  lane utilisation (decode step): {util}",
            f"  throughput: decode {res.decode_tok_s:.1f} tok/s, end-to-end {res.e2e_tok_s:.1f} tok/s",
        ]
    )


def simulation_json(results, predicted, work, extra: dict) -> str:
    """--json: the policy, the HRM's predicted and each schedule's simulated figures (seconds, tok/s, lane busy
    shares of the decode step), and cgopipe's speed-up over the others, as the text prints them."""
    pol = results[0].policy
    out = {"model": results[0].model, "hardware": results[0].hardware, "workload": work.to_dict(),
           "policy": pol.to_dict(),
           "predicted": {"prefill_tok_s": predicted.prefill_tok_s, "decode_tok_s": predicted.decode_tok_s,
                         "e2e_tok_s": predicted.e2e_tok_s, "prefill_seconds": predicted.prefill_time,
                         "step_seconds": predicted.decode_step_time},
           "simulated": [{"schedule": r.schedule, "bound": r.bound, "layer_seconds": r.layer_seconds,
                          "step_seconds": r.step_seconds, "prefill_seconds": r.prefill_seconds,
                          "decode_tok_s": r.decode_tok_s, "e2e_tok_s": r.e2e_tok_s,
                          "lane_busy": dict(r.utilisation)} for r in results]}
    base = next((r for r in results if r.schedule == "cgopipe"), results[0])
    out["cgopipe_speedup"] = ({r.schedule: base.e2e_tok_s / r.e2e_tok_s for r in results if r is not base}
                              if len(results) > 1 else {})
    return json.dumps(out | extra, indent=2)


def register(app: typer.Typer) -> None:
    @app.command("simulate")
    def simulate(
        model: str = typer.Option(..., "--model", "-m", help="preset name or a directory with config.json"),
        hardware: str = typer.Option(
            "t4", "--hardware", help="preset (t4, l4, s1, s2...), 'profile' or JSON"
        ),
        gpus: int | None = typer.Option(None, "--gpus", min=1, help="GPUs (tensor parallel; default: the preset's)"),
        shared_link: bool = typer.Option(False, "--shared-link", help="the GPUs share one host link"),
        policy: str = typer.Option("auto", "--policy", help="'auto' (the planner's) or a policy JSON file"),
        schedule: str = typer.Option("cgopipe", "--schedule", help=SCHEDULE_HELP),
        prompt_len: float = typer.Option(77, "--prompt-len", help="mean prompt length"),
        gen_len: int = typer.Option(128, "--gen-len", help="tokens generated per request"),
        max_prompt_len: int | None = typer.Option(None, "--max-prompt-len", help="longest prompt"),
        padded: bool = typer.Option(False, "--padded", help="pad prompts to --max-prompt-len (FlexGen; needs it)"),
        prefill_chunk: int = PREFILL_CHUNK_OPTION,
        shared_prefix: float = SHARED_PREFIX_OPTION,
        dtype: str = typer.Option("auto", "--dtype", help="for --policy auto; auto: the GPU's faster 16-bit type"),
        quantize: str = typer.Option("none", "--quantize", help=QUANTIZE_HELP),
        family: str = typer.Option("cgopipe", "--family", help="planner family for --policy auto"),
        gantt: Path | None = typer.Option(None, "--gantt", help="write the decode-step timeline PNG here"),
        as_json: bool = typer.Option(False, "--json", help="print the simulation as JSON (README: the fields)"),
    ) -> None:
        """Simulate one batch: prefill, then decode steps, with the schedule's task graph."""
        from hrm import get_hardware, get_model
        from moelight.cli.workload_options import check_dtype_rates, compute_dtype, warn_if_busy, workload_from_options
        from moelight.jobs.path_checks import check_image_file
        from moelight.planning.job_plan import check_policy_fits

        if gantt is not None:
            with user_errors():
                check_image_file(gantt, "--gantt")
        from moelight.pipeline.schedule import SCHEDULES
        from moelight.pipeline.schedule_simulator import simulate_policy
        from optimizer import InfeasibleError, Policy, evaluate_policy, plan
        from optimizer.search import FAMILIES

        if family not in FAMILIES:
            raise typer.BadParameter(f"unknown family {family!r}; valid: {', '.join(FAMILIES)}", param_hint="--family")
        names = list(SCHEDULES) if schedule == "all" else [schedule]
        if any(n not in SCHEDULES for n in names):
            raise typer.BadParameter(
                f"unknown schedule {schedule!r}; valid: {SCHEDULE_HELP}", param_hint="--schedule"
            )
        try:
            mspec = get_model(model_folder(model))
            hw = get_hardware(hardware)
        except (KeyError, FileNotFoundError, ValueError, ConfigError) as e:
            raise typer.BadParameter(str(e.args[0] if isinstance(e, KeyError) else e)) from None
        warn_if_busy(hw)
        if not hw.has_gpu:
            raise typer.BadParameter(
                f"hardware {hw.name!r} has no GPU: the schedules need one", param_hint="--hardware"
            )
        hw = replace(hw.with_gpus(gpus) if gpus else hw, link_shared=shared_link or hw.link_shared)
        try:
            mspec.check_tensor_parallel(hw.gpu_count)
        except ValueError as e:
            raise typer.BadParameter(str(e)) from None
        try:
            dtype = hw.preferred_dtype() if dtype == "auto" else compute_dtype(dtype)
        except ValueError as e:
            raise typer.BadParameter(str(e), param_hint="--dtype") from None
        check_dtype_rates(hw, dtype, hardware)
        check_quantize(quantize)
        held = held_config(model_folder(model), dtype, "cuda", quantize, hw.gpu_count)
        mspec = held_model_spec(held, mspec.name)
        form = held.expert_format
        if form is not None and not as_json:
            typer.echo(held_line(form, quantize, mspec.expert_bits))
        work = workload_from_options(mspec, prompt_len, gen_len, max_prompt_len, padded, prefill_chunk,
                                      shared_prefix)
        if policy == "auto":
            try:
                predicted = plan(hw, mspec, work, dtype=dtype, family=family)
                pol = predicted.policy
            except InfeasibleError as e:
                typer.echo(f"error: {e}", err=True)
                raise typer.Exit(2) from None
        else:
            path = Path(policy)
            if not path.is_file():
                raise typer.BadParameter(f"policy file not found: {path}", param_hint="--policy")
            try:
                pol = Policy.load(path)
            except (ValueError, TypeError, KeyError) as e:
                raise typer.BadParameter(f"{path}: not a policy JSON ({e})", param_hint="--policy") from None
            with user_errors():
                check_policy_fits(pol, hw, mspec, work, f"--policy {path}")
            predicted = evaluate_policy(hw, mspec, work, pol)
        if pol.attn_on_gpu or not pol.ffn_on_gpu:
            typer.echo(
                "note: the schedules place attention by themselves and the MoE FFN on the GPU; "
                "the policy's A_g/F_g are not used",
                err=True,
            )
        results = [simulate_policy(hw, mspec, work, pol, n) for n in names]
        extra = {}
        if gantt is not None:
            from moelight.pipeline.gantt import draw_gantt

            extra["gantt"] = str(draw_gantt([(f"{r.schedule} on {hw.name}", r.step) for r in results], gantt))
        if form is not None:
            extra["quantize"] = {"format": quantize, "held_as": form.fmt, "group": form.group, "origin": form.origin,
                                 "expert_bits_per_weight": mspec.expert_bits}
        if as_json:
            typer.echo(simulation_json(results, predicted, work, extra))
            return
        for r in results:
            typer.echo(format_result(r))
        if len(results) > 1:
            base = next((r for r in results if r.schedule == "cgopipe"), results[0])
            typer.echo(
                "speed-up of cgopipe: "
                + ", ".join(
                    f"{base.e2e_tok_s / r.e2e_tok_s:.2f}x vs {r.schedule}" for r in results if r is not base
                )
            )
        if "gantt" in extra:
            typer.echo(f"gantt: {extra['gantt']}")
