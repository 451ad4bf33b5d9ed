"""The `moelight` command line: one typer app, one module per subcommand."""

from __future__ import annotations

import typer

from moelight.cli import cache_cmd, plan_cmd, profile_cmd, run_cmd, simulate_cmd, trace_cmd

app = typer.Typer(add_completion=False, no_args_is_help=True, help="moelight: batch inference for MoE LLMs")

for _module in (run_cmd, plan_cmd, profile_cmd, simulate_cmd, trace_cmd, cache_cmd):
    _module.register(app)


def main() -> None:
    app()
