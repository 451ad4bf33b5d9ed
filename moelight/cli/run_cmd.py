"""`moelight run`: batch generation over a dataset file."""

from __future__ import annotations

from pathlib import Path

import typer

from moelight.cli.errors import user_errors


def run(
    dataset: Path = typer.Option(..., "--dataset", help="MT-Bench question.jsonl, jsonl with 'prompt', OpenAI batch jsonl, or parquet"),
    model: str = typer.Option(..., "--model", help="Hugging Face model folder or preset (tiny, bench-1b, mixtral-8x7b, mixtral-8x22b)"),
    output: Path = typer.Option(..., "--output", help="results file: .jsonl or .parquet (OpenAI batch output for OpenAI batch input)"),
    gen_len: int = typer.Option(128, "--gen-len", min=1, help="max new tokens per request (a request's own max_tokens wins)"),
    dtype: str = typer.Option("auto", "--dtype", help="auto, float32, bfloat16 or float16"),
    load_format: str = typer.Option("auto", "--load-format", help="auto, safetensors, or dummy (random weights)"),
    batch_size: int = typer.Option(None, "--batch-size", min=1, help="sequences per batch N (default: up to 256)"),
    micro_batch_size: int = typer.Option(None, "--micro-batch-size", min=1, help="sequences per micro-batch (default: N)"),
    seed: int = typer.Option(0, "--seed", help="base seed: request r samples with seed + crc32(id)"),
    temperature: float = typer.Option(0.0, "--temperature", min=0.0, help="0 = greedy"),
    top_p: float = typer.Option(1.0, "--top-p"),
    top_k: int = typer.Option(0, "--top-k", help="0 = off"),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="always generate --gen-len tokens (benchmarking)"),
    turn: int = typer.Option(1, "--turn", min=1, max=2, help="MT-Bench: 2 runs both turns as a conversation"),
    num_requests: int = typer.Option(None, "--num-requests", min=1, help="replicate/truncate the dataset to K requests"),
    dataset_format: str = typer.Option(None, "--format", help="force the dataset format: mtbench, jsonl, openai, parquet"),
    prompt_column: str = typer.Option("prompt", "--prompt-column", help="parquet prompt column"),
    skip_bad_lines: bool = typer.Option(False, "--skip-bad-lines", help="go on without malformed records / bad prompts"),
    resume: bool = typer.Option(False, "--resume", help="skip requests whose ids are already in --output"),
    overwrite: bool = typer.Option(False, "--overwrite", help="replace an existing --output"),
    tokenizer: str = typer.Option("auto", "--tokenizer", help="auto (tokenizer.json), hf, or byte"),
    max_prefill_tokens: int = typer.Option(4096, "--max-prefill-tokens", min=1, help="tokens per prefill pass"),
    progress: bool = typer.Option(True, "--progress/--no-progress"),
) -> None:
    """Generate for every request of a dataset; stream results to --output; print a report."""
    from moelight.runner import RunOptions, report_path, run_job

    opts = RunOptions(**{k: v for k, v in locals().items() if k in RunOptions.__dataclass_fields__})
    with user_errors():
        report = run_job(opts)
    typer.echo(report.summary())
    typer.echo(f"results: {output}   report: {report_path(output)}")
    if report.interrupted:
        typer.echo("interrupted: every finished result is in the output; rerun with --resume to continue", err=True)
        raise typer.Exit(130)


def register(app: typer.Typer) -> None:
    app.command("run")(run)
