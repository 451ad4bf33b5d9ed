"""`moelight trace`: record which experts a job's tokens choose (routing traces for expert caches)."""

from __future__ import annotations

from pathlib import Path

import typer

from moelight.cli.errors import user_errors

Opt = typer.Option


def trace(
    model: str = Opt(..., "--model", help="Hugging Face model folder or preset"),
    dataset: Path = Opt(..., "--dataset", help="MT-Bench question.jsonl, jsonl with 'prompt', OpenAI batch, parquet"),
    output: Path = Opt(..., "--output",
                       help="the trace: a .parquet file (format: moelight/expert_cache/routing_trace.py)"),
    gen_len: int = Opt(64, "--gen-len", min=1, help="new tokens per request (a request's own max_tokens wins)"),
    num_requests: int = Opt(None, "--num-requests", min=1, help="replicate/truncate the dataset to K requests"),
    hidden: bool = Opt(False, "--hidden", help="also record each MoE block's input hidden state"),
    dtype: str = Opt("auto", "--dtype", help="auto, float32, bfloat16 or float16"),
    load_format: str = Opt("auto", "--load-format", help="auto, safetensors, or dummy (random weights)"),
    dataset_format: str = Opt(None, "--format", help="force the dataset format: mtbench, jsonl, openai, parquet"),
    temperature: float = Opt(0.0, "--temperature", min=0.0, help="0 = greedy"),
    ignore_eos: bool = Opt(False, "--ignore-eos", help="always generate --gen-len tokens"),
    seed: int = Opt(0, "--seed"),
    tokenizer: str = Opt("auto", "--tokenizer", help="auto, hf or byte (a folder without tokenizer.json: byte)"),
    skip_bad_lines: bool = Opt(False, "--skip-bad-lines", help="go on without malformed records and unusable "
                               "prompts (they are listed)"),
    overwrite: bool = Opt(False, "--overwrite", help="replace an existing --output"),
    progress: bool = Opt(True, "--progress/--no-progress"),
) -> None:
    """Run every request alone on the CPU executor and write its routing, token by token and layer by layer
    (each of the n samples of a request with n > 1 as a sequence of its own, `ID#k`)."""
    from moelight.engine.options import OptionError
    from moelight.jobs.path_checks import check_not_replaced
    from moelight.jobs.run_options import RunOptions
    from moelight.jobs.trace_job import run_trace_job

    with user_errors():
        if output.suffix.lower() != ".parquet":
            raise OptionError(f"--output {output}: a trace is a .parquet file")
        check_not_replaced(output, overwrite)
        opts = RunOptions(model=model, dataset=dataset, output=output, gen_len=gen_len, num_requests=num_requests,
                          dtype=dtype, load_format=load_format, dataset_format=dataset_format,
                          temperature=temperature, ignore_eos=ignore_eos, seed=seed, device="cpu", overwrite=True,
                          tokenizer=tokenizer, skip_bad_lines=skip_bad_lines)
        result = run_trace_job(opts, hidden=hidden, progress=progress)
    rows = sum(r.tokens for r in result.requests) * len(result.model.moe_layers)
    typer.echo(f"traced {len(result.requests)} sequences, {rows} (token, layer) rows: {output}")


def register(app: typer.Typer) -> None:
    app.command("trace")(trace)
