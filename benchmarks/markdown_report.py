"""What benchmarks share: the commit they ran at, and a Markdown report printed and saved."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def commit() -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          cwd=ROOT).stdout.strip()


def emit(lines: list[str], output: Path | None) -> None:
    """Print the report; write it to `output` too when given."""
    text = "\n".join(lines) + "\n"
    print(text)
    if output:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(text)
