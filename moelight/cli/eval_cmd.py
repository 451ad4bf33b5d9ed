"""`moelight eval`: lm-evaluation-harness tasks on moelight (the `moelight` model of lm-eval's registry)."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from moelight.cli.errors import user_errors

Opt = typer.Option


def eval_(
    model: str = Opt(..., "--model", help="Hugging Face model folder or preset"),
    tasks: str = Opt(..., "--tasks", help="comma-separated lm-eval task names (or of tasks in --include-path)"),
    output: Path = Opt(..., "--output", help="the results: a .json file (metrics, and every item's responses)"),
    include_path: Path = Opt(None, "--include-path", help="a folder of your own task YAMLs"),
    limit: float = Opt(None, "--limit", help="items per task (a count, or a share < 1)"),
    num_fewshot: int = Opt(None, "--num-fewshot", min=0),
    dtype: str = Opt("auto", "--dtype", help="auto, float32, bfloat16 or float16"),
    load_format: str = Opt("auto", "--load-format", help="auto, safetensors, or dummy (random weights)"),
    device: str = Opt("auto", "--device", help="auto, cpu, cuda (or cuda:N) or emulated"),
    hardware: str = Opt(None, "--hardware", help="hardware to plan for (default: this machine's profile)"),
    seed: int = Opt(0, "--seed"),
    apply_chat_template: bool = Opt(False, "--apply-chat-template",
                                    help="format each prompt with the model's chat template (lm-eval's option)"),
    add_bos_token: bool = Opt(None, "--add-bos-token/--no-add-bos-token",
                              help="BOS before every text, or none (default: the tokenizer's own choice)"),
    overwrite: bool = Opt(False, "--overwrite", help="replace an existing --output"),
) -> None:
    """Run lm-eval's evaluator with moelight as the model; print each task's metrics, save everything."""
    from moelight.engine.options import OptionError
    from moelight.jobs.path_checks import check_not_replaced, check_output_file

    with user_errors():
        try:
            import lm_eval
            from lm_eval.tasks import TaskManager

            from moelight.api.lm_eval_model import MoelightLM, engine_device  # registers the `moelight` model
        except ImportError:
            raise OptionError('moelight eval needs lm-evaluation-harness: pip install -e ".[eval]"') from None
        device = engine_device(device)
        if limit is not None and limit <= 0:
            raise OptionError(f"--limit {limit:g}: give a count of items per task (1 or more) or a share "
                              "between 0 and 1 (0.1 for a tenth)")
        if output.suffix.lower() != ".json":
            raise OptionError(f"--output {output}: the results are written as a .json file")
        check_not_replaced(output, overwrite)
        check_output_file(output, "--output", [("model folder", Path(model))] if Path(model).exists() else [])
        if include_path is not None and not include_path.is_dir():
            raise OptionError(f"--include-path {include_path}: not a folder of task YAMLs")
        names = [t.strip() for t in tasks.split(",") if t.strip()]
        manager = None
        if include_path is not None:  # lm-eval's own ~15k task files take seconds to index: only if needed
            manager = TaskManager(include_path=str(include_path), include_defaults=False)
            if any(t not in manager.all_tasks for t in names):
                manager = None
        manager = manager or TaskManager(include_path=str(include_path) if include_path else None)
        unknown = [t for t in names if t not in manager.all_tasks]
        if unknown:
            raise OptionError(f"--tasks: unknown task(s) {', '.join(unknown)}"
                              + ("" if include_path else "; pass --include-path for tasks of your own"))
        lm = MoelightLM(model, dtype=dtype, load_format=load_format, device=device, hardware=hardware, seed=seed,
                        add_bos_token=add_bos_token)
        results = lm_eval.simple_evaluate(model=lm, tasks=names, task_manager=manager, num_fewshot=num_fewshot,
                                          limit=limit, log_samples=True, random_seed=seed,
                                          apply_chat_template=apply_chat_template)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(results, indent=1, default=str) + "\n")
    for task, metrics in results["results"].items():
        shown = ", ".join(f"{k} {v:.4f}" for k, v in metrics.items() if isinstance(v, float))
        typer.echo(f"{task}: {shown}")
    typer.echo(f"results: {output}")


def register(app: typer.Typer) -> None:
    app.command("eval")(eval_)
