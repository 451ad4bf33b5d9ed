"""`moelight run`: batch generation over a dataset file, with the HRM policy by default."""

from __future__ import annotations

from pathlib import Path

import typer

from moelight.cli.errors import user_errors
from moelight.expert_cache.policy_registry import POLICIES as CACHE_POLICIES
from optimizer.policy import size_text

Opt = typer.Option


def run(
    dataset: Path = Opt(..., "--dataset",
                        help="MT-Bench question.jsonl, jsonl with 'prompt', OpenAI batch jsonl, or parquet"),
    model: str = Opt(..., "--model",
                     help="Hugging Face model folder, a preset (tiny, bench-1b, mixtral-8x7b, deepseek-v3, ...: "
                          "an unknown name lists them all), or a CoE spec (.json) naming several"),
    output: Path = Opt(..., "--output",
                       help="results file: .jsonl or .parquet (OpenAI batch output for OpenAI batch input)"),
    gen_len: int = Opt(128, "--gen-len", min=1,
                       help="max new tokens per request (a request's own max_tokens wins)"),
    dtype: str = Opt("auto", "--dtype", help="auto, float32, bfloat16 or float16"),
    load_format: str = Opt("auto", "--load-format", help="auto, safetensors, or dummy (random weights)"),
    quantize: str = Opt("none", "--quantize", help="routed experts quantized at load: none, int8 (per channel), "
                        "int4 (groups of 128 input channels), int4-g64, int4-g32; attention stays 16-bit"),
    batch_size: int = Opt(None, "--batch-size", min=1, help="sequences per batch N (default: the policy's)"),
    micro_batch_size: int = Opt(None, "--micro-batch-size", min=1,
                                help="sequences per micro-batch (default: the policy's)"),
    policy: str = Opt("auto", "--policy",
                      help="auto (plan with the HRM) or a policy JSON from `moelight plan --save-policy`"),
    hardware: str = Opt(None, "--hardware",
                        help="hardware to plan for: a preset, 'profile' or a JSON path (default: the cached "
                             "profile; without one a quick profile is taken and cached)"),
    gpus: int = Opt(None, "--gpus", min=0, help="GPUs the plan may use (0 = CPU only)"),
    device: str = Opt("auto", "--device", help="auto, cpu, cuda, or emulated (CGOPipe on an emulated accelerator)"),
    schedule: str = Opt("cgopipe", "--schedule", help="pipeline schedule on cuda/emulated: cgopipe, flexgen, "
                        "flexgen-cpu, overlap-unpaged"),
    seed: int = Opt(0, "--seed", help="base seed: request r samples with seed + crc32(id)"),
    temperature: float = Opt(0.0, "--temperature", min=0.0, help="0 = greedy"),
    top_p: float = Opt(1.0, "--top-p", help="nucleus sampling, in (0, 1]; 1 = off"),
    top_k: int = Opt(0, "--top-k", help="sample from the k most likely tokens; 0 or -1 = off"),
    ignore_eos: bool = Opt(False, "--ignore-eos", help="always generate --gen-len tokens (benchmarking)"),
    turn: int = Opt(1, "--turn", min=1, max=2, help="MT-Bench: 2 runs both turns as a conversation"),
    num_requests: int = Opt(None, "--num-requests", min=1,
                            help="replicate/truncate the dataset to K requests"),
    dataset_format: str = Opt(None, "--format",
                              help="force the dataset format: mtbench, jsonl, openai, parquet"),
    prompt_column: str = Opt("prompt", "--prompt-column", help="parquet prompt column"),
    skip_bad_lines: bool = Opt(False, "--skip-bad-lines",
                               help="go on without malformed records / bad prompts"),
    resume: bool = Opt(False, "--resume", help="skip requests whose ids are already in --output"),
    overwrite: bool = Opt(False, "--overwrite", help="replace an existing --output"),
    tokenizer: str = Opt("auto", "--tokenizer", help="auto (tokenizer.json), hf, byte, or a folder holding one"),
    max_prefill_tokens: int = Opt(4096, "--max-prefill-tokens", min=1, help="tokens per prefill pass"),
    mode: str = Opt("auto", "--mode", help="throughput (CGOPipe), latency (a device expert cache for small "
                    "batches), or auto: the faster by the HRM"),
    cache_policy: str = Opt("auto", "--cache-policy", help=f"latency mode: {', '.join(CACHE_POLICIES)}; auto: "
                            "moe-infinity when --eamc is given, else combined"),
    cache_size: float = Opt(None, "--cache-size", help="latency mode: expert slots, a share of all experts (< 1) "
                            "or a count (default: what fits on the device)"),
    eamc: str = Opt(None, "--eamc", help="MoE-Infinity's EAM collection (`moelight eamc`)"),
    prefetch_per_layer: int = Opt(None, "--prefetch-per-layer", help="latency mode: prefetches per layer pass in "
                                  "place of the policy's own budget, for the policies that prefetch (all but "
                                  "on-demand, lru, lfu, coserve) (default: the policy's own budget, 1 for combined "
                                  "and every predicted expert for promoe / duoserve, else as many experts as the "
                                  "link moves during one layer)"),
    predictor: str = Opt(None, "--predictor", help="promoe / duoserve / coserve: their file from "
                         "`moelight train-predictor`"),
    coe_order: str = Opt("grouped", "--coe-order", help="a CoE job (--model coe.json): grouped (each model's "
                         "requests together, CoServe) or fcfs (dataset order)"),
    # \\[ keeps "[ray]" from being read as rich markup (and dropped)
    ray: str = Opt(None, "--ray", help="run as a Ray Data pipeline: --ray alone starts a local Ray cluster, "
                   "--ray auto connects to a running one, --ray ADDRESS to that one (pip install -e '.\\[ray]')"),
    ray_replicas: str = Opt("1", "--ray-replicas", help="with --ray: engines (Ray actors), a count or MIN-MAX "
                            "for an autoscaling pool"),
    ray_cpus_per_replica: float = Opt(None, "--ray-cpus-per-replica", help="with --ray: CPUs per engine (a "
                                      "CPU engine runs that many threads; default: the cluster's CPUs / replicas)"),
    ray_gpus_per_replica: float = Opt(0.0, "--ray-gpus-per-replica", help="with --ray: GPUs per engine"),
    progress: bool = Opt(True, "--progress/--no-progress"),
    refill: bool = Opt(True, "--refill/--static-batches",
                       help="refill freed KV slots with waiting requests (default), or run static batches of N"),
    enable_prefix_caching: bool = Opt(True, "--enable-prefix-caching/--no-enable-prefix-caching",
                                      help="compute a prefix shared by requests (a system prompt, few-shot examples, "
                                      "the n samples of a prompt) once and share its KV pages (default on; "
                                      "DeepSeek's latent cache too)"),
) -> None:
    """Generate for every request of a dataset; stream results to --output; print a report."""
    from moelight.jobs.dataset_job import run_job
    from moelight.jobs.interrupt_flag import sigterm_as_interrupt
    from moelight.jobs.output_file import output_bytes, report_path, results_place
    from moelight.jobs.run_options import RunOptions

    opts = RunOptions(**{k: v for k, v in locals().items() if k in RunOptions.__dataclass_fields__})
    opts.log = lambda line: typer.echo(line, err=True)
    bytes_before = output_bytes(output)
    with sigterm_as_interrupt() as stopped:
        try:
            with user_errors():
                report = run_job(opts)
        except KeyboardInterrupt:  # before the job could report: reading, planning, or saving the report
            if output_bytes(output) != bytes_before:
                typer.echo(f"interrupted: the results finished before the stop are in {results_place(output)} (its "
                           "report may not be saved); rerun with --resume to continue", err=True)
            else:
                typer.echo(f"interrupted before any result was written: {output} was not touched", err=True)
            raise typer.Exit(stopped["exit"]) from None
    if report is None:  # a torchrun rank other than 0: rank 0 prints and writes
        return
    typer.echo(report.summary())
    p = report.prediction
    if p:
        typer.echo(f"predicted     prefill {p['prefill_tokens_per_s']:.1f} tok/s, decode "
                   f"{p['decode_tokens_per_s']:.1f} tok/s (HRM, bound by {p['binding']}; "
                   f"policy {report.policy.get('source', '?')})")
        peak = (report.runtime or {}).get("device_memory_peak")
        if peak and p.get("gpu_memory_bytes"):  # a device ran: its measured peak beside what the plan counted
            typer.echo(f"device memory {size_text(peak)} peak, {size_text(p['gpu_memory_bytes'])} predicted (HRM)")
    typer.echo(f"results: {output}   report: {report_path(output)}")
    if report.interrupted:
        if report.written or report.already_in_output:
            typer.echo(f"interrupted: the {report.written} result(s) finished in this run are in the output "
                       f"(with {report.already_in_output} from before); rerun with --resume to continue", err=True)
        else:
            typer.echo(f"interrupted before any result was written: nothing was written to {output}", err=True)
        raise typer.Exit(stopped["exit"])


def register(app: typer.Typer) -> None:
    app.command("run")(run)
