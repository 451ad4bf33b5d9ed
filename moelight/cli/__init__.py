"""The `moelight` command line: one typer app, one module per subcommand."""

from __future__ import annotations

import typer

from moelight.cli import cache_cmd, eval_cmd, plan_cmd, profile_cmd, run_cmd, simulate_cmd, trace_cmd

app = typer.Typer(add_completion=False, no_args_is_help=True, help="moelight: batch inference for MoE LLMs")

for _module in (run_cmd, plan_cmd, profile_cmd, simulate_cmd, trace_cmd, cache_cmd, eval_cmd):
    _module.register(app)


def main(argv: list[str] | None = None) -> None:
    import sys
    import warnings

    warnings.formatwarning = _one_line_warning
    app(args=with_ray_default(sys.argv[1:] if argv is None else argv), prog_name="moelight")


def with_ray_default(argv: list[str]) -> list[str]:
    """`--ray` without an address means a local cluster: give typer the value it needs."""
    out = list(argv)
    for i, arg in enumerate(out):
        if arg == "--ray" and (i + 1 == len(out) or out[i + 1].startswith("-")):
            out.insert(i + 1, "local")
            break
    return out


def _one_line_warning(message, category, filename, lineno, line=None) -> str:
    """A warning on the command line reads as one line for the user, not a source location."""
    return f"warning: {message}\n"
