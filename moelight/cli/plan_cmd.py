"""`moelight plan`: the HRM policy for a model on a machine, and why."""

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


def _fmt_mem(parts: dict[str, float], cap: float) -> str:
    """Sizes in GiB, or MiB for a small device (never '0.00 / 0.00 GiB')."""
    from optimizer.policy import size_text

    body = ", ".join(f"{k} {size_text(v)}" for k, v in parts.items())
    return f"{size_text(sum(parts.values()))} / {size_text(cap)} usable ({body})"


def format_plan(res) -> str:
    """Human-readable plan: the policy, predicted throughput, per-layer split, memory, reason."""
    from optimizer.policy import share_text
    from optimizer.policy import time_text as t

    p = res.policy
    lt = res.layer_times
    lines = [
        f"model {res.model} on {res.hardware}  dtype {p.dtype}  family {res.family}",
        f"policy: N={p.batch_size} = mu {p.micro_batch_size} x {p.num_micro_batches} micro-batches, "
        f"attention on {'GPU' if p.attn_on_gpu else 'CPU'} (A_g={p.A_g}), MoE FFN on "
        f"{'GPU' if p.ffn_on_gpu else 'CPU'} (F_g={p.F_g}), r_w={share_text(p.r_w)}, r_c={share_text(p.r_c)}",
        f"predicted: prefill {res.prefill_tok_s:.1f} tok/s, decode {res.decode_tok_s:.1f} tok/s, "
        f"end-to-end {res.e2e_tok_s:.2f} tok/s",
        f"per layer (decode): T_link {t(lt['T_link'])} (H2D {t(lt['T_h2d'])}, D2H {t(lt['T_d2h'])}), "
        f"T_host {t(lt['T_host'])}, T_cpu {t(lt['T_cpu'])}, T_gpu {t(lt['T_gpu'])} "
        f"-> bound by {res.binding}",
        f"prefill {_seconds(res.prefill_time)} per batch, decode step {t(res.decode_step_time)}",
    ]
    lines.append(runs_as(p))
    if res.gpu_memory:
        lines.append("GPU memory: " + _fmt_mem(res.gpu_memory, res.gpu_capacity))
    lines.append("CPU memory: " + _fmt_mem(res.cpu_memory, res.cpu_capacity))
    lines.append("why:\n  " + res.reason.replace("\n", "\n  "))
    lines.append(f"planned in {res.solve_seconds * 1e3:.0f} ms over {res.grid_points} grid points")
    return "\n".join(lines)


def _seconds(s: float) -> str:
    from optimizer.policy import time_text

    return f"{s:.2f} s" if s >= 0.1 else time_text(s)


def runs_on(p) -> dict[str, list[str]]:
    """Which runtime of `moelight run` executes this placement, as --json's "runs_as": the devices and the
    schedules (none on a device: the plain CPU executor; both empty: no runtime). The default family searches
    all four of the paper's placements, and a device's runtime runs two of them (`run` plans only its schedule's)."""
    from moelight.pipeline.schedule import SCHEDULE_FAMILY
    from optimizer.search import FAMILIES

    placement = (int(p.attn_on_gpu), int(p.ffn_on_gpu))
    schedules = [s for s, fam in SCHEDULE_FAMILY.items() if FAMILIES[fam][0] == placement]
    if schedules:
        return {"devices": ["cuda", "emulated"], "schedules": schedules}
    return {"devices": ["cpu"] if placement == (0, 0) else [], "schedules": []}


def runs_as(p) -> str:
    """The 'runs as' line of the text: runs_on's runtime as the command that runs it."""
    where = runs_on(p)
    if where["schedules"]:
        return f"runs as: moelight run --device cuda|emulated --schedule {' | '.join(where['schedules'])}"
    if where["devices"]:
        return "runs as: moelight run --device cpu"
    return ("runs as: none (no runtime puts attention on the GPU and the FFN on the CPU; `moelight run` "
            "on a device plans --family cgopipe, or flexgen with --schedule flexgen)")


def used_hw(hw, gpus):
    return hw.with_gpus(gpus) if gpus is not None else hw


def _modes(res, hw, mspec, workload, requests: int, opts) -> tuple[str, dict]:
    """Both modes' predictions for the job and the one --mode picks, with the reason, as text and as the
    --json output's "mode" entry: the choice is `apply_mode`'s, the one `moelight run` makes for the same job."""
    if opts.mode == "throughput":
        return "", {}
    from moelight.planning.job_plan import JobPlan
    from moelight.planning.mode_choice import ModeError, apply_mode
    from optimizer import fit_policy, predict_job

    policy = fit_policy(res.policy, requests)
    pred = predict_job(hw, mspec, workload, policy, requests, policy.batch_size, policy.micro_batch_size)
    job = JobPlan(policy.batch_size, policy.micro_batch_size, policy, hw, {}, pred, res.policy)
    # a GPU runtime (cuda or emulated): a host without GPU is refused for the hardware, not the device
    chosen = apply_mode(job, replace(opts, mode="auto"), mspec, workload, requests, "cuda", max(1, hw.gpu_count))
    lat, why_not = chosen.info.get("latency_prediction"), chosen.info["mode_reason"].removeprefix("throughput mode: ")
    if opts.mode == "latency" and lat is None:
        raise ModeError(f"--mode latency: {why_not}")
    thr = pred["end_to_end_tokens_per_s"]
    lines = [f"modes for a job of {requests} requests:",
             f"  throughput (CGOPipe, batch {min(requests, policy.batch_size)}): {thr:.1f} tok/s end-to-end"]
    if lat is None:
        lines.append(f"  latency: cannot run here ({why_not})")
    else:
        lines.append(f"  latency (batch {lat['batch_size']}, {lat['slots']} expert slots, {opts.cache_policy_name()}, "
                     f"hit rate {lat['hit_rate']:.0%} assumed): {lat['end_to_end_tokens_per_s']:.1f} tok/s end-to-end, "
                     f"{lat['tpot_ms']:.1f} ms per token ({1e3 * lat['fetch_seconds_per_layer']:.2f} ms of misses "
                     f"and {1e3 * lat['compute_seconds_per_layer']:.2f} ms of compute per layer)")
    pick = opts.mode if opts.mode != "auto" else chosen.info["mode"]
    why = "asked for" if opts.mode != "auto" else "the faster for this job"
    lines.append(f"mode: {pick} ({why})")
    batch = lat["batch_size"] if pick == "latency" else min(requests, policy.batch_size)
    # "policy" stays the throughput plan (what --save-policy writes); the batch that runs is here
    summary = {"mode": pick, "reason": chosen.info["mode_reason"], "requests": requests, "batch_size": batch,
               "throughput_e2e_tok_s": thr, "latency": lat,
               "cache": {"slots": lat["slots"], "policy": opts.cache_policy_name()} if lat else None}
    return "\n".join(lines), summary


def _mode_options(model: str, mode: str, cache_policy: str, cache_size: float | None):
    """The EngineOptions `apply_mode` reads, checked as `run` checks them (no file: plan loads none)."""
    from moelight.engine.options import EngineOptions, OptionError
    from moelight.expert_cache.policy_registry import POLICIES

    if cache_policy not in ("auto", *POLICIES):
        raise OptionError(f"--cache-policy {cache_policy!r} is not one of the valid choices: auto, "
                          f"{', '.join(POLICIES)}")
    opts = EngineOptions(model=model, mode=mode, cache_policy=cache_policy, cache_size=cache_size)
    replace(opts, cache_policy="auto").validate()  # --cache-size's bounds; the policy's files are run's business
    return opts


def register(app: typer.Typer) -> None:
    @app.command("plan")
    def plan(
        model: str = typer.Option(..., "--model", "-m", help="preset name or a directory with config.json"),
        hardware: str = typer.Option("profile", "--hardware", help="preset, 'profile', or a JSON path"),
        gpus: int | None = typer.Option(None, "--gpus", help="GPUs (tensor parallel; 0 = CPU only)"),
        shared_link: bool = typer.Option(False, "--shared-link", help="the GPUs share one host link"),
        prompt_len: float = typer.Option(77, "--prompt-len", help="mean prompt length"),
        gen_len: int = typer.Option(128, "--gen-len", help="tokens generated per request"),
        max_prompt_len: int | None = typer.Option(None, "--max-prompt-len", help="longest prompt"),
        padded: bool = typer.Option(False, "--padded", help="pad prompts to --max-prompt-len (FlexGen; needs it)"),
        prefill_chunk: int = PREFILL_CHUNK_OPTION,
        shared_prefix: float = SHARED_PREFIX_OPTION,
        dtype: str = typer.Option("auto", "--dtype", help="auto (the GPU's faster 16-bit type), or a dtype"),
        family: str = typer.Option("moelight", "--family", help="moelight | cgopipe | flexgen | cpu"),
        profile_path: Path | None = typer.Option(None, "--profile-path", help="profile JSON for 'profile'"),
        as_json: bool = typer.Option(False, "--json", help="print the plan as JSON"),
        plot: Path | None = typer.Option(None, "--plot", help="write HRM roofline PNGs to this directory"),
        save_policy: Path | None = typer.Option(None, "--save-policy", help="write the policy JSON here"),
        mode: str = typer.Option("throughput", "--mode", help="throughput (CGOPipe), latency (a device expert "
                                 "cache), or auto: predict both for --requests and pick the faster"),
        requests: int | None = typer.Option(None, "--requests", min=1, help="requests in the job (for --mode; "
                                            "default: the throughput plan's batch)"),
        cache_policy: str = typer.Option("auto", "--cache-policy", help="latency mode's expert cache (as `run "
                                         "--cache-policy`; auto: combined): a policy that runs small misses on "
                                         "the CPU is predicted so"),
        cache_size: float | None = typer.Option(None, "--cache-size", help="latency mode: expert slots, a share "
                                                "(< 1) or a count (as `run --cache-size`; default: what fits)"),
        quantize: str = typer.Option("none", "--quantize", help=QUANTIZE_HELP),
    ) -> None:
        """Search the HRM policy (batch, micro-batch, placement, r_w, r_c) and explain it."""
        from hrm import get_hardware, get_model
        from moelight.cli.workload_options import check_dtype_rates, compute_dtype, warn_if_busy, workload_from_options
        from moelight.jobs.path_checks import check_output_dir, check_output_file

        with user_errors():
            if plot is not None:
                check_output_dir(plot, "--plot")
            if save_policy is not None:
                check_output_file(save_policy, "--save-policy")
        from optimizer import InfeasibleError
        from optimizer import plan as run_plan
        from optimizer.search import FAMILIES

        try:
            folder = model_folder(model)
            name = get_model(folder).name  # a preset or a folder, named as simulate names it
        except KeyError as e:
            raise typer.BadParameter(str(e.args[0]), param_hint="--model") from None
        except (FileNotFoundError, ValueError, ConfigError) as e:
            raise typer.BadParameter(str(e), param_hint="--model") from None
        try:
            if profile_path is not None and hardware.lower() != "profile":
                raise typer.BadParameter(f"{profile_path}: read with --hardware profile only (--hardware is "
                                         f"{hardware!r}); drop it, or give --hardware profile",
                                         param_hint="--profile-path")
            hw = get_hardware(hardware, profile_path)
        except KeyError as e:
            raise typer.BadParameter(str(e.args[0]), param_hint="--hardware") from None
        except FileNotFoundError as e:
            hint = " (run `moelight profile` first, or pass a preset)" if hardware == "profile" else ""
            raise typer.BadParameter(f"{e}{hint}", param_hint="--hardware") from None
        except ValueError as e:
            raise typer.BadParameter(str(e), param_hint="--hardware") from None
        warn_if_busy(hw)
        try:
            if dtype == "auto":
                dtype = "bfloat16" if gpus == 0 else hw.preferred_dtype()
            dtype = compute_dtype(dtype)
        except ValueError as e:
            raise typer.BadParameter(str(e), param_hint="--dtype") from None
        # the CPU family plans without the GPU's rates
        check_dtype_rates(hw.with_gpus(0) if gpus == 0 or family == "cpu" else hw, dtype, hardware, profile_path)
        check_quantize(quantize)
        on_gpu = gpus != 0 and hw.has_gpu
        held = held_config(folder, dtype, "cuda" if on_gpu else "cpu", quantize,
                            max(1, hw.gpu_count if gpus is None else gpus) if on_gpu else 1)
        mspec = held_model_spec(held, name)
        workload = workload_from_options(mspec, prompt_len, gen_len, max_prompt_len, padded, prefill_chunk,
                                           shared_prefix)
        if family not in FAMILIES:
            raise typer.BadParameter(f"unknown family {family!r}; valid: {', '.join(FAMILIES)}",
                                     param_hint="--family")
        if gpus is not None and gpus < 0:
            raise typer.BadParameter("must be >= 0", param_hint="--gpus")
        if shared_link:
            hw = replace(hw, link_shared=True)
        try:
            res = run_plan(hw, mspec, workload, dtype, gpus=gpus, family=family)
        except (InfeasibleError, ValueError) as e:  # a job too big, --gpus on a host without GPU, ...: exit 2
            advice = ""
            if isinstance(e, InfeasibleError):
                ranks = max(1, hw.gpu_count if gpus is None else gpus) if on_gpu else 1
                advice = _quantize_advice(held, quantize, ranks, name,
                                          lambda spec: run_plan(hw, spec, workload, dtype, gpus=gpus, family=family))
            typer.echo(f"error: {e}{advice}", err=True)
            raise typer.Exit(2) from None
        if mode not in ("throughput", "latency", "auto"):
            raise typer.BadParameter(f"{mode!r}: choose throughput, latency or auto", param_hint="--mode")
        with user_errors():
            opts = _mode_options(model, mode, cache_policy, cache_size)
            lines, modes = _modes(res, used_hw(hw, gpus), mspec, workload, requests or res.policy.batch_size, opts)
        form = held.expert_format
        if as_json:
            extra = {"runs_as": runs_on(res.policy)} | ({"mode": modes} if modes else {})
            if form is not None:
                extra["quantize"] = {"format": quantize, "held_as": form.fmt, "group": form.group,
                                     "origin": form.origin, "expert_bits_per_weight": mspec.expert_bits}
            typer.echo(json.dumps(json.loads(res.to_json()) | extra, indent=2))
        else:
            typer.echo(format_plan(res))
        if form is not None and not as_json:
            typer.echo(held_line(form, quantize, mspec.expert_bits))
        if lines and not as_json:
            typer.echo(lines)
        if save_policy is not None:
            res.policy.save(save_policy)
        if plot is not None:
            from hrm.plots import plot_all

            used = used_hw(hw, gpus)
            p = res.policy
            paths = plot_all(used, mspec, workload, dtype, plot, micro_batch=p.mu, r_w=p.r_w)
            if not as_json:
                typer.echo("plots: " + ", ".join(str(p) for p in paths))


def _quantize_advice(held, quantize: str, ranks: int, name: str, planned) -> str:
    """Whether the plan refused with 16-bit experts fits with --quantize int8 or int4 (`planned(spec)`: the
    planner's result for a model spec, InfeasibleError where it does not fit either)."""
    from moelight.planning.quantize_advice import planned_text, quantize_advice
    from optimizer import InfeasibleError

    def fits(cfg) -> str | None:
        try:
            res = planned(held_model_spec(cfg, name))
        except InfeasibleError:
            return None
        return planned_text(res.policy.batch_size, res.e2e_tok_s)

    return quantize_advice(held, quantize, ranks, fits)
