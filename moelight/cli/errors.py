"""Turning user-facing errors into one clear line on stderr and exit code 2, not a traceback."""

from __future__ import annotations

import contextlib

import typer


def user_error_types() -> tuple[type[BaseException], ...]:
    from moelight.errors import MoelightError
    from moelight.tokenization.tokenizer import TokenizerError
    from workloads import DatasetError, OutputExistsError, OutputPathError, OutputWriteError

    return (MoelightError, DatasetError, OutputExistsError, OutputPathError, OutputWriteError, TokenizerError)


@contextlib.contextmanager
def user_errors():
    try:
        yield
    except user_error_types() as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
